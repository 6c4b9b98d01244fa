"""Storage of tuned configs: SQLAlchemy models, Alembic migrations and a small typed ``Store``.

Never imports jax (only the pure-Python parts of ``kernel``), so the service stays light.
"""

from storage.engine import DatabaseUrlError, ReadOnlyDatabaseError, make_engine, normalize_url
from storage.results import (
    MAX_STORED_INT,
    METHODS,
    ROOFLINE_BOUNDS,
    TIMINGS,
    ConfigKey,
    Entry,
    PublishOutcome,
    ResultError,
    SchemaError,
    StorageError,
    TunedResult,
)
from storage.schema import schema_is_current, schema_problem, upgrade
from storage.settings import DEFAULT_DB_URL, StorageSettings
from storage.store import FILTER_FIELDS, HistoryEntry, LookupRequest, Store

__all__ = [
    "DEFAULT_DB_URL", "FILTER_FIELDS", "MAX_STORED_INT", "METHODS", "ROOFLINE_BOUNDS", "TIMINGS",
    "ConfigKey", "DatabaseUrlError", "Entry", "HistoryEntry", "LookupRequest", "PublishOutcome",
    "ReadOnlyDatabaseError", "ResultError", "SchemaError", "StorageError", "StorageSettings",
    "Store", "TunedResult", "make_engine", "normalize_url", "schema_is_current",
    "schema_problem", "upgrade",
]
