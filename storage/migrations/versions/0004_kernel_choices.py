"""Kernel choices: which kernel runs each problem on a device kind, with the evidence.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

KEY = ["device_kind", "dtype", "head_dim", "causal", "mode", "batch", "q_heads", "kv_heads",
       "q_len", "kv_len", "platform"]


def upgrade() -> None:
    # A frozen copy of storage.models.KernelChoiceRow at this revision.
    text = [("device_kind", 128, False), ("platform", 32, False), ("dtype", 16, False),
            ("mode", 16, False), ("kernel", 64, False), ("kernel_version", 64, False),
            ("method", 16, True), ("jax_version", 64, True), ("jaxlib_version", 64, True),
            ("libtpu_version", 64, True)]
    op.create_table(
        "autotune_kernel_choices",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        *(sa.Column(name, sa.String(length), nullable=nullable) for name, length, nullable in text),
        *(sa.Column(name, sa.Integer(), nullable=False)
          for name in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim")),
        sa.Column("causal", sa.Boolean(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("candidates", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint(*KEY, name="uq_autotune_kernel_choices_key"),
    )


def downgrade() -> None:
    op.drop_table("autotune_kernel_choices")
