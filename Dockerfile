# The lookup service: `autotune serve` on port 8000, database in /data.
#   docker build -t flash-autotune .                                    # service image (serve)
#   docker build --build-arg EXTRAS=tune,tpu -t flash-autotune:tune .   # tuning image, TPU VMs
# A tuning image runs the command it is given (`docker run ... autotune tune ...`); its default
# command, the service, exits 2 naming the `serve` extra it lacks.
FROM python:3.11-slim

ARG EXTRAS="serve"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    AUTOTUNE_DB_URL=sqlite:////data/autotune.db

WORKDIR /app
COPY pyproject.toml README.md ./
COPY kernel ./kernel
COPY storage ./storage
COPY present ./present
COPY api ./api
COPY autotune ./autotune
RUN pip install ".[${EXTRAS}]" \
    && useradd --create-home --uid 10001 autotune \
    && mkdir /data && chown autotune /data

USER autotune
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"
# Create or migrate the schema, then serve (writes need AUTOTUNE_API_TOKEN).
CMD ["sh", "-c", "autotune db upgrade && exec autotune serve --host 0.0.0.0 --port 8000"]
