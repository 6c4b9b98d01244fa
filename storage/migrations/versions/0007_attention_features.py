"""The problem key gains a sliding window, a logit softcap and segment ids (issue 48).

Rows stored before have no window, no softcap and no segment ids. "None" is stored as a value
no problem has (-1, 0.0), not NULL: SQL unique keys treat NULLs as distinct. The downgrade
deletes the rows that use a feature: the older key cannot tell them from the plain problem's.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# Frozen copies of storage.models at this revision and at 0006.
PROBLEM = ["dtype", "head_dim", "causal", "mode"]
FEATURES = ["window_left", "window_right", "segmented"]
SIZES = ["batch", "q_heads", "kv_heads", "q_len", "kv_len"]
OLD_KEY = ["kernel", "kernel_version", "device_kind", *PROBLEM, *SIZES, "platform"]
NEW_KEY = ["kernel", "kernel_version", "device_kind", *PROBLEM, *FEATURES, *SIZES, "softcap",
           "platform"]
OLD_CHOICE_KEY = ["device_kind", *PROBLEM, *SIZES, "platform"]
NEW_CHOICE_KEY = ["device_kind", *PROBLEM, *FEATURES, *SIZES, "softcap", "platform"]
TABLES = ("autotune_configs", "autotune_config_history", "autotune_kernel_choices")
UNIQUE = {"autotune_configs": ("uq_autotune_configs_key", OLD_KEY, NEW_KEY),
          "autotune_kernel_choices": ("uq_autotune_kernel_choices_key", OLD_CHOICE_KEY,
                                      NEW_CHOICE_KEY)}
HISTORY_INDEX = "ix_autotune_config_history_key"


def _columns() -> list[sa.Column]:
    return [sa.Column("window_left", sa.Integer(), nullable=False, server_default="-1"),
            sa.Column("window_right", sa.Integer(), nullable=False, server_default="-1"),
            sa.Column("softcap", sa.Float(), nullable=False, server_default="0.0"),
            sa.Column("segmented", sa.Boolean(), nullable=False, server_default=sa.false())]


def upgrade() -> None:
    op.drop_index(HISTORY_INDEX, table_name="autotune_config_history")
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            if table in UNIQUE:
                batch.drop_constraint(UNIQUE[table][0], type_="unique")
            for column in _columns():
                batch.add_column(column)
            if table in UNIQUE:
                batch.create_unique_constraint(UNIQUE[table][0], UNIQUE[table][2])
    op.create_index(HISTORY_INDEX, "autotune_config_history", NEW_KEY)


def downgrade() -> None:
    op.drop_index(HISTORY_INDEX, table_name="autotune_config_history")
    for table in TABLES:
        op.execute(sa.text(f"DELETE FROM {table} WHERE window_left <> -1 OR softcap <> 0.0 "
                           "OR segmented"))
        with op.batch_alter_table(table) as batch:
            if table in UNIQUE:
                batch.drop_constraint(UNIQUE[table][0], type_="unique")
            for column in _columns():
                batch.drop_column(column.name)
            if table in UNIQUE:
                batch.create_unique_constraint(UNIQUE[table][0], UNIQUE[table][1])
    op.create_index(HISTORY_INDEX, "autotune_config_history", OLD_KEY)
