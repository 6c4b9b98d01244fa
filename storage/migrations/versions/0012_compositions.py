"""The batch compositions a tuned result's trials ran (``compositions``, issue 73 item 2): a
serving step's trial measures the kernel over a fixed set of batches, recorded with the result.
Nullable JSON on every results table; rows stored before keep null (one call, or a serving
result measured before the compositions existed).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

TABLES = ("autotune_configs", "autotune_config_history", "autotune_serving_configs",
          "autotune_serving_config_history")


def upgrade() -> None:
    # A frozen copy of storage.models._MeasuredColumns.compositions at this revision.
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("compositions", sa.JSON(), nullable=True))


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("compositions")
