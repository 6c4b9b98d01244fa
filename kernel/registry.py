"""The tunable attention kernels: one module per implementation, one registry.

A :class:`TunableKernel` is what the tuner, precheck, storage and service need to know about a
kernel: a typed config (a frozen dataclass of integers), the values the search varies for a
problem, the kernel's own legality rules (pure Python, so the service can check a stored config
without jax), a default config, and ``build``, which makes the function the tuner measures.
Autotuning stays outside the kernels (tokamax style).

Pure Python at import: jax loads only inside ``build``, ``reference``, ``discover`` and
:func:`compile_for_target`. Every kernel takes and returns our layout ``[batch, heads, seq,
head_dim]`` and the scale ``head_dim ** -0.5``, whatever its upstream call expects.

Registered: ``flash`` (our Pallas TPU kernel, :mod:`kernel.flash`), ``jax_tpu_flash`` (JAX's
Pallas TPU flash attention, :mod:`kernel.jax_tpu_flash`), ``pallas_gpu`` (JAX's Pallas Triton
kernel for GPUs, :mod:`kernel.pallas_gpu`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from kernel import KERNEL_NAME, KERNEL_VERSION, space
from kernel.config import ConfigError, FlashConfig, IntConfig
from kernel.problem import Problem
from kernel.space import DEFAULT_DEPTHS, TARGETS, Target, Violation

Params = dict[str, list[int]]
AttentionFn = Callable[..., Any]  # (q, k, v) -> output, or (dq, dk, dv) in fwd_bwd mode

# A GPU has no scoped VMEM; what its kernels cannot hold (shared memory, registers) only the
# Triton compiler on a GPU knows. Matched by platform, not device kind ("NVIDIA H200", ...).
GPU_TARGET = Target("gpu", "gpu", None)
TPU_TARGETS: tuple[str, ...] = tuple(TARGETS)  # v4 v5e v5p v6e cpu


def device_target(platform: str, device_kind: str) -> Target:
    """The rules' target of a JAX device (``device.platform``, ``device.device_kind``): a
    known TPU generation, ``gpu`` for any CUDA/ROCm device, else ``cpu`` (interpret mode)."""
    if platform in ("gpu", "cuda", "rocm"):
        return GPU_TARGET
    return next((t for t in TARGETS.values() if t.device_kind == device_kind), TARGETS["cpu"])


def measured_fn(problem: Problem, attend: AttentionFn) -> AttentionFn:
    """What the tuner measures for ``problem.mode``: ``attend`` itself (``fwd``), or the
    gradients of ``sum(attend(q, k, v))`` with respect to q, k and v (``fwd_bwd``)."""
    import jax
    import jax.numpy as jnp

    if problem.mode == "fwd":
        return attend
    return jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))


def repeat_kv_heads(problem: Problem, k: Any, v: Any) -> tuple[Any, Any]:
    """K and V with each head repeated ``group_size`` times, for kernels without grouped-query
    attention (their gradients sum back over the group)."""
    import jax.numpy as jnp

    if problem.group_size == 1:
        return k, v
    return (jnp.repeat(k, problem.group_size, axis=1),
            jnp.repeat(v, problem.group_size, axis=1))


def sm_scale(problem: Problem) -> float:
    """The softmax scale every registered kernel uses (upstream kernels default to 1.0)."""
    return problem.head_dim ** -0.5


class TunableKernel(ABC):
    """A kernel the tuner can search: metadata, config type, space, rules, default, build.

    Subclasses set the class attributes and implement the four abstract methods; the rules
    must be pure Python. ``target`` arguments take a :class:`Target` or a name from
    ``targets``.
    """

    name: ClassVar[str]
    version: ClassVar[str]
    description: ClassVar[str]
    layout: ClassVar[str]  # the layout the implementation takes (``build`` always takes ours)
    targets: ClassVar[tuple[str, ...]]  # what it can be tuned / prechecked for
    platforms: ClassVar[tuple[str, ...]]  # JAX platforms where it runs for real
    config_type: ClassVar[type[IntConfig]]
    # The report's landscape plot: (x field, y field, panel field: one panel per value).
    landscape_axes: ClassVar[tuple[str, str, str]]

    @abstractmethod
    def space_params(self, problem: Problem) -> Params:
        """The values of each field the search varies for ``problem`` (and its mode); fields
        left out keep the default config's values."""

    @abstractmethod
    def violations(self, problem: Problem, config: Any,
                   target: Target | str = "cpu") -> list[Violation]:
        """Every rule ``config`` breaks for ``problem`` on ``target`` (empty when legal)."""

    @abstractmethod
    def default_config(self, problem: Problem, target: Target | str = "cpu") -> Any:
        """The config used without tuning (the baseline a tuned config must beat)."""

    @abstractmethod
    def build(self, problem: Problem, config: Any) -> AttentionFn:
        """The function the tuner measures: ``(q, k, v)`` in our layout to the output
        (``fwd``) or to ``(dq, dk, dv)`` (``fwd_bwd``). Raises ``ConfigError`` when
        ``config`` breaks a static rule. Runs in interpret mode on CPU."""

    def problem_violations(self, problem: Problem) -> list[Violation]:
        """Rules the problem itself breaks (no config can run it); part of ``violations``."""
        return []

    def discover(self) -> TunableKernel:
        """This kernel with the facts only the installed JAX can tell (imports jax)."""
        return self

    def reference(self, problem: Problem) -> AttentionFn:
        """The XLA reference of what ``build`` computes: ``jax.nn.dot_product_attention`` with
        its own default scale (``head_dim ** -0.5``, what :func:`sm_scale` gives)."""
        from kernel.flash import reference_attention

        return measured_fn(problem, functools.partial(reference_attention,
                                                      causal=problem.causal))

    def target(self, target: Target | str) -> Target:
        """Resolves a target (a name or a JAX device kind) among this kernel's targets."""
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
        """A config of this kernel from JSON (``ConfigError`` names the bad field)."""
        return self.config_type.from_dict(dict(data) if isinstance(data, Mapping) else data)

    def check(self, problem: Problem, config: Any, target: Target | str = "cpu") -> None:
        """Raises ``ConfigError`` naming every rule ``config`` breaks."""
        if not isinstance(config, self.config_type):
            raise ConfigError(f"kernel {self.name!r} takes a {self.config_type.__name__}, got "
                              f"{type(config).__name__}")
        broken = self.violations(problem, config, target)
        if broken:
            raise ConfigError(f"config {config.label()} of kernel {self.name!r} is illegal for "
                              f"{problem.label()}: " + "; ".join(map(str, broken)))

    def stored_violations(self, problem: Problem, config: Any) -> list[Violation]:
        """The rules a stored config must pass whatever device tuned it: the ``cpu`` target's
        (no VMEM limit). What storage, the service and lookup tables check, without jax."""
        return self.violations(problem, config, "cpu")

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
            except ConfigError:  # a config type that refuses a field relation (FlashConfig)
                continue
            if all(v.rule in ignore for v in self.violations(problem, config, target)):
                out.append(config)
        return out


@dataclass(frozen=True)
class FlashKernel(TunableKernel):
    """Our Pallas TPU flash kernel (:mod:`kernel.flash`), rules in :mod:`kernel.space`.

    ``depths`` are the pipeline depths the rules admit: :data:`kernel.space.DEFAULT_DEPTHS`
    (what every supported JAX lowers) until :meth:`discover` asks the installed JAX.
    """

    depths: tuple[int, ...] = DEFAULT_DEPTHS

    name: ClassVar[str] = KERNEL_NAME
    version: ClassVar[str] = KERNEL_VERSION
    description: ClassVar[str] = ("Our Pallas flash attention for TPU: grouped-query, causal, "
                                  "tiled forward, dK/dV and dQ kernels with K/V pipelining")
    layout: ClassVar[str] = "[batch, heads, seq, head_dim]"
    targets: ClassVar[tuple[str, ...]] = TPU_TARGETS
    platforms: ClassVar[tuple[str, ...]] = ("tpu",)
    config_type: ClassVar[type[FlashConfig]] = FlashConfig
    landscape_axes: ClassVar[tuple[str, str, str]] = ("block_q", "block_kv", "pipeline_depth")

    def space_params(self, problem: Problem) -> Params:
        return space.space_params(problem, self.depths)

    def violations(self, problem: Problem, config: FlashConfig,
                   target: Target | str = "cpu") -> list[Violation]:
        return space.violations(problem, config, self.target(target), depths=self.depths)

    def default_config(self, problem: Problem, target: Target | str = "cpu") -> FlashConfig:
        return space.default_config(problem, self.target(target), depths=self.depths)

    def stored_violations(self, problem: Problem, config: FlashConfig) -> list[Violation]:
        # The pipeline-depth rule depends on the tuner's JAX: the depth it measured is taken
        # as supported.
        return space.static_violations(problem, config, depths=(config.pipeline_depth,))

    def build(self, problem: Problem, config: FlashConfig) -> AttentionFn:
        from kernel.aot import attention_fn

        self.check(problem, config)  # static rules (the cpu target has no VMEM limit)
        return attention_fn(problem, config)

    def discover(self) -> FlashKernel:
        from kernel.depths import supported_pipeline_depths

        return dataclasses.replace(self, depths=supported_pipeline_depths())


FLASH = FlashKernel()


@functools.cache
def _registry() -> MappingProxyType[str, TunableKernel]:
    # Imported here, not at the top: the kernel modules import this module's base classes.
    from kernel import jax_tpu_flash, pallas_gpu

    return MappingProxyType({k.name: k for k in (FLASH, jax_tpu_flash.KERNEL, pallas_gpu.KERNEL)})


def kernel_names() -> list[str]:
    return list(_registry())


def get_kernel(name: str) -> TunableKernel:
    """The registered kernel called ``name``; an unknown name lists the known ones."""
    kernels = _registry()
    if name not in kernels:
        raise ConfigError(f"unknown kernel {name!r}; choose one of {', '.join(kernels)}")
    return kernels[name]


def __getattr__(name: str) -> Any:
    if name == "KERNELS":  # name -> kernel, read-only
        return _registry()
    raise AttributeError(f"module 'kernel.registry' has no attribute {name!r}")


def compile_for_target(
    kernel: TunableKernel, problem: Problem, config: Any, target: Target | str,
    compiler_options: dict[str, str | int | bool] | None = None,
) -> float:
    """Compiles ``kernel``'s measured function for a TPU generation without a TPU (deviceless
    topology, real Mosaic compiler) and returns the compile seconds; raises what the compiler
    raises. Needs libtpu. :func:`kernel.aot.compile_for_target` for any registered kernel."""
    import time

    import jax

    from kernel.aot import input_specs, topology_device

    target = kernel.target(target)
    device = topology_device(target.name)
    start = time.perf_counter()
    lowered = jax.jit(kernel.build(problem, config)).trace(
        *input_specs(problem, device)).lower()
    lowered.compile(compiler_options=compiler_options)
    return time.perf_counter() - start

