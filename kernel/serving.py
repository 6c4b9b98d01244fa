"""The serving problem a config is tuned for: one ragged paged attention step of a server.

Pure Python (no jax), so storage and the service can use it. A serving step is no attention
call ``[batch, heads, seq, head_dim]``: every sequence's new tokens (prefill chunks and decode
tokens alike) sit one after the other in one array of ``max_num_batched_tokens`` rows, and
their keys and values in a paged cache of ``page_size``-token pages, at most ``pages_per_seq``
a sequence. The shapes are static, the batch composition traced, so one key serves every batch
a server runs (docs/serving.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from kernel.errors import ProblemError
from kernel.problem import (
    DTYPE_BYTES,
    DTYPES,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_SEQ_LEN,
    GroupedHeads,
    Problem,
    checked_softcap,
    exact_text,
    octaves,
)

# The integer fields of a serving problem and their upper bounds (the lower bound is 1).
SERVING_INT_LIMITS: dict[str, int] = {
    "q_heads": MAX_HEADS, "kv_heads": MAX_HEADS, "head_dim": MAX_HEAD_DIM,
    "page_size": MAX_SEQ_LEN, "pages_per_seq": MAX_SEQ_LEN,
    "max_num_batched_tokens": MAX_SEQ_LEN, "max_num_seqs": MAX_SEQ_LEN}


@dataclass(frozen=True)
class ServingProblem(GroupedHeads):
    """Shapes and options of one ragged paged attention step (the key of its tuned configs).

    Hashable and JSON round-trippable (``to_dict`` / ``from_dict``), with the protocol
    :class:`kernel.problem.Problem` offers (``label``, ``feature_labels``, ``query_params``,
    ``family``, ``distance``, ``mode``), so tables, storage and the service key on it alike.
    """

    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    pages_per_seq: int  # max_model_len / page_size
    max_num_batched_tokens: int
    max_num_seqs: int
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # of the queries
    kv_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # of the paged cache
    # Keys visible to the query at position p: p - window < j <= p (upstream's
    # sliding_window); None: all keys up to p.
    window: int | None = None
    softcap: float | None = None  # logits become softcap * tanh(logits / softcap)

    def __post_init__(self) -> None:
        for name, limit in SERVING_INT_LIMITS.items():
            _check_size(name, getattr(self, name), limit)
        if self.q_heads % self.kv_heads:
            raise ProblemError(f"q_heads ({self.q_heads}) must be a multiple of kv_heads "
                               f"({self.kv_heads}) for grouped-query attention")
        for name in ("dtype", "kv_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ProblemError(f"{name} must be one of {', '.join(DTYPES)}, got "
                                   f"{getattr(self, name)!r}")
        if self.max_model_len > MAX_SEQ_LEN:
            raise ProblemError(f"page_size * pages_per_seq (max_model_len) must be at most "
                               f"{MAX_SEQ_LEN}, got {self.max_model_len}")
        if self.window is not None:
            _check_size("window", self.window, MAX_SEQ_LEN)
        if self.softcap is not None:
            object.__setattr__(self, "softcap", checked_softcap(self.softcap))

    @property
    def mode(self) -> str:
        """Always ``"fwd"``: a serving step is never differentiated."""
        return "fwd"

    @property
    def max_model_len(self) -> int:
        return self.page_size * self.pages_per_seq

    @property
    def kv_itemsize(self) -> int:
        return DTYPE_BYTES[self.kv_dtype]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ServingProblem:
        """Builds a serving problem from a mapping; unknown and missing fields are named."""
        if not isinstance(data, dict):
            raise ProblemError(f"a serving problem must be a JSON object, got "
                               f"{type(data).__name__}")
        unknown = sorted(set(data) - _FIELD_NAMES, key=str)
        if unknown:
            raise ProblemError(f"unknown serving problem field(s) {unknown}; known: "
                               f"{sorted(_FIELD_NAMES)}")
        missing = [name for name in SERVING_INT_LIMITS if data.get(name) is None]
        if missing:
            raise ProblemError(f"missing serving problem field(s): {', '.join(missing)}")
        return cls(**data)

    def query_params(self) -> list[tuple[str, Any]]:
        """The problem as URL query parameters, as the service reads them (unset options
        left out)."""
        return [(name, value) for name, value in self.to_dict().items() if value is not None]

    def __repr__(self) -> str:
        return f"ServingProblem({self.label()})"

    def label(self) -> str:
        """A short human-readable name, e.g. ``h32/8 d128 bfloat16/bfloat16 page16x128
        tokens512 seqs64``, with ``window4096`` and ``softcap50`` when set."""
        features = "".join(f" {part}" for part in self.feature_labels())
        return (f"h{self.q_heads}/{self.kv_heads} d{self.head_dim} {self.dtype}/{self.kv_dtype} "
                f"page{self.page_size}x{self.pages_per_seq} tokens{self.max_num_batched_tokens} "
                f"seqs{self.max_num_seqs}{features}")

    def feature_labels(self) -> list[str]:
        """``window{W}`` and ``softcap{X}``, for the features in use."""
        out = [] if self.window is None else [f"window{self.window}"]
        return out + ([] if self.softcap is None else [f"softcap{exact_text(self.softcap)}"])

    def family(self) -> tuple[Any, ...]:
        """What a nearest match must share with the problem: the dtypes, head counts and
        head_dim (they fix the heads per block and the tiles), the page size (a block is
        counted in pages), the window exactly, and whether logits are soft-capped."""
        return (self.dtype, self.kv_dtype, self.q_heads, self.kv_heads, self.head_dim,
                self.page_size, self.window, self.softcap is not None)

    def distance(self, other: Any) -> float:
        """How far ``other`` is from this one: octaves of tokens, pages per sequence and
        sequences."""
        return (self.axes_distance(other.nearest_axes())
                + octaves(self.max_num_seqs, other.max_num_seqs))

    def nearest_axes(self) -> tuple[int, int]:
        """The sizes a nearest-match index buckets problems by."""
        return self.max_num_batched_tokens, self.pages_per_seq

    def axes_distance(self, axes: tuple[int, ...]) -> float:
        """The part of :meth:`distance` that :meth:`nearest_axes` ``axes`` decide."""
        return (octaves(self.max_num_batched_tokens, axes[0])
                + octaves(self.pages_per_seq, axes[1]))


# The problem types a kernel tunes, by the name tables and shapes files give them.
PROBLEM_TYPES: dict[str, type] = {"attention": Problem, "serving": ServingProblem}


def problem_type_of(data: Any) -> type | None:
    """The problem type whose ``from_dict`` takes ``data`` (a problem's JSON object), or None
    when none does: an attention call's and a serving step's fields tell them apart."""
    for problem_type in PROBLEM_TYPES.values():
        try:
            problem_type.from_dict(data)
        except (ProblemError, TypeError, ValueError):
            continue
        return problem_type
    return None


def jax_device_key(device_kind: str) -> str:
    """JAX's key of a device kind in its ragged paged attention table: the kind's first two
    words (``TPU v5``: the v5e, "TPU v5 lite", and the v5p share it)."""
    return " ".join(device_kind.split()[:2])


def _check_size(name: str, value: Any, limit: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProblemError(f"{name} must be an integer, got {value!r}")
    if not 1 <= value <= limit:
        raise ProblemError(f"{name} must be between 1 and {limit}, got {value}")


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(ServingProblem))
