"""Database tables (SQLAlchemy 2.0 typed models). Only ``Base.metadata`` is ours: Optuna keeps
its own tables in the same database, and migrations ignore everything not listed here."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, DateTime, Float, Index, Integer, String, UniqueConstraint, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from storage.results import KEY_FIELDS, NO_SOFTCAP, NO_WINDOW, SERVING_KEY_FIELDS, TEXT_LIMITS

# The unique key, in index order: the columns shared by nearest-match candidates come first, so
# the unique index also serves the nearest-match query.
# A window, a softcap (any value), segment ids or bottom-right alignment are never answered by
# a problem without them (kernel.table.nearest_entry), so the family holds them; a softcap's
# value is outside it.
FEATURE_COLUMNS = ("window_left", "window_right", "segmented", "bottom_right")
FAMILY_COLUMNS = ("kernel", "kernel_version", "device_kind", "dtype", "head_dim", "causal",
                  "mode", *FEATURE_COLUMNS)
KEY_COLUMNS = (*FAMILY_COLUMNS, "batch", "q_heads", "kv_heads", "q_len", "kv_len", "softcap",
               "platform")
# The index order is storage's; the key's fields are storage.results.KEY_FIELDS'.
assert sorted(KEY_COLUMNS) == sorted(KEY_FIELDS), "the unique key must be the stored key"
# A kernel choice's key: the device and the problem (no kernel: the choice names it).
CHOICE_FAMILY_COLUMNS = ("device_kind", "dtype", "head_dim", "causal", "mode", *FEATURE_COLUMNS)
CHOICE_KEY_COLUMNS = (*CHOICE_FAMILY_COLUMNS, "batch", "q_heads", "kv_heads", "q_len", "kv_len",
                      "softcap", "platform")
# A serving config's key (kernel.serving.ServingProblem): what a nearest match shares first
# (ServingProblem.family, less the softcap's value), then the sizes it is nearest in.
SERVING_FAMILY_COLUMNS = ("kernel", "kernel_version", "device_kind", "dtype", "kv_dtype",
                          "q_heads", "kv_heads", "head_dim", "page_size", "window")
SERVING_KEY_COLUMNS = (*SERVING_FAMILY_COLUMNS, "max_num_batched_tokens", "pages_per_seq",
                       "max_num_seqs", "softcap", "platform")
assert sorted(SERVING_KEY_COLUMNS) == sorted(SERVING_KEY_FIELDS), "the serving key is stored"


class Base(DeclarativeBase):
    pass


class _DeviceColumns:
    """The device columns every table is keyed on."""

    device_kind: Mapped[str] = mapped_column(String(TEXT_LIMITS["device_kind"]))
    platform: Mapped[str] = mapped_column(String(TEXT_LIMITS["platform"]))


class _ProblemColumns(_DeviceColumns):
    """The device and attention problem columns."""

    batch: Mapped[int] = mapped_column(Integer)
    q_heads: Mapped[int] = mapped_column(Integer)
    kv_heads: Mapped[int] = mapped_column(Integer)
    q_len: Mapped[int] = mapped_column(Integer)
    kv_len: Mapped[int] = mapped_column(Integer)
    head_dim: Mapped[int] = mapped_column(Integer)
    dtype: Mapped[str] = mapped_column(String(16))
    causal: Mapped[bool]
    mode: Mapped[str] = mapped_column(String(16))
    # No window, no softcap: NO_WINDOW, NO_SOFTCAP (storage.results.problem_columns).
    window_left: Mapped[int] = mapped_column(Integer, server_default=str(NO_WINDOW))
    window_right: Mapped[int] = mapped_column(Integer, server_default=str(NO_WINDOW))
    softcap: Mapped[float] = mapped_column(Float, server_default=str(NO_SOFTCAP))
    segmented: Mapped[bool] = mapped_column(server_default=false())
    bottom_right: Mapped[bool] = mapped_column(server_default=false())


class _ProvenanceColumns:
    """How a result was measured and under which versions, and when it was stored."""

    method: Mapped[str | None] = mapped_column(String(TEXT_LIMITS["method"]))
    jax_version: Mapped[str | None] = mapped_column(String(TEXT_LIMITS["jax_version"]))
    jaxlib_version: Mapped[str | None] = mapped_column(String(TEXT_LIMITS["jaxlib_version"]))
    libtpu_version: Mapped[str | None] = mapped_column(String(TEXT_LIMITS["libtpu_version"]))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class _ServingProblemColumns(_DeviceColumns):
    """The device and serving problem columns (kernel.serving.ServingProblem)."""

    q_heads: Mapped[int] = mapped_column(Integer)
    kv_heads: Mapped[int] = mapped_column(Integer)
    head_dim: Mapped[int] = mapped_column(Integer)
    page_size: Mapped[int] = mapped_column(Integer)
    pages_per_seq: Mapped[int] = mapped_column(Integer)
    max_num_batched_tokens: Mapped[int] = mapped_column(Integer)
    max_num_seqs: Mapped[int] = mapped_column(Integer)
    dtype: Mapped[str] = mapped_column(String(16))
    kv_dtype: Mapped[str] = mapped_column(String(16))
    # No window, no softcap: NO_WINDOW, NO_SOFTCAP (storage.results.problem_columns).
    window: Mapped[int] = mapped_column(Integer, server_default=str(NO_WINDOW))
    softcap: Mapped[float] = mapped_column(Float, server_default=str(NO_SOFTCAP))


class _MeasuredColumns(_ProvenanceColumns):
    """A tuned result's kernel, config, timings and provenance."""

    kernel: Mapped[str] = mapped_column(String(TEXT_LIMITS["kernel"]))
    kernel_version: Mapped[str] = mapped_column(String(TEXT_LIMITS["kernel_version"]))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    median_ms: Mapped[float | None] = mapped_column(Float)
    iqr_ms: Mapped[float | None] = mapped_column(Float)
    default_median_ms: Mapped[float | None] = mapped_column(Float)
    speedup: Mapped[float | None] = mapped_column(Float)
    trials: Mapped[int | None] = mapped_column(Integer)
    timing: Mapped[str | None] = mapped_column(String(TEXT_LIMITS["timing"]))
    achieved_tflops: Mapped[float | None] = mapped_column(Float)
    roofline_fraction: Mapped[float | None] = mapped_column(Float)
    roofline_bound: Mapped[str | None] = mapped_column(String(TEXT_LIMITS["roofline_bound"]))
    study: Mapped[str | None] = mapped_column(String(TEXT_LIMITS["study"]))
    device_index: Mapped[int | None] = mapped_column(Integer)
    kernel_median_ms: Mapped[float | None] = mapped_column(Float)
    compositions: Mapped[list[Any] | None] = mapped_column(JSON)  # a serving step's batches


class _ResultColumns(_ProblemColumns, _MeasuredColumns):
    """The columns of a tuned result, shared by the live table and its history."""


class _ServingResultColumns(_ServingProblemColumns, _MeasuredColumns):
    """The columns of a tuned serving result, shared by the live table and its history."""


class TunedConfigRow(_ResultColumns, Base):
    """The best known config per key."""

    __tablename__ = "autotune_configs"
    __table_args__ = (UniqueConstraint(*KEY_COLUMNS, name="uq_autotune_configs_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)


class TunedConfigHistoryRow(_ResultColumns, Base):
    """Results that lost: a replaced best (``replaced``/``forced``) or a slower newcomer
    (``rejected``). Nothing published is ever deleted."""

    __tablename__ = "autotune_config_history"
    __table_args__ = (Index("ix_autotune_config_history_key", *KEY_COLUMNS),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    reason: Mapped[str] = mapped_column(String(16))
    archived_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ServingConfigRow(_ServingResultColumns, Base):
    """The best known config per serving key (a serving kernel's: docs/serving.md)."""

    __tablename__ = "autotune_serving_configs"
    __table_args__ = (UniqueConstraint(*SERVING_KEY_COLUMNS,
                                       name="uq_autotune_serving_configs_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)


class ServingConfigHistoryRow(_ServingResultColumns, Base):
    """Serving results that lost, as ``TunedConfigHistoryRow``'s."""

    __tablename__ = "autotune_serving_config_history"
    __table_args__ = (Index("ix_autotune_serving_config_history_key", *SERVING_KEY_COLUMNS),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    reason: Mapped[str] = mapped_column(String(16))
    archived_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class KernelChoiceRow(_ProblemColumns, _ProvenanceColumns, Base):
    """The kernel chosen per device kind and problem, its config, and every candidate's
    confirmed timing or failure class (``candidates``: kernel name -> ``{"median_ms",
    "iqr_ms"}`` or ``{"failure"}``). A newer choice for the key replaces it."""

    __tablename__ = "autotune_kernel_choices"
    __table_args__ = (UniqueConstraint(*CHOICE_KEY_COLUMNS, name="uq_autotune_kernel_choices_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kernel: Mapped[str] = mapped_column(String(TEXT_LIMITS["kernel"]))
    kernel_version: Mapped[str] = mapped_column(String(TEXT_LIMITS["kernel_version"]))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    candidates: Mapped[dict[str, Any]] = mapped_column(JSON)
    timing: Mapped[str | None] = mapped_column(String(TEXT_LIMITS["timing"]))  # confirmation
    # The default kernel was kept although another measured faster within the noise.
    within_noise: Mapped[bool | None]
    # The model step's confirmation of the choice (autotune.step_choice.StepChoice.record):
    # each table's step time and spread, the rounds, the timing; null: none ran.
    step_confirmation: Mapped[dict[str, Any] | None] = mapped_column(JSON)
