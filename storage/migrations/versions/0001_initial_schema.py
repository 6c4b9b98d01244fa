"""Initial schema: the live table of tuned configs and its history.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

KEY = ["kernel", "kernel_version", "device_kind", "dtype", "head_dim", "causal", "mode",
       "batch", "q_heads", "kv_heads", "q_len", "kv_len", "platform"]


def _result_columns() -> list[sa.Column]:
    """The columns shared by both tables (a frozen copy of storage.models at this revision)."""
    text = [("kernel", 64, False), ("kernel_version", 64, False), ("device_kind", 128, False),
            ("platform", 32, False), ("dtype", 16, False), ("mode", 16, False),
            ("method", 16, True), ("jax_version", 64, True), ("jaxlib_version", 64, True),
            ("libtpu_version", 64, True), ("study", 256, True)]
    return [
        *(sa.Column(name, sa.String(length), nullable=nullable) for name, length, nullable in text),
        *(sa.Column(name, sa.Integer(), nullable=False)
          for name in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim")),
        sa.Column("causal", sa.Boolean(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        *(sa.Column(name, sa.Float(), nullable=True)
          for name in ("median_ms", "iqr_ms", "default_median_ms", "speedup")),
        sa.Column("trials", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "autotune_configs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        *_result_columns(),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint(*KEY, name="uq_autotune_configs_key"),
    )
    op.create_table(
        "autotune_config_history",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        *_result_columns(),
        sa.Column("reason", sa.String(16), nullable=False),
        sa.Column("archived_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_autotune_config_history_key", "autotune_config_history", KEY)


def downgrade() -> None:
    op.drop_index("ix_autotune_config_history_key", table_name="autotune_config_history")
    op.drop_table("autotune_config_history")
    op.drop_table("autotune_configs")
