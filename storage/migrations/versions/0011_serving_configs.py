"""Serving configs (issue 73): the tuned configs of a serving kernel (ragged paged attention),
keyed by a serving problem (kernel.serving.ServingProblem), and their history. Nothing stored
moves; the downgrade drops both tables.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# Frozen copies of storage.models at this revision.
FAMILY = ["kernel", "kernel_version", "device_kind", "dtype", "kv_dtype", "q_heads", "kv_heads",
          "head_dim", "page_size", "window"]
KEY = [*FAMILY, "max_num_batched_tokens", "pages_per_seq", "max_num_seqs", "softcap", "platform"]
SIZES = ["q_heads", "kv_heads", "head_dim", "page_size", "pages_per_seq",
         "max_num_batched_tokens", "max_num_seqs"]
TEXT = [("device_kind", 128, False), ("platform", 32, False), ("dtype", 16, False),
        ("kv_dtype", 16, False), ("kernel", 64, False), ("kernel_version", 64, False),
        ("method", 16, True), ("timing", 16, True), ("roofline_bound", 16, True),
        ("jax_version", 64, True), ("jaxlib_version", 64, True), ("libtpu_version", 64, True),
        ("study", 256, True)]
MEASURED = ["median_ms", "iqr_ms", "default_median_ms", "speedup", "achieved_tflops",
            "roofline_fraction", "kernel_median_ms"]
HISTORY = "autotune_serving_config_history"


def _columns() -> list[sa.Column]:
    """The columns of a serving result, shared by the live table and its history."""
    return [
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        *(sa.Column(name, sa.String(length), nullable=nullable) for name, length, nullable in TEXT),
        *(sa.Column(name, sa.Integer(), nullable=False) for name in SIZES),
        sa.Column("window", sa.Integer(), server_default="-1", nullable=False),
        sa.Column("softcap", sa.Float(), server_default="0.0", nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        *(sa.Column(name, sa.Float(), nullable=True) for name in MEASURED),
        sa.Column("trials", sa.Integer(), nullable=True),
        sa.Column("device_index", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    ]


def upgrade() -> None:
    op.create_table("autotune_serving_configs", *_columns(),
                    sa.UniqueConstraint(*KEY, name="uq_autotune_serving_configs_key"))
    op.create_table(HISTORY, *_columns(),
                    sa.Column("reason", sa.String(16), nullable=False),
                    sa.Column("archived_at", sa.DateTime(timezone=True), nullable=False))
    op.create_index("ix_autotune_serving_config_history_key", HISTORY, KEY)


def downgrade() -> None:
    op.drop_index("ix_autotune_serving_config_history_key", table_name=HISTORY)
    op.drop_table(HISTORY)
    op.drop_table("autotune_serving_configs")
