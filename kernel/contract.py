"""The backend contract: what the tuner, the resolver, storage and the service know of a kernel.

Pure Python at import: a backend loads jax only inside the methods that need it, so the
service can check a stored config with the backend's rules without jax. Every backend takes
and returns our layout ``[batch, heads, seq, head_dim]``, whatever its own call expects.
"""

from __future__ import annotations

import functools
import itertools
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from kernel.config import IntConfig
from kernel.errors import ConfigError
from kernel.problem import Problem
from kernel.reference import attention_mask, problem_reference
from kernel.rules import Violation
from kernel.targets import GPU_TARGET, TARGETS, Target

Params = dict[str, list[int]]
# (q, k, v) -> output, or -> (dq, dk, dv) in fwd_bwd mode; for a segmented problem
# (packed sequences) two more arguments follow: q_segment_ids [batch, q_len] and
# kv_segment_ids [batch, kv_len], int32, never differentiated.
AttentionFn = Callable[..., Any]
# The config a backend runs for a mode ("fwd" for a plain call, "fwd_bwd" when differentiated);
# the resolver passes one in, so no backend imports the resolver.
ConfigFor = Callable[[str], Any]


def default_device() -> Any:
    """The device a call traced now runs on: ``jax_default_device``, else the first device."""
    import jax

    device = jax.config.jax_default_device
    if not isinstance(device, jax.Device):
        device = jax.devices(device)[0] if device else jax.devices()[0]
    return device


def default_scale(problem: Problem) -> float:
    """The softmax scale every backend defaults to (upstream kernels default to 1.0)."""
    return problem.head_dim ** -0.5


def measured_fn(problem: Problem, attend: AttentionFn, *,
                forward_only: bool = False) -> AttentionFn:
    """What the tuner measures for ``problem.mode``: ``attend`` itself (``fwd``), or the
    gradients of ``sum(attend(q, k, v))`` with respect to q, k and v (``fwd_bwd``).
    ``forward_only`` (``fwd_bwd``): just the forward pass as training runs it (``jax.vjp``,
    saving the residuals), without the backward kernels. Segment ids, for a segmented problem,
    follow q, k and v, and are not differentiated."""
    import jax
    import jax.numpy as jnp

    if problem.mode == "fwd":
        return attend
    if forward_only:
        return lambda q, k, v, *ids: jax.vjp(lambda q, k, v: attend(q, k, v, *ids), q, k, v)
    return jax.grad(lambda q, k, v, *ids: attend(q, k, v, *ids).astype(jnp.float32).sum(),
                    argnums=(0, 1, 2))


def gate_reference(problem: Problem) -> AttentionFn:
    """What the tuner's correctness gate checks every backend against, in ``problem.mode``:
    attention in float32 at ``highest`` precision, in bounded memory
    (:func:`kernel.reference.blockwise_reference`), or its gradients (:func:`measured_fn`)."""
    return measured_fn(problem, problem_reference(problem))


def by_mode(attend_for: Callable[[str], AttentionFn],
            run: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda fn: fn,
            ) -> AttentionFn:
    """``attend_for("fwd")``, and, when differentiated, ``attend_for("fwd_bwd")`` both ways
    (its VJP is the residual). Each is built at trace time, only when it runs. ``run`` wraps
    what is traced: the forward, and the backward too, which a custom VJP inside traces only
    when the gradient is taken (e.g. in TPU interpret mode off a TPU)."""
    import jax

    @jax.custom_vjp
    def attend(q, k, v, *segment_ids):  # noqa: ANN001, ANN002, ANN202
        return run(attend_for("fwd"))(q, k, v, *segment_ids)

    def forward(q, k, v, *segment_ids):  # noqa: ANN001, ANN002, ANN202
        return jax.vjp(run(attend_for("fwd_bwd")), q, k, v, *segment_ids)

    def backward(vjp, cotangent):  # noqa: ANN001, ANN202
        return run(vjp)(cotangent)

    attend.defvjp(forward, backward)
    return attend


def mosaic_or_interpreted(attend_for: Callable[[bool], AttentionFn]) -> AttentionFn:
    """``attend_for(interpret)``: compiled with Mosaic on a TPU (``False``), interpreted
    elsewhere (``True``), chosen per platform when lowering (``lax.platform_dependent``), so an
    ahead-of-time compile for a TPU on a CPU host still gets the Mosaic kernels."""
    from jax import lax

    return lambda *args: lax.platform_dependent(
        *args, tpu=lambda *a: attend_for(False)(*a), default=lambda *a: attend_for(True)(*a))


def per_mode(attend_with: Callable[[Any], AttentionFn], config_for: ConfigFor,
             run: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda fn: fn,
             ) -> AttentionFn:
    """``attend_with(config)`` with ``config_for("fwd")``, and, when differentiated, with
    ``config_for("fwd_bwd")`` both ways: for a kernel whose own custom VJP (upstream's)
    differentiates with the one config it was called with, so that a training step runs the
    ``fwd_bwd``-tuned config, checked against the ``fwd_bwd`` rules. ``run``: as
    :func:`by_mode`'s."""
    return by_mode(lambda mode: attend_with(config_for(mode)), run)


def repeat_kv_heads(problem: Problem, k: Any, v: Any) -> tuple[Any, Any]:
    """K and V with each head repeated ``group_size`` times, for backends without grouped-query
    attention (their gradients sum back over the group)."""
    import jax.numpy as jnp

    if problem.group_size == 1:
        return k, v
    return (jnp.repeat(k, problem.group_size, axis=1),
            jnp.repeat(v, problem.group_size, axis=1))


def reference_attention(q: Any, k: Any, v: Any, q_segment_ids: Any = None,
                        kv_segment_ids: Any = None, *, causal: bool = False,
                        sm_scale: float | None = None, window: tuple[int, int] | None = None,
                        softcap: float | None = None, query_offset: int = 0) -> Any:
    """Plain XLA attention in our layout: the reference every backend is checked against.
    ``jax.nn.dot_product_attention`` (grouped-query K/V heads broadcast by XLA); with a
    ``softcap``, a mask or a ``query_offset``, which it lacks, the same in plain jnp. Masks as
    :func:`attention_mask`, query 0 at position ``query_offset`` (``kv_len - q_len``:
    bottom-right aligned); a query that sees no key at all gets zeros."""
    import jax
    import jax.numpy as jnp

    to_btnh = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    if softcap is None and q_segment_ids is None and window is None and not query_offset:
        out = jax.nn.dot_product_attention(to_btnh(q), to_btnh(k), to_btnh(v), scale=sm_scale,
                                           is_causal=causal)
        return to_btnh(out)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    group = q.shape[1] // k.shape[1]
    k, v = (jnp.repeat(x, group, axis=1) for x in (k, v))
    logits = jnp.einsum("bhqd,bhkd->bhqk", q, k,
                        preferred_element_type=jnp.promote_types(q.dtype, jnp.float32)) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    mask = attention_mask(q.shape[2], k.shape[2], causal=causal, window=window,
                          q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                          first_query=query_offset)
    logits = jnp.where(mask, logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total == 0, 1, total)  # a row with no key: zeros
    return jnp.einsum("bhqk,bhkd->bhqd", probs.astype(v.dtype), v,
                      preferred_element_type=probs.dtype).astype(q.dtype)


def input_specs(problem: Problem, device: Any = None) -> list[Any]:
    """Abstract q, k, v for ``problem`` (``jax.ShapeDtypeStruct``), and for a segmented one its
    q and kv segment ids (int32), placed on ``device`` when given: what an attention backend's
    :meth:`TunableKernel.input_specs` gives."""
    q_shape = (problem.batch, problem.q_heads, problem.q_len, problem.head_dim)
    kv_shape = (problem.batch, problem.kv_heads, problem.kv_len, problem.head_dim)
    ids = [(problem.batch, problem.q_len), (problem.batch, problem.kv_len)]
    return abstract_arrays([(shape, problem.dtype) for shape in (q_shape, kv_shape, kv_shape)]
                           + [(shape, "int32") for shape in (ids if problem.segmented else [])],
                           device)


def abstract_arrays(shapes: list[tuple[tuple[int, ...], str]], device: Any = None) -> list[Any]:
    """``jax.ShapeDtypeStruct`` of each ``(shape, dtype name)``, placed on ``device`` when
    given: the abstract inputs a backend's :meth:`TunableKernel.input_specs` gives."""
    import jax
    import jax.numpy as jnp

    sharding = jax.sharding.SingleDeviceSharding(device) if device is not None else None
    return [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
            for shape, dtype in shapes]


# The packing a segmented problem is tuned and checked with: each batch row holds
# DOCUMENTS_PER_ROW documents (ids 1, 2, ...) of lengths drawn from the row's seed (cut
# points uniform without repetition), then a padding tail of PADDING_FRACTION of the row (id 0,
# a segment of its own, as MaxText pads packed rows). The row is the keys' (kv_len); positions
# are shared by queries and keys (top-left aligned, as causal is): q ids are the row's first
# q_len, and queries past the last key continue its segment, so that every query's segment has
# keys (a query that sees no key gets zeros from the reference, an average from some kernels,
# which would fail their correctness gate).
DOCUMENTS_PER_ROW = 4
PADDING_FRACTION = 1 / 16


def packed_segment_ids(problem: Problem, seed: int = 0) -> tuple[Any, Any]:
    """The representative q and kv segment ids of ``problem`` (int32 numpy arrays
    ``[batch, q_len]`` and ``[batch, kv_len]``), deterministic in ``seed``: see
    :data:`DOCUMENTS_PER_ROW`."""
    import numpy as np

    length = problem.kv_len
    padding = int(length * PADDING_FRACTION)
    filled = length - padding
    rows = []
    for row in range(problem.batch):
        rng = np.random.default_rng([seed, row])
        cuts = rng.choice(np.arange(1, filled), min(DOCUMENTS_PER_ROW, filled) - 1,
                          replace=False) if filled > 1 else np.array([], int)
        documents = np.searchsorted(np.sort(cuts), np.arange(filled), side="right") + 1
        rows.append(np.concatenate([documents, np.zeros(padding, int)]))
    ids = np.asarray(rows, np.int32)
    past_the_keys = np.repeat(ids[:, -1:], max(problem.q_len - length, 0), axis=1)
    return np.concatenate([ids, past_the_keys], axis=1)[:, :problem.q_len], ids


def example_inputs(problem: Problem, seed: int = 0) -> list[Any]:
    """Concrete inputs of ``problem`` (:func:`input_specs`): standard normal q, k, v drawn
    from ``seed``, and for a segmented problem :func:`packed_segment_ids`."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 3)
    specs = input_specs(problem)
    arrays = [jax.random.normal(key, spec.shape, spec.dtype)
              for key, spec in zip(keys, specs[:3], strict=True)]
    if problem.segmented:
        arrays += [jnp.asarray(ids) for ids in packed_segment_ids(problem, seed)]
    return arrays


class TunableKernel(ABC):
    """An attention backend the tuner can search and the wrapper can run.

    Implementor's checklist for a new backend:
      - One module under ``kernel/backends/`` (or one folder), importing only ``kernel.errors``,
        ``problem``, ``config``, ``targets``, ``rules`` and this contract. jax loads inside
        methods (or in a submodule those methods import), never at import time.
      - A config type: a frozen :class:`~kernel.config.IntConfig` subclass whose fields have
        defaults, with a short ``label``; a field's type declares its values (``int``,
        ``int | None`` for a block some settings leave unused, ``bool``, a ``Literal`` of
        strings; :mod:`kernel.config`), and ``space_params`` lists them (``choices``). A
        backend without tunable fields uses an empty one.
      - Class attributes: ``name`` (the registry key, stable: stored results name it),
        ``version`` (bump it when a config's meaning changes), ``description``, ``targets``
        (rule targets it can be tuned or prechecked for), ``platforms`` (JAX platforms where it
        runs natively), ``config_type`` and ``landscape_axes`` (two tile fields and a panel
        field for the report's landscape plot; empty for a backend without tunable fields).
      - ``space_params``: the values of each field the search varies, per mode.
      - ``violations``: every rule a config breaks, pure Python, each with a stable rule name
        and a message that says how to fix it; include ``problem_violations`` (what no config
        can run) and, on TPU targets, a VMEM estimate against ``target.scoped_vmem_bytes``.
      - ``default_config``: legal whenever the problem is; the baseline tuning must beat.
      - ``attention``: the differentiable forward function, taking its config per mode from
        ``config_for`` at trace time (``"fwd"``; ``"fwd_bwd"`` when differentiated: in its own
        backward rule, or through :func:`per_mode` for a kernel whose custom VJP takes one
        config both ways).
      - Optionally ``profile_names``: the ``name=`` of each ``pallas_call`` it runs, so the
        tuner reports those kernels' share of the step beside its time (the tuner's profiler
        timing counts every device op of the measured step either way; empty: no share).
      - Optionally ``seed_configs``: hand-set configs known to do well (a library's own
        recipes), which a search measures right after the default; by default every block
        field at one size, for each size declared.
      - Optionally ``discover`` (facts only the installed JAX can tell), ``stored_violations``,
        ``compile_parts`` (kernels of a gradient program that compile separately) or ``build``
        (when the measured function needs more than ``attention``).
      - A backend of another problem type (a serving step, ``kernel.serving``) sets
        ``problem_type`` and overrides ``build``, ``reference`` (jittable: the tuner compiles
        it), ``input_specs``, ``example_inputs`` and ``compositions``; it registers in
        ``SERVING_KERNELS``, not ``KERNELS``.
      - Register it in ``kernel/registry.py`` and list it in docs/kernels.md. The common suite
        (``tests/test_kernel_contract.py``) then checks its numerics and rules with no change.
    """

    name: ClassVar[str]
    version: ClassVar[str]
    # The problems it is tuned and called for: an attention call, or a serving step
    # (kernel.serving.ServingProblem). The contract's methods take problems of this type.
    problem_type: ClassVar[type] = Problem
    description: ClassVar[str]
    targets: ClassVar[tuple[str, ...]]
    platforms: ClassVar[tuple[str, ...]]
    config_type: ClassVar[type[IntConfig]]
    landscape_axes: ClassVar[tuple[str, ...]]  # (x, y, panel) fields; () when none
    # fwd_bwd only: field groups of kernels that compile independently, the forward's first.
    # A config compiles exactly when each part does with the others at the default, so
    # precheck covers the product of the parts with their sum of compiles. Empty: one program.
    compile_parts: ClassVar[tuple[tuple[str, ...], ...]] = ()
    # The pallas_call names of its kernels, as device profiles show them: their share of the
    # step is reported beside its time; (): none is.
    profile_names: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def space_params(self, problem: Problem) -> Params:
        """The values of each field the search varies for ``problem`` (and its mode); fields
        left out keep the default config's values."""

    def canonical_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` with each field the rest of them leave unused set to the value the
        config takes then (e.g. a flag that drops a kernel, and that kernel's blocks). The search
        draws such a field like any other and measures a config once, whatever it drew: a field
        that is legal only at one value under a flag would otherwise make that flag's branch a
        sliver of the legal space. Default: every field is always used."""
        return params

    @abstractmethod
    def violations(self, problem: Problem, config: Any,
                   target: Target | str = "cpu") -> list[Violation]:
        """Every rule ``config`` breaks for ``problem`` on ``target`` (empty when legal)."""

    @abstractmethod
    def default_config(self, problem: Problem, target: Target | str = "cpu") -> Any:
        """The config used without tuning (the baseline a tuned config must beat)."""

    @abstractmethod
    def attention(self, problem: Problem, config_for: ConfigFor,
                  sm_scale: float) -> AttentionFn:
        """``(q, k, v) -> softmax(sm_scale q kᵀ) v`` for ``problem`` in our layout,
        differentiable; compiled natively on ``platforms``, interpreted on a CPU."""

    def seed_configs(self, problem: Problem, target: Target | str = "cpu") -> list[Any]:
        """Legal configs a search measures right after the default: the default with every
        ``block_*`` field at one size, for each size two or more of them declare (a field that
        lacks the size keeps the default's). On a v5e splash with every block 1024 beat MaxText's
        512 by 1.15x where a 20-trial search found nothing better (pallas-facts §10)."""
        params, base = self.space_params(problem), self.default_config(problem, target)
        blocks = [name for name in params if name.startswith("block_")]
        declared = Counter(value for name in blocks for value in params[name]
                           if isinstance(value, int))
        sizes = sorted(size for size, fields in declared.items() if fields > 1)  # a tile size
        out = []
        for size in sizes:
            try:
                config = base.replace(**{name: size for name in blocks if size in params[name]})
            except ConfigError:  # a config type that refuses a field relation
                continue
            if config != base and not self.violations(problem, config, target):
                out.append(config)
        return out

    def baselines(self, problem: Problem, target: Target | str = "cpu") -> dict[str, Any]:
        """Named configs a tune confirms beside the default and its best measured ones (a
        library's own choice for the problem), so that its summary says how the winner
        compares with each; {} by default."""
        return {}

    def problem_violations(self, problem: Problem) -> list[Violation]:
        """Rules the problem itself breaks (no config can run it); part of ``violations``."""
        return []

    def check_problem(self, problem: Problem) -> None:
        """Raises ``ConfigError`` naming every rule ``problem`` breaks for this backend."""
        broken = self.problem_violations(problem)
        if broken:
            raise ConfigError(f"kernel {self.name!r} cannot run {problem.label()}: "
                              + "; ".join(map(str, broken)))

    def device_violations(self, problem: Problem, target: Target) -> list[Violation]:
        """Rules the problem breaks on ``target`` alone (no config can run it there, e.g. a
        precision the device's kernels lack); part of ``violations``. [] by default."""
        return []

    def check_runs(self, problem: Problem, target: Target | str) -> None:
        """Raises ``ConfigError`` when this backend cannot run ``problem`` on ``target``: a
        device it has no rules for, or a problem no config of it can run, anywhere or there.
        Asked by the tuner before tuning a candidate and by the resolver before running a
        picked backend."""
        target = self.target(target)  # names the backend's targets when it is not one of them
        self.check_problem(problem)
        broken = self.device_violations(problem, target)
        if broken:
            raise ConfigError(f"kernel {self.name!r} cannot run {problem.label()} on "
                              f"{target.name}: " + "; ".join(map(str, broken)))

    def discover(self) -> TunableKernel:
        """This backend with the facts only the installed JAX can tell (imports jax)."""
        return self

    def build(self, problem: Problem, config: Any, *, forward_only: bool = False) -> AttentionFn:
        """The function the tuner measures: ``(q, k, v)`` to the output (``fwd``) or to
        ``(dq, dk, dv)`` (``fwd_bwd``; ``forward_only``: see :func:`measured_fn`). Raises
        ``ConfigError`` when ``config`` breaks a static rule."""
        self.check(problem, config)
        return measured_fn(problem, self.attention(problem, lambda mode: config,
                                                   default_scale(problem)),
                           forward_only=forward_only)

    def compositions(self, problem: Problem) -> list[dict[str, Any]] | None:
        """The batch compositions :meth:`build` runs, recorded in a tuned result's provenance
        (``compositions``): a serving step's; None for an attention call, which runs its one
        problem."""
        return None

    def as_called(self, problem: Problem, config: Any) -> AttentionFn:
        """What ``kernel.flash_attention`` runs when it picks this backend with ``config``
        (:meth:`attention` under :func:`by_mode`), in the form :meth:`build` returns. A kernel
        choice confirms its candidates with it: a kernel the wrapper cannot run here is never
        chosen, whatever :meth:`build` measured."""
        self.check(problem, config)
        return measured_fn(problem, by_mode(lambda mode: self.attention(
            problem, lambda config_mode: config, default_scale(problem))))

    def input_specs(self, problem: Problem, device: Any = None) -> list[Any]:
        """Abstract inputs of what :meth:`build` returns (``jax.ShapeDtypeStruct``), placed on
        ``device`` when given: an attention call's (:func:`input_specs`) by default."""
        return input_specs(problem, device)

    def example_inputs(self, problem: Problem, seed: int = 0) -> list[Any]:
        """Concrete inputs of :meth:`input_specs`, deterministic in ``seed``: an attention
        call's (:func:`example_inputs`) by default."""
        return example_inputs(problem, seed)

    def reference(self, problem: Problem) -> AttentionFn:
        """The XLA reference of what ``build`` computes: :func:`gate_reference`, the same for
        every backend."""
        return gate_reference(problem)

    def target(self, target: Target | str) -> Target:
        """Resolves a target (a name or a JAX device kind) among this backend's targets."""
        if isinstance(target, Target) and target.name in self.targets:
            return target
        for name in self.targets:
            known = GPU_TARGET if name == GPU_TARGET.name else TARGETS[name]
            if target in (name, known.device_kind):
                return known
        shown = target.name if isinstance(target, Target) else target
        raise ConfigError(f"kernel {self.name!r} has no target {shown!r}; choose one of "
                          f"{', '.join(self.targets)}")

    def config_from_dict(self, data: Mapping[str, Any]) -> Any:
        """A config of this backend from JSON (``ConfigError`` names the bad field)."""
        return self.config_type.from_dict(dict(data) if isinstance(data, Mapping) else data)

    @property
    def portable_target(self) -> str:
        """The target whose rules hold wherever this backend runs: ``cpu`` (no VMEM limit),
        or for a backend that never runs on a CPU (``cudnn``) its first target."""
        return "cpu" if "cpu" in self.targets else self.targets[0]

    def check(self, problem: Problem, config: Any, target: Target | str | None = None) -> None:
        """Raises ``ConfigError`` naming every rule ``config`` breaks on ``target`` (default
        :attr:`portable_target`)."""
        if not isinstance(config, self.config_type):
            raise ConfigError(f"kernel {self.name!r} takes a {self.config_type.__name__}, got "
                              f"{type(config).__name__}")
        broken = self.violations(problem, config, target or self.portable_target)
        if broken:
            raise ConfigError(f"config {config.label(problem.mode)} of kernel {self.name!r} is "
                              f"illegal for {problem.label()}: " + "; ".join(map(str, broken)))

    def stored_violations(self, problem: Problem, config: Any) -> list[Violation]:
        """The rules a stored config must pass whatever device tuned it, its
        :attr:`portable_target`'s. What storage, the service and lookup tables check, without
        jax."""
        return self.violations(problem, config, self.portable_target)

    def is_legal(self, problem: Problem, config: Any, target: Target | str = "cpu") -> bool:
        return not self.violations(problem, config, target)

    def search_space(self, problem: Problem, target: Target | str = "cpu", *,
                     ignore: frozenset[str] = frozenset()) -> list[Any]:
        """Every legal config (the product of ``space_params`` filtered by the rules, except
        those named in ``ignore``: precheck compiles the ``vmem``-rejected ones too).
        Enumerates the whole product: for small problems and tests; the tuner samples."""
        target = self.target(target)
        base = self.default_config(problem, target)
        params = self.space_params(problem)
        out = []
        for values in itertools.product(*params.values()):
            try:
                config = base.replace(**dict(zip(params, values)))
            except ConfigError:  # a config type that refuses a field relation
                continue
            if all(v.rule in ignore for v in self.violations(problem, config, target)):
                out.append(config)
        return out
