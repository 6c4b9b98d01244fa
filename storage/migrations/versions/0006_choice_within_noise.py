"""Whether each kernel choice kept the platform's default kernel although another candidate
measured faster, by no more than the noise.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

TABLE = "autotune_kernel_choices"


def upgrade() -> None:
    # A frozen copy of storage.models.KernelChoiceRow.within_noise at this revision; choices
    # stored before keep null: the noise rule did not exist when they were taken.
    with op.batch_alter_table(TABLE) as batch:
        batch.add_column(sa.Column("within_noise", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table(TABLE) as batch:
        batch.drop_column("within_noise")
