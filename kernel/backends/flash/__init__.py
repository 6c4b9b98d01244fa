"""Backend ``flash``: our Pallas flash attention for TPU, tiled by a :class:`FlashConfig`.

The backend is this folder: the config (``config``), the legality rules and VMEM estimate
(``rules``, pure Python), the pipeline-depth probe (``depths``) and the Pallas kernels
(``pallas``); jax loads only when :meth:`FlashKernel.attention` or ``discover`` runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from kernel.backends.flash import rules
from kernel.backends.flash.config import DKV_FIELDS, DQ_FIELDS, FORWARD_FIELDS, FlashConfig
from kernel.contract import AttentionFn, ConfigFor, Params, TunableKernel
from kernel.problem import Problem
from kernel.rules import Violation
from kernel.targets import TPU_TARGETS, Target


@dataclass(frozen=True)
class FlashKernel(TunableKernel):
    """Our kernel. ``depths`` are the pipeline depths the rules admit (for each of the three
    kernels): :data:`rules.DEFAULT_DEPTHS` (what every supported JAX lowers) until
    :meth:`discover` probes the installed JAX."""

    depths: tuple[int, ...] = rules.DEFAULT_DEPTHS

    name: ClassVar[str] = "flash"
    version: ClassVar[str] = "1"
    description: ClassVar[str] = ("Our Pallas flash attention for TPU: grouped-query, causal, "
                                  "sliding-window (blocks outside it skipped), soft-capped, "
                                  "segmented (packed sequences); "
                                  "tiled forward, dK/dV and dQ kernels, each streaming its "
                                  "operands through a 1-4 deep in-kernel pipeline; dQ fused "
                                  "into dK/dV where the tuner finds it faster")
    targets: ClassVar[tuple[str, ...]] = TPU_TARGETS
    platforms: ClassVar[tuple[str, ...]] = ("tpu",)
    config_type: ClassVar[type[FlashConfig]] = FlashConfig
    landscape_axes: ClassVar[tuple[str, str, str]] = ("block_q", "block_kv", "pipeline_depth")
    compile_parts: ClassVar[tuple[tuple[str, ...], ...]] = (FORWARD_FIELDS, DKV_FIELDS, DQ_FIELDS)
    profile_names: ClassVar[tuple[str, ...]] = ("flash_fwd", "flash_bwd_dkv", "flash_bwd_dq")

    def problem_violations(self, problem: Problem) -> list[Violation]:
        return rules.problem_violations(problem)

    def space_params(self, problem: Problem) -> Params:
        return rules.space_params(problem, self.depths)

    def canonical_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The fused backward runs no dQ kernel: its dQ fields are None, whatever was drawn
        (``dq_unused``)."""
        if params.get("fused_bwd"):
            return {**params, **{field: None for field in DQ_FIELDS if field in params}}
        return params

    def violations(self, problem: Problem, config: FlashConfig,
                   target: Target | str = "cpu") -> list[Violation]:
        return rules.violations(problem, config, self.target(target), self.depths)

    def default_config(self, problem: Problem, target: Target | str = "cpu") -> FlashConfig:
        return rules.default_config(problem, self.target(target), self.depths)

    def seed_configs(self, problem: Problem, target: Target | str = "cpu") -> list[FlashConfig]:
        """The uniform blocks (the contract's), then in fwd_bwd the default and each of them
        with the fused backward (issue 74: on short unmasked problems splash's fused backward
        beat our three kernels), where legal."""
        uniform = super().seed_configs(problem, target)
        if problem.mode == "fwd":
            return uniform
        fused = [config.fused() for config in [self.default_config(problem, target), *uniform]]
        return [*uniform, *(config for config in fused
                            if not self.violations(problem, config, target))]

    def stored_violations(self, problem: Problem, config: FlashConfig) -> list[Violation]:
        # Whichever JAX tuned it: any depth some supported JAX can lower is storable; the
        # wrapper checks the installed JAX's depths at trace time.
        return (rules.problem_violations(problem) + rules.static_violations(
            problem, config, range(1, rules.MAX_PROBED_DEPTH + 1)))

    def attention(self, problem: Problem, config_for: ConfigFor,
                  sm_scale: float) -> AttentionFn:
        from kernel.backends.flash import pallas
        from kernel.backends.flash.blocks import Reach

        logits = pallas.Logits(sm_scale, Reach.of(problem), problem.softcap)
        def attend(q, k, v, *segment_ids):  # noqa: ANN001, ANN002, ANN202
            return pallas.flash_attention(q, k, v, segment_ids or None, logits, config_for)

        return attend

    def discover(self) -> FlashKernel:
        from kernel.backends.flash.depths import supported_pipeline_depths

        return dataclasses.replace(self, depths=supported_pipeline_depths())


KERNEL = FlashKernel()
