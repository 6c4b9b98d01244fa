"""The model step's confirmation of each kernel choice (autotune.step_choice): every table's
step time and spread, the rounds and the timing; a choice the step changed has method
``model_step``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

TABLE = "autotune_kernel_choices"


def upgrade() -> None:
    # A frozen copy of storage.models.KernelChoiceRow.step_confirmation at this revision;
    # choices stored before keep null: no step confirmed them.
    with op.batch_alter_table(TABLE) as batch:
        batch.add_column(sa.Column("step_confirmation", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table(TABLE) as batch:
        batch.drop_column("step_confirmation")
