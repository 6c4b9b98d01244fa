"""Storage settings, read from the environment (prefix ``AUTOTUNE_``)."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DB_URL = "sqlite:///autotune.db"


class StorageSettings(BaseSettings):
    """``AUTOTUNE_DB_URL``: any SQLAlchemy URL; PostgreSQL as ``postgresql+psycopg://...``."""

    model_config = SettingsConfigDict(env_prefix="AUTOTUNE_", extra="ignore")

    db_url: str = DEFAULT_DB_URL
