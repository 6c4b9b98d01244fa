#!/usr/bin/env bash
# The wheels a TPU VM's chip run needs beside its own JAX 0.10.2 (bench/tpu_session.sh installs
# them with --no-deps, then flax, optax, jaxtyping, matplotlib and scikit-learn from the VM's
# own package index): the `tune` extra's packages, httpx for the test stages and, with `peers`, the `peers` extra's
# (tokamax, tune-jax; issue 72). Run here, in the repository root, before a device call that
# carries .whl-tpu (keep it out of git: `echo /.whl-tpu/ >> .git/info/exclude`):
#   bash bench/chip_wheels.sh [peers]
# Versions: those a Python 3.11 venv with jax 0.10.2 resolves for the project (2026-12-07).
set -euo pipefail
cd "$(dirname "$0")/.."
TUNE=(optuna==5.1.0 alembic==1.20.1 SQLAlchemy==2.1.9 Mako==1.4.3 MarkupSafe==3.0.4
      colorlog==6.12.0 PyYAML==6.0.4 typer==0.29.2 click==8.3.1 rich==15.0.0
      markdown-it-py==4.3.0 mdurl==0.1.2 Pygments==2.21.0 shellingham==1.5.4
      annotated-doc==0.0.7 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5 typing_extensions==4.16.0 pydantic-settings==2.16.3
      python-dotenv==1.2.4 xprof==2.24.2 protobuf==7.36.2 packaging==26.4 tqdm==4.70.1
      Jinja2==3.1.6)
# What tests/conftest.py imports, for the stages that run test files on the chip (kernelpeers,
# kerneltests): httpx and its dependencies.
TEST=(httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1
      certifi==2026.10.19.post1 idna==3.21)
PEERS=(tokamax==0.0.12 tune-jax==0.8.3 einshape==1.0 immutabledict==4.3.1 typeguard==2.13.3
       tabulate==0.10.0 qwix==0.1.8)
wanted=("${TUNE[@]}" "${TEST[@]}"); [ "${1:-}" = peers ] && wanted+=("${PEERS[@]}")
rm -rf .whl-tpu
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d .whl-tpu "${wanted[@]}"
du -sh .whl-tpu
