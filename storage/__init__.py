"""Storage of tuned configs: SQLAlchemy models, Alembic migrations and a small typed ``Store``.

Never imports jax (only the pure-Python parts of ``kernel``), so the service stays light.
"""

from storage.choices import StoredChoice
from storage.engine import (
    DatabaseFullError,
    DatabaseUrlError,
    ReadOnlyDatabaseError,
    WriteRefusedError,
    make_engine,
    normalize_url,
    shown_url,
)
from storage.results import (
    CURRENT_TIMINGS,
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
    check_text,
    unknown_timing,
)
from storage.schema import check_writable, schema_is_current, schema_problem, upgrade
from storage.settings import DEFAULT_DB_URL, StorageSettings
from storage.store import (
    CHOICE_FILTER_FIELDS,
    FILTER_FIELDS,
    HistoryEntry,
    LookupRequest,
    Store,
)

__all__ = [
    "CHOICE_FILTER_FIELDS", "CURRENT_TIMINGS", "ConfigKey", "DEFAULT_DB_URL", "DatabaseFullError",
    "DatabaseUrlError", "Entry", "FILTER_FIELDS", "HistoryEntry", "LookupRequest",
    "MAX_STORED_INT", "METHODS", "PublishOutcome", "ROOFLINE_BOUNDS", "ReadOnlyDatabaseError",
    "ResultError", "SchemaError", "StorageError", "StorageSettings", "Store", "StoredChoice",
    "TIMINGS", "TunedResult", "WriteRefusedError", "check_text", "check_writable",
    "make_engine", "normalize_url", "shown_url", "schema_is_current", "schema_problem",
    "unknown_timing", "upgrade",
]
