"""The problem key gains bottom-right alignment (issue 73): the queries are the last q_len
positions of the keys' sequence (decode, chunked prefill), which changes the causal and window
masks, so its configs and choices are keyed apart from the top-left problem's.

Rows stored before are top-left (the only alignment there was). The downgrade deletes the
bottom-right rows: the older key cannot tell them from the top-left problem's.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Frozen copies of storage.models at this revision and at 0009.
PROBLEM = ["dtype", "head_dim", "causal", "mode", "window_left", "window_right", "segmented"]
SIZES = ["batch", "q_heads", "kv_heads", "q_len", "kv_len", "softcap", "platform"]
OLD_KEY = ["kernel", "kernel_version", "device_kind", *PROBLEM, *SIZES]
NEW_KEY = ["kernel", "kernel_version", "device_kind", *PROBLEM, "bottom_right", *SIZES]
OLD_CHOICE_KEY = ["device_kind", *PROBLEM, *SIZES]
NEW_CHOICE_KEY = ["device_kind", *PROBLEM, "bottom_right", *SIZES]
TABLES = ("autotune_configs", "autotune_config_history", "autotune_kernel_choices")
UNIQUE = {"autotune_configs": ("uq_autotune_configs_key", OLD_KEY, NEW_KEY),
          "autotune_kernel_choices": ("uq_autotune_kernel_choices_key", OLD_CHOICE_KEY,
                                      NEW_CHOICE_KEY)}
HISTORY_INDEX = "ix_autotune_config_history_key"


def _alter(table: str, key: int, change: str) -> None:
    """Adds or drops (``change``) the column in ``table``, its unique key rebuilt as
    ``UNIQUE[table][key]``."""
    with op.batch_alter_table(table) as batch:
        if table in UNIQUE:
            batch.drop_constraint(UNIQUE[table][0], type_="unique")
        if change == "add":
            batch.add_column(sa.Column("bottom_right", sa.Boolean(), nullable=False,
                                       server_default=sa.false()))
        else:
            batch.drop_column("bottom_right")
        if table in UNIQUE:
            batch.create_unique_constraint(UNIQUE[table][0], UNIQUE[table][key])


def upgrade() -> None:
    op.drop_index(HISTORY_INDEX, table_name="autotune_config_history")
    for table in TABLES:
        _alter(table, 2, "add")
    op.create_index(HISTORY_INDEX, "autotune_config_history", NEW_KEY)


def downgrade() -> None:
    op.drop_index(HISTORY_INDEX, table_name="autotune_config_history")
    for table in TABLES:
        op.execute(sa.text(f"DELETE FROM {table} WHERE bottom_right"))
        _alter(table, 1, "drop")
    op.create_index(HISTORY_INDEX, "autotune_config_history", OLD_KEY)
