"""Alembic environment: run by ``storage.schema.upgrade`` on a connection it passes in."""

from __future__ import annotations

from alembic import context

from storage.models import Base
from storage.schema import VERSION_TABLE


def include_object(obj, name, type_, reflected, compare_to) -> bool:  # noqa: ANN001
    """Only our tables: Optuna's tables share the database and are not ours to migrate."""
    table_name = name if type_ == "table" else getattr(getattr(obj, "table", None), "name", None)
    return table_name is None or table_name in Base.metadata.tables


def run_migrations() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("run migrations with `autotune db upgrade` or storage.upgrade(url)")
    context.configure(connection=connection, target_metadata=Base.metadata,
                      version_table=VERSION_TABLE, include_object=include_object,
                      render_as_batch=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
