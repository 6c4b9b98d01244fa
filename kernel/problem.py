"""The attention problem a config is tuned for: the key of everything downstream.

Pure Python (no jax), so storage and the service can use it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

from kernel.errors import ProblemError

log = logging.getLogger(__name__)

DTYPES: tuple[str, ...] = ("bfloat16", "float32")
MODES: tuple[str, ...] = ("fwd", "fwd_bwd")
DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float32": 4}

# Sizes above these are refused as absurd rather than attempted.
MAX_SEQ_LEN = 1 << 20
MAX_HEADS = 1 << 12
MAX_BATCH = 1 << 16
MAX_HEAD_DIM = 1 << 10
# The integer fields of a problem and their upper bounds (the lower bound is 1): what the
# service's request models and the kernel wrapper both refuse.
INT_LIMITS: dict[str, int] = {"batch": MAX_BATCH, "q_heads": MAX_HEADS, "kv_heads": MAX_HEADS,
                              "q_len": MAX_SEQ_LEN, "kv_len": MAX_SEQ_LEN,
                              "head_dim": MAX_HEAD_DIM}
# A softcap's range, far past any cap in use (Gemma 2: 30 and 50). The kernels apply it in
# float32 (``softcap * tanh(logits / softcap)``), where a cap past float32's range rounds to
# inf or to 0 (a subnormal is 0 on a TPU), and every output is NaN; and autodiff multiplies
# the cap by the logits' cotangent, so near float32's largest (3.4e38) xla's gradients are NaN.
# 1e30 leaves that product room for a cotangent up to 3.4e8, and 1e-30 keeps it a normal
# number down to a cotangent of 1e-8 (bench/kernels/softcap_range.py checks both ends on a device).
SOFTCAP_RANGE = (1e-30, 1e30)
# The optional features a problem may use (None or False when not in use).
FEATURE_FIELDS = ("window", "softcap", "segmented", "bottom_right")
# Fields that may be left out of a problem's JSON, and the field each then copies.
DEFAULTS_FROM: dict[str, str] = {"kv_heads": "q_heads", "kv_len": "q_len"}


class GroupedHeads:
    """What a problem of ``q_heads``, ``kv_heads`` and a ``dtype`` derives from them (an
    attention call's and a serving step's alike)."""

    q_heads: int
    kv_heads: int
    dtype: str

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 for plain multi-head attention)."""
        return self.q_heads // self.kv_heads

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Problem(GroupedHeads):
    """Shapes and options of one attention call, layout ``[batch, heads, seq, head_dim]``.

    Hashable and JSON round-trippable (``to_dict`` / ``from_dict``). The one declaration of
    the problem part of every key: the service's request models and storage's columns are
    derived from these fields, ``INT_LIMITS`` and ``DEFAULTS_FROM``.
    """

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    causal: bool = False
    mode: Literal["fwd", "fwd_bwd"] = "fwd"
    # Keys visible around query i: i - left <= j <= i + right (jax.nn's local_window_size);
    # None: all (or, when causal, j <= i). Causal caps the right side at 0, so it is stored 0,
    # and a window that covers every key is no window: it is stored None (said once).
    window: tuple[int, int] | None = None
    # Logits become softcap * tanh(logits / softcap) (Gemma 2); None: no capping.
    softcap: float | None = None
    # Segment ids are given (packed sequences: a query sees keys of its own segment only).
    segmented: bool = False
    # The queries are the last q_len positions of the keys' sequence (decode, chunked prefill,
    # speculative decode): query i sits at position i + kv_len - q_len, which the causal mask
    # and the window count from. False: top-left, query i at position i (jax.nn's is_causal).
    # Stored True only where it changes a mask (causal or a window, q_len != kv_len).
    bottom_right: bool = False

    def __post_init__(self) -> None:
        for name, limit in INT_LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ProblemError(f"{name} must be an integer, got {value!r}")
            if not 1 <= value <= limit:
                raise ProblemError(f"{name} must be between 1 and {limit}, got {value}")
        if self.q_heads % self.kv_heads:
            raise ProblemError(
                f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads}) "
                "for grouped-query attention"
            )
        if self.dtype not in DTYPES:
            raise ProblemError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.causal, bool):
            raise ProblemError(f"causal must be a boolean, got {self.causal!r}")
        if self.mode not in MODES:
            raise ProblemError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("segmented", "bottom_right"):
            if not isinstance(getattr(self, name), bool):
                raise ProblemError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.window is not None:
            object.__setattr__(self, "window", self._normalised_window())
        if self.softcap is not None:
            object.__setattr__(self, "softcap", checked_softcap(self.softcap))
        masked = self.causal or self.window is not None
        object.__setattr__(self, "bottom_right",
                           self.bottom_right and masked and self.q_len != self.kv_len)

    def _normalised_window(self) -> tuple[int, int] | None:
        """The checked window, None when it covers every key a query may see (the plain
        causal or full problem: one key, tuned once), saying so the first time."""
        window = checked_window(self.window, self.causal)
        left, right = window
        first, last = self.query_offset, self.query_offset + self.q_len - 1  # query positions
        if left < last or (not self.causal and first + right < self.kv_len - 1):
            return window
        global _said_covering
        if not _said_covering:
            _said_covering = True
            plain = "causal" if self.causal else "full"
            log.warning("flash-autotune: window=%s covers every key at q_len %d, kv_len %d: it "
                        "is the plain %s problem and is keyed, tuned and run as one (a window "
                        "that covers every key is no window; said once)", self.window,
                        self.q_len, self.kv_len, plain)
        return None

    @property
    def alignment(self) -> str:
        """``"bottom_right"`` or ``"top_left"``: ``kernel.flash_attention``'s ``alignment``."""
        return "bottom_right" if self.bottom_right else "top_left"

    @property
    def query_offset(self) -> int:
        """The position of query 0 among the keys: ``kv_len - q_len`` when bottom-right
        aligned, else 0 (negative when more queries than keys: the first see none)."""
        return self.kv_len - self.q_len if self.bottom_right else 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def family(self) -> tuple[Any, ...]:
        """What a nearest match must share with the problem: dtype, head_dim, causality, mode,
        the window exactly (it decides which blocks are skipped: tiles tuned for another window
        are no evidence), whether logits are soft-capped but not the cap (one elementwise tanh
        per logit costs the same at any value), whether segment ids are given, and the
        alignment (bottom-right skips other blocks than top-left)."""
        return (self.dtype, self.head_dim, self.causal, self.mode, self.window,
                self.softcap is not None, self.segmented, self.bottom_right)

    def distance(self, other: Any) -> float:
        """How far ``other`` (a problem of the family, or any object with its sizes) is from
        this one, in octaves of their sizes."""
        return (self.axes_distance((other.q_len, other.kv_len))
                + 0.5 * octaves(self.batch * self.q_heads, other.batch * other.q_heads)
                + 0.25 * octaves(self.group_size, other.group_size))

    def nearest_axes(self) -> tuple[int, int]:
        """The sizes a nearest-match index buckets problems by: ``(q_len, kv_len)``."""
        return self.q_len, self.kv_len

    def axes_distance(self, axes: tuple[int, ...]) -> float:
        """The part of :meth:`distance` that :meth:`nearest_axes` ``axes`` decide: a lower
        bound of the distance to any problem with those axes."""
        return octaves(self.q_len, axes[0]) + octaves(self.kv_len, axes[1])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Problem:
        """Builds a problem from a mapping; ``kv_heads``/``kv_len`` default to the query's."""
        if not isinstance(data, dict):
            raise ProblemError(f"a problem must be a JSON object, got {type(data).__name__}")
        names = _FIELD_NAMES
        unknown = sorted(set(data) - names, key=str)  # YAML keys may be of any type
        if unknown:
            raise ProblemError(f"unknown problem field(s) {unknown}; known: {sorted(names)}")
        values = dict(data)
        for name, source in DEFAULTS_FROM.items():
            values.setdefault(name, values.get(source))
        missing = [n for n in ("batch", "q_heads", "q_len", "head_dim") if values.get(n) is None]
        if missing:
            raise ProblemError(f"missing problem field(s): {', '.join(missing)}")
        return cls(**values)

    def query_params(self) -> list[tuple[str, Any]]:
        """The problem as URL query parameters, as the service reads them: booleans as
        ``true``/``false``, a window as two ``window`` parameters, a softcap only when set."""
        params: list[tuple[str, Any]] = []
        for name, value in self.to_dict().items():
            if isinstance(value, tuple):
                params.extend((name, side) for side in value)
            elif value is not None:
                params.append((name, str(value).lower() if isinstance(value, bool) else value))
        return params

    def __repr__(self) -> str:
        """``Problem(`` its :meth:`label` ``)``: short where it is printed inside a key (e.g.
        ``kernel.resolution_sources()``), and as distinct as the fields."""
        return f"Problem({self.label()})"

    def label(self) -> str:
        """A short human-readable name, e.g. ``b1 h8/8 q512 kv512 d128 bfloat16 causal fwd``,
        with ``window512,0``, ``softcap50``, ``segmented`` and ``bottom-right`` before the mode
        when set."""
        causal = "causal" if self.causal else "full"
        features = "".join(f" {part}" for part in self.feature_labels())
        return (
            f"b{self.batch} h{self.q_heads}/{self.kv_heads} q{self.q_len} kv{self.kv_len} "
            f"d{self.head_dim} {self.dtype} {causal}{features} {self.mode}"
        )

    def feature_labels(self) -> list[str]:
        """``window{L},{R}``, ``softcap{X}``, ``segmented`` and ``bottom-right``, for the
        features in use."""
        out = []
        if self.window is not None:
            out.append(f"window{self.window[0]},{self.window[1]}")
        if self.softcap is not None:
            out.append(f"softcap{exact_text(self.softcap)}")
        if self.segmented:
            out.append("segmented")
        if self.bottom_right:
            out.append("bottom-right")
        return out


def octaves(a: float, b: float) -> float:
    """How many doublings apart two positive sizes are."""
    return abs(math.log2(a / b))


def exact_text(number: float) -> str:
    """``number`` in ``:g`` form where that is exact (``50``, ``1e+20``), else its shortest
    exact form (``50.0000001``): two problems' labels differ where their values do."""
    short = f"{number:g}"
    return short if float(short) == number else repr(number)


def checked_window(window: Any, causal: bool) -> tuple[int, int]:
    """``window`` as a ``(left, right)`` pair of non-negative ints, right capped at 0 when
    ``causal``; anything else raises naming the fix."""
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise ProblemError(f"window must be a (left, right) pair of key counts, got {window!r}")
    left, right = window
    for side, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProblemError(f"window {side} side must be an integer, got {value!r}")
        if not 0 <= value <= MAX_SEQ_LEN:
            raise ProblemError(f"window {side} side must be between 0 and {MAX_SEQ_LEN} keys, "
                               f"got {value}")
    return (left, 0 if causal else right)


def dtype_name(x: Any) -> str:
    """The name of an array's dtype (``"bfloat16"``), as problems and errors say it."""
    return getattr(x.dtype, "name", str(x.dtype))


def finite_float(value: Any) -> float | None:
    """``value`` as a float if it is an int or a float (not a bool) that a finite float holds
    (an integer past the float range overflows), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def shown_number(value: Any) -> str:
    """``repr(value)``, or a description of an integer too long to print in an error."""
    if isinstance(value, int) and finite_float(value) is None:
        return "an integer too large for a float"
    return repr(value)


def softcap_problem(name: str, softcap: Any) -> str:
    """What is wrong with ``softcap`` (a number in ``SOFTCAP_RANGE``) given as argument
    ``name``, or '' when nothing is."""
    number = finite_float(softcap)
    if number is not None and SOFTCAP_RANGE[0] <= number <= SOFTCAP_RANGE[1]:
        return ""
    low, high = SOFTCAP_RANGE
    return (f"{name} must be positive and finite (logits become softcap * tanh(logits / "
            f"softcap)), got {shown_number(softcap)}; the kernels apply it in float32, where it "
            f"must lie from {low:g} to {high:g} (beyond, outputs or gradients are NaN)")


def checked_softcap(softcap: Any) -> float:
    """``softcap`` as a float in ``SOFTCAP_RANGE``; anything else raises naming the fix."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise ProblemError(f"softcap must be a number, got {softcap!r}")
    problem = softcap_problem("softcap", softcap)
    if problem:
        raise ProblemError(f"{problem}; leave it out for none")
    return float(softcap)


_said_covering = False  # whether a window covering every key was reported (once a process)
_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(Problem))  # read per table entry
