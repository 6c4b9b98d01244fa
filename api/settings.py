"""Service settings, read from the environment (prefix ``AUTOTUNE_``)."""

from __future__ import annotations

from pydantic import SecretStr

from storage.settings import StorageSettings


class ApiSettings(StorageSettings):
    """``AUTOTUNE_DB_URL``, ``AUTOTUNE_API_TOKEN`` (bearer token that writes need),
    ``AUTOTUNE_ALLOW_ANONYMOUS_WRITES`` (accept writes without a token; off by default) and
    ``AUTOTUNE_LOOKUP_CACHE_SIZE``."""

    api_token: SecretStr | None = None
    allow_anonymous_writes: bool = False
    db_pool_size: int = 8  # per worker process; the threadpool runs up to 40 requests at once
    lookup_cache_size: int = 4096  # cached lookup answers per worker (SQLite only); 0: none
