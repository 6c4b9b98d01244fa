"""The named kernels' part of a tuned result's median (``kernel_median_ms``): the tuner now
ranks by the whole step's device time (``step_profile`` timing) and keeps the kernels' own
time beside it as a breakdown.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

TABLES = ("autotune_configs", "autotune_config_history")


def upgrade() -> None:
    # A frozen copy of storage.models._ResultColumns.kernel_median_ms at this revision; results
    # stored before keep null: they were timed without the breakdown.
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("kernel_median_ms", sa.Float(), nullable=True))


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("kernel_median_ms")
