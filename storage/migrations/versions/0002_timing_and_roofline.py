"""Timing method and roofline figures of each tuned result (issue 15).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TABLES = ("autotune_configs", "autotune_config_history")


def _columns() -> list[sa.Column]:
    """The new columns (a frozen copy of storage.models at this revision); all nullable, so
    results stored before keep null: their timing was never recorded."""
    return [sa.Column("timing", sa.String(16), nullable=True),
            sa.Column("achieved_tflops", sa.Float(), nullable=True),
            sa.Column("roofline_fraction", sa.Float(), nullable=True),
            sa.Column("roofline_bound", sa.String(16), nullable=True)]


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            for column in _columns():
                batch.add_column(column)


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            for column in reversed(_columns()):
                batch.drop_column(column.name)
