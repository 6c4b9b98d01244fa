"""Request and response bodies. Limits come from ``kernel.problem`` so that the service and
the kernel refuse the same inputs; text fields refuse control characters (PostgreSQL cannot
store NUL, and no device kind has them)."""

from __future__ import annotations

import dataclasses
import re
import typing
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from kernel import DEFAULT_KERNEL, ConfigError, Problem, ServingProblem, get_kernel
from kernel.problem import DEFAULTS_FROM, DTYPES, INT_LIMITS, MAX_SEQ_LEN, MODES, SOFTCAP_RANGE
from kernel.registry import SERVING_KERNELS
from kernel.resolve import VERSIONED_PACKAGES
from kernel.serving import SERVING_INT_LIMITS
from storage import (
    MAX_STORED_INT,
    METHODS,
    ROOFLINE_BOUNDS,
    TIMINGS,
    Entry,
    LookupRequest,
    TunedResult,
)
from storage.results import KEY_TEXT_FIELDS, TEXT_LIMITS

TEXT_PATTERN = r"^[^\x00-\x1f\x7f]+$"
# What a nearest match shares with the problem asked (kernel.problem.Problem.family), for misses.
NEAREST_FAMILY = ("with the same dtype, head_dim, causal, mode, window, segment ids or none, "
                  "alignment, and softcap (any value) or none")
MAX_BATCH_KEYS = 100  # unauthenticated: bounds the work one request can ask for
MAX_ASKED_KERNELS = 16  # kernels whose configs a choice lookup answers, per key at most
# What a lookup says of how its config was measured: the versions it was tuned under and the
# timing method (the resolver marks an entry stale when a version moved or the method is
# retired: kernel.resolve.stale_versions), the method (on the device, or in interpret mode on a
# CPU: no device figure) and which local device measured it.
LOOKUP_PROVENANCE = (*(f"{package}_version" for package in VERSIONED_PACKAGES), "timing",
                     "method", "device_index")
LOOKUP_PROVENANCE_DOC = ("The jax, jaxlib and libtpu versions it was tuned under, its timing "
                         "method, the method (device, or interpret: a CPU's interpret mode, no "
                         "device figure) and device_index (which local device measured it).")

Text = Annotated[str, Field(min_length=1, max_length=128, pattern=TEXT_PATTERN)]
Version = Annotated[str, Field(min_length=1, max_length=64, pattern=TEXT_PATTERN)]
Millis = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]  # a time, or a ratio of times
Dtype = Literal[DTYPES]  # type: ignore[valid-type]
Mode = Literal[MODES]  # type: ignore[valid-type]
Method = Literal[METHODS]  # type: ignore[valid-type]
Timing = Literal[TIMINGS]  # type: ignore[valid-type]
RooflineBound = Literal[ROOFLINE_BOUNDS]  # type: ignore[valid-type]


class _Strict(BaseModel):
    """A JSON request body: no unknown field, and each value of its declared type, not
    coerced to it (``true`` is no number, ``"yes"`` no boolean, ``64.0`` no key count), as the
    table and problem loaders read them."""

    model_config = ConfigDict(extra="forbid", strict=True)


# A query parameter's plain text per scalar type (as ``Problem.query_params`` writes them).
_PLAIN_TEXT = {bool: (re.compile("true|false", re.IGNORECASE), "true or false"),
               int: (re.compile("[-+]?[0-9]+"), "an integer"),
               float: (re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?"),
                       "a decimal number")}


def _scalar_type(annotation: Any) -> Any:
    """The bool, int or float of a field's type (inside an optional, a list, ...), or None."""
    if isinstance(annotation, type) and annotation in _PLAIN_TEXT:
        return annotation
    return next(filter(None, map(_scalar_type, typing.get_args(annotation))), None)


class QueryModel(BaseModel):
    """Query parameters, which are text: each is read in its type's plain form only
    (``window=64.0`` is no key count, ``causal=yes`` no boolean); no unknown parameter."""

    model_config = ConfigDict(extra="forbid", strict=False)

    @field_validator("*", mode="before")
    @classmethod
    def _plain_text(cls, value: Any, info: ValidationInfo) -> Any:
        kind = _scalar_type(cls.model_fields[info.field_name].annotation)
        if kind is not None:
            pattern, form = _PLAIN_TEXT[kind]
            for text in value if isinstance(value, list) else [value]:
                if isinstance(text, str) and not pattern.fullmatch(text):
                    raise PydanticCustomError("plain_text", "give {form}, got {text}",
                                              {"form": form, "text": repr(text[:64])})
        return value


_PROBLEM_HINTS = typing.get_type_hints(Problem)


# The request types of the problem's optional features (kernel.problem validates them again).
_KeyCount = Annotated[int, Field(ge=0, le=MAX_SEQ_LEN)]
_FEATURE_TYPES = {
    "window": Annotated[list[_KeyCount], Field(
        min_length=2, max_length=2, description="[left, right]: keys visible before and after "
        "each query (right is 0 when causal); null: no window.")] | None,
    "softcap": Annotated[float, Field(
        gt=0, le=SOFTCAP_RANGE[1], allow_inf_nan=False, description="Logits become softcap * "
        f"tanh(logits / softcap), in float32: at least {SOFTCAP_RANGE[0]:g} (kernel.problem."
        "SOFTCAP_RANGE); null: none.")] | None,
}


def _problem_field(field: dataclasses.Field) -> tuple[Any, Any]:
    """A request field for a ``Problem`` field: its type and bounds from ``kernel.problem``;
    optional (``None``) where the problem copies another field by default."""
    if field.name in _FEATURE_TYPES:
        return _FEATURE_TYPES[field.name], field.default
    if field.name in INT_LIMITS:
        bounded = Annotated[int, Field(ge=1, le=INT_LIMITS[field.name])]
        return (bounded | None, None) if field.name in DEFAULTS_FROM else (bounded, ...)
    required = field.default is dataclasses.MISSING
    return _PROBLEM_HINTS[field.name], ... if required else field.default


class _ProblemModel(_Strict):
    def to_problem(self) -> Problem:
        """Raises ProblemError (a 422) for cross-field rules, e.g. grouped-query heads."""
        names = [f.name for f in dataclasses.fields(Problem)]
        return Problem.from_dict({n: v for n in names if (v := getattr(self, n)) is not None})


# The attention problem, derived from kernel.problem.Problem (its one declaration).
ProblemFields = create_model(
    "ProblemFields", __base__=_ProblemModel,
    __doc__=f"The attention problem; {', '.join(DEFAULTS_FROM)} default to "
            f"{', '.join(DEFAULTS_FROM.values())}.",
    **{field.name: _problem_field(field) for field in dataclasses.fields(Problem)})


# The key's text fields, bounded by the columns that store them (storage.results.TEXT_LIMITS).
_KeyText = {name: Annotated[str, Field(min_length=1, max_length=TEXT_LIMITS[name],
                                       pattern=TEXT_PATTERN)] for name in KEY_TEXT_FIELDS}


class ChoiceKey(ProblemFields):
    """A kernel choice to look up: the device kind and the problem (no kernel: the choice
    names it)."""

    device_kind: _KeyText["device_kind"]

    def to_choice_request(self) -> tuple[str, Problem]:
        return self.device_kind, self.to_problem()


class LookupKey(ChoiceKey):
    """What to look up. ``kernel_version`` defaults to the server's installed kernel;
    ``platform`` to any platform of the device kind."""

    kernel: _KeyText["kernel"] = DEFAULT_KERNEL
    kernel_version: _KeyText["kernel_version"] | None = None
    platform: _KeyText["platform"] | None = None

    def to_request(self) -> LookupRequest:
        return LookupRequest(device_kind=self.device_kind, problem=self.to_problem(),
                             kernel=self.kernel, kernel_version=self.kernel_version,
                             platform=self.platform)


class ChoiceQuery(ChoiceKey, QueryModel):
    """A ``ChoiceKey`` as query parameters."""

    model_config = QueryModel.model_config


class LookupQuery(LookupKey, QueryModel):
    """A ``LookupKey`` as query parameters."""

    model_config = QueryModel.model_config


# A problem as answered, and a stored key, flat (storage.ConfigKey.to_dict): the problem's
# fields and the key's text fields.
ProblemOut = create_model("ProblemOut", **{f.name: (_PROBLEM_HINTS[f.name], ...)
                                           for f in dataclasses.fields(Problem)})
KeyOut = create_model("KeyOut", __base__=ProblemOut,
                      **{name: (str, ...) for name in KEY_TEXT_FIELDS})


# A config of the key's kernel: its fields are that kernel's (``TunableKernel.config_type``),
# checked in ``to_result``; missing fields take the defaults. A value is a size, a flag, an
# enum's name or null (unused), as the kernel's field types declare (kernel.config).
ConfigValue = (bool | Annotated[int, Field(ge=1, le=1 << 20)]
               | Annotated[str, Field(max_length=64)] | None)
ConfigFields = dict[str, ConfigValue]
ConfigOut = dict[str, bool | int | str | None]


class Measurements(_Strict):
    """Timings and provenance of a tuned result (field names as in storage.TunedResult)."""

    median_ms: Positive
    iqr_ms: Millis | None = None
    default_median_ms: Positive | None = None
    speedup: Positive | None = None
    trials: Annotated[int, Field(ge=0, le=MAX_STORED_INT)] | None = None
    method: Method | None = None
    timing: Timing | None = Field(None, description="How runs were timed: step_profile (the "
                                  "whole step's device time from a profiler trace), loop or "
                                  "wallclock; profile (the named kernels only) is retired.")
    kernel_median_ms: Millis | None = Field(None, description="The part of median_ms the "
                                            "kernel's named pallas_calls took.")
    achieved_tflops: Millis | None = None
    roofline_fraction: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = Field(
        None, description="The fraction of the device's binding roof (roofline_bound) reached: "
                          "the least time its peaks allow over the measured one.")
    roofline_bound: RooflineBound | None = None
    jax_version: Version | None = None
    jaxlib_version: Version | None = None
    libtpu_version: Version | None = None
    study: Annotated[str, Field(min_length=1, max_length=256, pattern=TEXT_PATTERN)] | None = None
    device_index: Annotated[int, Field(
        ge=0, le=MAX_STORED_INT, description="Which local device measured it.")] | None = None


class PublishRequest(Measurements):
    """A tuned result to store; ``force`` replaces the stored one even if it is faster."""

    key: LookupKey = Field(description="Where to store it (``platform`` defaults from the "
                                       "device kind, ``kernel_version`` to the server's).")
    config: ConfigFields = Field(description="A config of the key's kernel (its field names; "
                                             "missing fields take the defaults).")
    force: bool = False

    def to_result(self) -> TunedResult:
        """Raises ProblemError/ConfigError/ResultError (422s) naming the field or rule."""
        extra = {"kernel_version": self.key.kernel_version} if self.key.kernel_version else {}
        return TunedResult(
            kernel=self.key.kernel, device_kind=self.key.device_kind,
            platform=self.key.platform or "", problem=self.key.to_problem(),
            config=get_kernel(self.key.kernel).config_from_dict(self.config),
            **{name: getattr(self, name) for name in Measurements.model_fields}, **extra)


class EntryOut(BaseModel):
    key: KeyOut
    config: ConfigOut
    median_ms: float | None
    iqr_ms: float | None
    default_median_ms: float | None
    speedup: float | None
    trials: int | None
    method: str | None
    timing: str | None
    achieved_tflops: float | None
    roofline_fraction: float | None
    roofline_bound: str | None
    jax_version: str | None
    jaxlib_version: str | None
    libtpu_version: str | None
    study: str | None
    device_index: int | None
    kernel_median_ms: float | None
    compositions: list[dict[str, Any]] | None = Field(
        None, description="A serving step's batch compositions its trials ran.")
    created_at: datetime
    updated_at: datetime


class PublishResponse(BaseModel):
    status: Literal["inserted", "replaced", "kept"]
    entry: EntryOut
    previous: dict[str, Any] | None = Field(
        None, description="The result stored before (key, config, measurements), if any.")


class LookupResponse(BaseModel):
    config: ConfigOut
    match: Literal["exact", "nearest"]
    key: KeyOut = Field(description="The tuned key the config comes from.")
    time_ms: float | None
    speedup: float | None
    provenance: dict[str, str | int | None] = Field(description=LOOKUP_PROVENANCE_DOC)


class BatchLookupRequest(_Strict):
    keys: Annotated[list[LookupKey], Field(min_length=1, max_length=MAX_BATCH_KEYS)]


class BatchLookupItem(BaseModel):
    found: bool
    config: ConfigOut | None = None
    match: Literal["exact", "nearest"] | None = None
    key: KeyOut | None = None
    time_ms: float | None = None
    speedup: float | None = None
    provenance: dict[str, str | int | None] | None = Field(
        None, description=LOOKUP_PROVENANCE_DOC)
    detail: str | None = None


class BatchLookupResponse(BaseModel):
    results: list[BatchLookupItem]


class ChoiceListQuery(QueryModel):
    """``GET /v1/choices``: filters (each a column = value) and a page; an unknown query
    parameter is a 422, not silently ignored."""

    device_kind: _KeyText["device_kind"] | None = None
    platform: _KeyText["platform"] | None = None
    kernel: _KeyText["kernel"] | None = Field(None, description="The chosen kernel.")
    dtype: Dtype | None = None
    mode: Mode | None = None
    causal: bool | None = None
    head_dim: Annotated[int | None, Field(ge=1, le=INT_LIMITS["head_dim"])] = None
    segmented: bool | None = None
    method: Method | None = None
    offset: Annotated[int, Field(ge=0, le=MAX_STORED_INT)] = 0
    limit: Annotated[int, Field(ge=1, le=1000)] = 100

    def filters(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, exclude={"offset", "limit"})


class ListQuery(ChoiceListQuery):
    """``GET /v1/configs``: as ``GET /v1/choices``, of the configs of a kernel version or a
    study too (``kernel`` is the tuned kernel)."""

    kernel: _KeyText["kernel"] | None = None
    kernel_version: _KeyText["kernel_version"] | None = None
    study: Text | None = None


class ExportQuery(QueryModel):
    """``GET /v1/tables/{device_kind}``: which kernel's table; an unknown query parameter is a
    422, as on the other endpoints."""

    kernel: Text | None = Field(None, description="Only this kernel's configs, and a table "
                                "that runs it wherever it was tuned (default: the default "
                                "kernel's configs, those of every kernel a stored choice names, "
                                "and every choice)")
    kernel_version: Version | None = Field(None, description="Kernel version of `kernel` "
                                           "(default: the installed one)")


class ImportQuery(QueryModel):
    """``POST /v1/tables``: ``force`` is ``true`` or ``false`` (``yes``, ``1`` or ``on`` are
    422s, not read as true); an unknown query parameter is a 422."""

    force: bool = Field(False, description="Replace stored entries even if faster.")


SKIPPED = Field(description="Rows of this page left out: written by a newer build (a kernel "
                "or config field this one does not know); the server logs each once.")


class ConfigPage(BaseModel):
    items: list[EntryOut]
    total: int
    offset: int
    limit: int
    skipped: int = SKIPPED


class ImportResponse(BaseModel):
    inserted: int
    replaced: int
    kept: int
    choices: int = Field(description="Kernel choices stored (each replaces the key's).")
    left_out: list[str] = Field(description="Kernels of the table's others that this server "
                                "does not install: their entries were not imported.")


class KernelTimingOut(BaseModel):
    """A candidate's confirmed median and spread (IQR), or the failure class that kept it
    out of the choice."""

    median_ms: float | None = None
    iqr_ms: float | None = None
    failure: str | None = None


class _ChoiceFields(BaseModel):
    kernel: str = Field(description="The chosen kernel.")
    config: ConfigOut = Field(description="Its config for this problem.")
    times_ms: dict[str, float | None] = Field(
        description="Every candidate's confirmed median (null: it failed, see candidates).")
    candidates: dict[str, KernelTimingOut]
    problem: ProblemOut = Field(description="The problem the choice was measured on.")
    provenance: dict[str, str | bool | dict[str, Any] | None] = Field(
        description="Platform, chosen kernel's version, method (model_step: the model's "
                    "whole step chose it), timing, jax/jaxlib/libtpu versions, within_noise: "
                    "whether the kept kernel (the one chosen before, else the platform's "
                    "default) stayed although another measured faster within the noise "
                    "(absent: not recorded), and step_confirmation: the model step's timing "
                    "of each table (docs/step-choice.md; absent: none ran).")


class ChoiceResponse(_ChoiceFields):
    match: Literal["exact", "nearest"]


class ChoiceOut(_ChoiceFields):
    device_kind: str
    created_at: datetime
    updated_at: datetime


class ConfigsWanted(_Strict):
    """Which configs a choice lookup answers too, for each key: ``kernel``'s (the one that
    runs without a choice) and those of the kernels the key's choice names, each at the
    version the asker runs (``versions``: only kernels listed there are answered)."""

    kernel: _KeyText["kernel"] | None = None
    versions: Annotated[dict[_KeyText["kernel"], _KeyText["kernel_version"]],
                        Field(max_length=MAX_ASKED_KERNELS)]


# --- serving configs (kernel.serving.ServingProblem: docs/serving.md) ---------------------------

SERVING_KERNEL = next(iter(SERVING_KERNELS))  # the one serving backend: a lookup's default
# What a nearest serving match shares with the problem asked (ServingProblem.family).
SERVING_NEAREST_FAMILY = ("with the same dtypes, head counts, head_dim, page_size, window, and "
                          "softcap (any value) or none")
_SERVING_HINTS = typing.get_type_hints(ServingProblem)


def _serving_field(field: dataclasses.Field) -> tuple[Any, Any]:
    """A request field for a ``ServingProblem`` field: its type and bounds from
    ``kernel.serving``."""
    if field.name in SERVING_INT_LIMITS:
        return Annotated[int, Field(ge=1, le=SERVING_INT_LIMITS[field.name])], ...
    if field.name == "window":
        return Annotated[int, Field(ge=1, le=MAX_SEQ_LEN, description="Keys a query sees (a "
                                    "sliding window); null: all.")] | None, None
    if field.name == "softcap":
        return _FEATURE_TYPES["softcap"], None
    return _SERVING_HINTS[field.name], field.default


class _ServingProblemModel(_Strict):
    def to_problem(self) -> ServingProblem:
        """Raises ProblemError (a 422) for cross-field rules, e.g. grouped-query heads."""
        names = [f.name for f in dataclasses.fields(ServingProblem)]
        return ServingProblem.from_dict({name: value for name in names
                                         if (value := getattr(self, name)) is not None})


# The serving problem, derived from kernel.serving.ServingProblem (its one declaration).
ServingProblemFields = create_model(
    "ServingProblemFields", __base__=_ServingProblemModel,
    __doc__="A serving step: ragged paged attention over a paged KV cache.",
    **{field.name: _serving_field(field) for field in dataclasses.fields(ServingProblem)})


class ServingLookupKey(ServingProblemFields):
    """A serving config to look up. ``kernel`` defaults to the serving kernel,
    ``kernel_version`` to the server's installed one, ``platform`` to any."""

    device_kind: _KeyText["device_kind"]
    kernel: _KeyText["kernel"] = SERVING_KERNEL
    kernel_version: _KeyText["kernel_version"] | None = None
    platform: _KeyText["platform"] | None = None

    def to_request(self) -> LookupRequest:
        """Raises ConfigError (a 422) for a kernel that is not a serving one."""
        if self.kernel not in SERVING_KERNELS:
            raise ConfigError(f"kernel {self.kernel!r} is no serving kernel; serving configs "
                              f"are {', '.join(SERVING_KERNELS)}'s (an attention kernel's are "
                              "at /v1/configs/lookup)")
        return LookupRequest(device_kind=self.device_kind, problem=self.to_problem(),
                             kernel=self.kernel, kernel_version=self.kernel_version,
                             platform=self.platform)


class ServingLookupQuery(ServingLookupKey, QueryModel):
    """A ``ServingLookupKey`` as query parameters."""

    model_config = QueryModel.model_config


ServingProblemOut = create_model("ServingProblemOut", **{
    f.name: (_SERVING_HINTS[f.name], ...) for f in dataclasses.fields(ServingProblem)})
ServingKeyOut = create_model("ServingKeyOut", __base__=ServingProblemOut,
                             **{name: (str, ...) for name in KEY_TEXT_FIELDS})


class ServingLookupResponse(LookupResponse):
    key: ServingKeyOut = Field(description="The tuned key the config comes from.")


class ServingBatchLookupRequest(_Strict):
    keys: Annotated[list[ServingLookupKey], Field(min_length=1, max_length=MAX_BATCH_KEYS)]


class ServingBatchLookupItem(BatchLookupItem):
    key: ServingKeyOut | None = None


class ServingBatchLookupResponse(BaseModel):
    results: list[ServingBatchLookupItem]


class BatchChoiceRequest(_Strict):
    keys: Annotated[list[ChoiceKey], Field(min_length=1, max_length=MAX_BATCH_KEYS)]
    configs: ConfigsWanted | None = Field(
        None, description="Answer these configs with each choice (one request for a trace's "
                          "new shape); left out, the results hold choices only. Keys times "
                          f"versions is at most {MAX_BATCH_KEYS}.")

    @model_validator(mode="after")
    def _bounded(self) -> BatchChoiceRequest:
        asked = len(self.keys) * len(self.configs.versions) if self.configs else 0
        if asked > MAX_BATCH_KEYS:
            raise ValueError(f"{len(self.keys)} keys times {len(self.configs.versions)} "
                             f"kernels' configs is {asked} lookups, over {MAX_BATCH_KEYS}; ask "
                             "for fewer keys or kernels per request")
        return self


class BatchChoiceItem(BaseModel):
    found: bool
    kernel: str | None = None
    config: ConfigOut | None = None
    match: Literal["exact", "nearest"] | None = None
    times_ms: dict[str, float | None] | None = None
    candidates: dict[str, KernelTimingOut] | None = None
    problem: ProblemOut | None = None
    provenance: dict[str, str | bool | None] | None = None
    detail: str | None = None
    configs: dict[str, BatchLookupItem] | None = Field(
        None, description="By kernel, the configs asked with ``configs`` (absent unless asked).")


class BatchChoiceResponse(BaseModel):
    results: list[BatchChoiceItem]


class ChoicePage(BaseModel):
    items: list[ChoiceOut]
    total: int
    offset: int
    limit: int
    skipped: int = SKIPPED


class ErrorResponse(BaseModel):
    detail: Any


def lookup_body(entry: Entry, match: str) -> dict[str, Any]:
    """The JSON body of a found lookup (what ``kernel.resolve`` reads)."""
    result = entry.result
    return {"config": result.config.to_dict(), "match": match, "key": result.key.to_dict(),
            "time_ms": result.median_ms, "speedup": result.speedup,
            "provenance": {name: getattr(result, name) for name in LOOKUP_PROVENANCE}}
