"""Service settings, read from the environment (prefix ``AUTOTUNE_``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, SecretStr, field_validator

from storage.settings import StorageSettings


class ApiSettings(StorageSettings):
    """``AUTOTUNE_DB_URL``, ``AUTOTUNE_API_TOKEN`` (bearer token that writes need),
    ``AUTOTUNE_ALLOW_ANONYMOUS_WRITES`` (accept writes without a token; off by default),
    ``AUTOTUNE_LOOKUP_CACHE_SIZE``, and the connection limits of ``autotune serve`` per worker:
    ``AUTOTUNE_MAX_CONNECTIONS`` (more get a 503), ``AUTOTUNE_KEEP_ALIVE_S`` (idle time
    between requests), ``AUTOTUNE_READ_TIMEOUT_S`` (time to send a whole request) and
    ``AUTOTUNE_MAX_BODY_BYTES`` (larger bodies of a write get a 413) and
    ``AUTOTUNE_MAX_LOOKUP_BODY_BYTES`` (the same for the body of a lookup, which needs no
    token); ``AUTOTUNE_MAX_PAGE_RENDERS`` (HTML pages built at once; more wait without holding
    a thread, so lookups keep the threadpool)."""

    api_token: SecretStr | None = None
    allow_anonymous_writes: bool = False
    db_pool_size: int = 8  # per worker process; the threadpool runs up to 40 requests at once
    lookup_cache_size: int = 4096  # cached lookup answers per worker (SQLite only); 0: none
    max_connections: Annotated[int, Field(ge=1, le=100_000)] = 1000
    keep_alive_s: Annotated[int, Field(ge=1, le=3600)] = 5
    read_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    # A write's JSON body: a table of about 4,500 entries of 900 bytes.
    max_body_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 4 << 20
    # A lookup's (no token): a batch of 100 keys is about 20 KiB; 4 MiB of ``{}`` took
    # seconds of the event loop to parse.
    max_lookup_body_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 64 << 10
    # Pages draw their plots one at a time (matplotlib): 40 page views at once held every thread
    # of the pool, and lookups waited behind them (0.04 s -> 1.1 s while a tune wrote).
    max_page_renders: Annotated[int, Field(ge=1, le=32)] = 4

    @field_validator("api_token")
    @classmethod
    def _empty_is_unset(cls, token: SecretStr | None) -> SecretStr | None:
        """An empty ``AUTOTUNE_API_TOKEN`` is no token (writes refused with a 403). One that
        starts or ends with whitespace is refused, not stripped: an HTTP header's value loses
        it, so no client's bearer token would match it, and a stripped one would be another
        token than the one its clients were given."""
        if token is None or not token.get_secret_value():
            return None
        if token.get_secret_value() != token.get_secret_value().strip():
            raise ValueError("the token starts or ends with whitespace, which no HTTP header "
                             "carries (no bearer token would match it); remove the whitespace")
        return token
