"""The timing method of each kernel choice's confirmation.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

TABLE = "autotune_kernel_choices"


def upgrade() -> None:
    # A frozen copy of storage.models.KernelChoiceRow.timing at this revision; choices stored
    # before keep null: their timing was never recorded.
    with op.batch_alter_table(TABLE) as batch:
        batch.add_column(sa.Column("timing", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table(TABLE) as batch:
        batch.drop_column("timing")
