"""The tokamax backend (tokamax's splash kernel, an optional extra): what happens without the
package, its rules (the VMEM estimate against tokamax's own out-of-memory configs on a v5e),
its default, seeds and labels, and its kernels' names in a deviceless v5e compile. The common
suite (tests/test_kernel_contract.py) checks its numerics in interpret mode.

The rule tests run without tokamax too: its rules are pure Python, so they pretend the package
is installed (``as_installed``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernel import ConfigError, Problem, get_kernel
from kernel.backends import tokamax_splash
from kernel.backends.tokamax_splash import INSTALL_HINT, TOKAMAX_V5E_WINNER, TokamaxConfig
from kernel.targets import MiB

TOKAMAX = get_kernel("tokamax")
# tokamax's own v5e run (issue 72): full attention, fwd_bwd.
ISSUE_PROBLEM = Problem(batch=4, q_heads=16, kv_heads=16, q_len=4096, kv_len=4096, head_dim=128,
                        dtype="bfloat16", causal=False, mode="fwd_bwd")


def _problem(mode: str = "fwd_bwd", **changes) -> Problem:
    fields = dict(batch=1, q_heads=4, kv_heads=2, q_len=2048, kv_len=2048, head_dim=128,
                  dtype="bfloat16", causal=True, mode=mode)
    return Problem(**{**fields, **changes})


@pytest.fixture
def as_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokamax_splash, "tokamax_violations", list)


# --- without the package -----------------------------------------------------------------------

def test_without_tokamax_every_problem_is_refused_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokamax", None)  # import tokamax fails
    problem = _problem()
    [missing] = TOKAMAX.problem_violations(problem)
    assert missing.rule == "tokamax_missing" and INSTALL_HINT in missing.message
    config = TOKAMAX.default_config(problem, "v5e")
    assert [v.rule for v in TOKAMAX.violations(problem, config, "v5e")] == ["tokamax_missing"]
    assert TOKAMAX.search_space(_problem(q_len=256, kv_len=256)) == []
    # what the tuner (a kernel choice records it as illegal) and the wrapper ask first
    with pytest.raises(ConfigError, match=r"\[tokamax_missing\].*flash-autotune\[tokamax\]"):
        TOKAMAX.check_runs(problem, "v5e")


def test_the_wrapper_passes_it_over_without_tokamax(monkeypatch):
    from kernel import get_target
    from kernel.resolve import Resolver, ResolverSettings

    monkeypatch.setitem(sys.modules, "tokamax", None)
    refusals = Resolver(ResolverSettings()).refusals(_problem(), get_target("v5e"))
    assert "tokamax_missing" in refusals["tokamax"] and "splash" not in refusals


def test_float32_problems_go_to_another_kernel(as_installed):
    """tokamax's kernel multiplies float32 at bf16 precision on a TPU (measured on a v5e):
    the wrapper passes it over for float32 and keeps it for bfloat16."""
    from kernel import get_target
    from kernel.resolve import Resolver, ResolverSettings

    resolver, v5e = Resolver(ResolverSettings()), get_target("v5e")
    assert "tokamax_float32" in resolver.refusals(_problem(dtype="float32"), v5e)["tokamax"]
    assert "tokamax" not in resolver.refusals(_problem(), v5e)


def test_the_registry_loads_and_checks_configs_without_tokamax_or_jax():
    code = (
        "import sys\n"
        "sys.modules['tokamax'] = None\n"
        "import kernel, kernel.registry as r\n"
        "from kernel.problem import Problem\n"
        "k = r.KERNELS['tokamax']\n"
        "p = Problem(1, 4, 2, 2048, 2048, 128, 'bfloat16', True, 'fwd_bwd')\n"
        "print(*[v.rule for v in k.violations(p, k.default_config(p, 'v5e'), 'v5e')])\n"
        "assert 'jax' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["tokamax_missing"]


# --- the VMEM rule against tokamax's own v5e run -----------------------------------------------

# tokamax's autotune at b4 h16 s4096 d128 bf16 on a v5e: 16 of its 32 configs failed with
# CompileTimeScopedVmemOom, among them these (forward: any layout; backward: dK/dV blocks).
TOKAMAX_VMEM_OOMS = {
    "fwd q2048 kv2048/1024": dict(block_q=2048, block_kv=2048, block_kv_compute=1024),
    "fwd q2048 kv2048/1024 sss": dict(block_q=2048, block_kv=2048, block_kv_compute=1024,
                                      q_layout="SEQ_MINOR", k_layout="SEQ_MINOR",
                                      v_layout="SEQ_MINOR"),
    "fwd q4096 kv1024/1024": dict(block_q=4096, block_kv=1024, block_kv_compute=1024),
    "fwd q4096 kv1024/512": dict(block_q=4096, block_kv=1024, block_kv_compute=512),
    "dkv 1024x4096/1024": dict(block_q_dkv=1024, block_kv_dkv=4096, block_kv_dkv_compute=1024),
    "dkv 4096x1024/512": dict(block_q_dkv=4096, block_kv_dkv=1024, block_kv_dkv_compute=512),
    "dkv 2048x4096/512": dict(block_q_dkv=2048, block_kv_dkv=4096, block_kv_dkv_compute=512),
    # 32 unrolled steps of 128 keys: the one of the run's 16 failures the first model admitted
    "fwd q1024 kv4096/128 hsh": dict(block_q=1024, block_kv=4096, block_kv_compute=128,
                                     k_layout="SEQ_MINOR", use_experimental_scheduler=False),
}


@pytest.mark.parametrize("changes", TOKAMAX_VMEM_OOMS.values(), ids=TOKAMAX_VMEM_OOMS)
def test_the_configs_that_overflowed_tokamax_s_v5e_run_are_refused(as_installed, changes):
    config = TOKAMAX.default_config(ISSUE_PROBLEM, "v5e").replace(**changes)
    kernel = "dkv" if "block_q_dkv" in changes else "fwd"
    broken = TOKAMAX.violations(ISSUE_PROBLEM, config, "v5e")
    assert [v.rule for v in broken] == ["vmem"] and f"the {kernel} kernel" in broken[0].message
    assert TOKAMAX.is_legal(ISSUE_PROBLEM, config, "cpu")  # no VMEM limit in interpret mode


# Each config's scoped VMEM allocation per kernel, from the compiler (a deviceless v5e compile
# at a rising limit, as bench/kernels/vmem_sizes.py measures splash's), at b4 h16 s4096 d128.
MEASURED = Path(__file__).resolve().parents[1] / "bench/kernels/data/tokamax_vmem/v5e_4096_b4.jsonl"


def test_the_estimate_bounds_every_measured_allocation(as_installed):
    rows = [json.loads(line) for line in MEASURED.read_text().splitlines()]
    assert len(rows) >= 10
    for row in rows:
        problem = Problem.from_dict(row["problem"])
        config = TOKAMAX.config_from_dict(row["config"])
        estimate = tokamax_splash.vmem_estimate(problem, config)
        for name, size in row["sizes"].items():
            kernel = "dkv" if "_dkv_" in name else "fwd"
            if name.startswith("splash_"):
                assert size <= estimate[kernel] <= 1.1 * size + MiB, (config.label(), name)


def test_tokamax_s_v5e_winner_and_the_default_are_admitted(as_installed):
    winner = TokamaxConfig().replace(**TOKAMAX_V5E_WINNER)
    for config in (winner, TOKAMAX.default_config(ISSUE_PROBLEM, "v5e")):
        assert TOKAMAX.violations(ISSUE_PROBLEM, config, "v5e") == [], config.label()
    assert winner in TOKAMAX.seed_configs(ISSUE_PROBLEM, "v5e")


# --- the other rules, default, space, seeds and labels -----------------------------------------

@pytest.mark.parametrize("problem, changes, rule, fix", [
    (_problem(), dict(dq_reduction_steps=2), "dq_reduction_steps", "null or 3"),
    (_problem(), dict(dq_reduction_steps=3), "dq_reduction_grouped", "use null"),
    (_problem(window=(256, 0)), dict(dq_reduction_steps=3), "dq_reduction_grouped", "use null"),
    (_problem(), dict(block_kv_compute=384), "compute_divides_block", "must divide"),
    (_problem(), dict(block_kv_dkv=1024, block_kv_dkv_compute=2048), "compute_divides_block",
     "must divide block_kv_dkv=1024"),
    (_problem(), dict(block_q=384), "block_divides", "pick one of"),
    (_problem(kv_len=64), dict(), "kv_len", "not a multiple of 128"),
    (_problem(dtype="float32"), dict(), "tokamax_float32", "use bfloat16 inputs, or the flash"),
], ids=["dq-steps", "dq3-grouped-causal", "dq3-grouped-window", "compute", "compute-dkv",
        "divides", "kv-lanes", "float32"])
def test_each_rule_says_how_to_fix_the_config(as_installed, problem, changes, rule, fix):
    config = TOKAMAX.default_config(problem).replace(**changes)
    broken = TOKAMAX.violations(problem, config, "v5e")
    assert any(v.rule == rule and fix in v.message for v in broken), broken


def test_the_in_kernel_dq_reduction_is_admitted_where_interpret_mode_got_it_right(as_installed):
    """dK and dV came out wrong in interpret mode only with grouped K/V heads under a causal
    or window mask (tokamax 0.0.12's dynamic grid accumulates them over a group's heads)."""
    config = TOKAMAX.default_config(_problem()).replace(dq_reduction_steps=3)
    for problem in (_problem(kv_heads=4), _problem(causal=False), _problem("fwd")):
        assert TOKAMAX.violations(problem, config, "v5e") == [], problem.label()


@pytest.mark.parametrize("q_len, block", [(2048, 512), (256, 256), (768, 256), (128, 128)])
def test_the_default_is_512_capped_at_the_sequence(as_installed, q_len, block):
    problem = _problem(q_len=q_len, kv_len=q_len)
    config = TOKAMAX.default_config(problem)
    assert {v for k, v in config.to_dict().items() if k.startswith("block")} == {block}
    assert config.use_experimental_scheduler and config.dq_reduction_steps is None
    assert {config.q_layout, config.k_layout, config.v_layout} == {"HEAD_DIM_MINOR"}
    assert TOKAMAX.is_legal(problem, config, "v5e")


def test_the_space_stops_compute_blocks_at_1024_and_fwd_searches_the_forward_only():
    params = TOKAMAX.space_params(_problem(q_len=4096, kv_len=4096))
    assert params["block_kv"] == [128, 256, 512, 1024, 2048, 4096]
    assert params["block_kv_compute"] == params["block_kv_dkv_compute"] == [128, 256, 512, 1024]
    assert params["dq_reduction_steps"] == [None, 3]
    assert set(TOKAMAX.space_params(_problem("fwd"))) == {
        "block_q", "block_kv", "block_kv_compute", "q_layout", "k_layout", "v_layout",
        "use_experimental_scheduler"}


def test_the_seeds_are_legal_and_the_winner_is_capped_at_short_sequences(as_installed):
    problem = _problem(q_len=1024, kv_len=1024)
    seeds = TOKAMAX.seed_configs(problem, "v5e")
    assert seeds and all(TOKAMAX.is_legal(problem, seed, "v5e") for seed in seeds)
    capped = [s for s in seeds if s.q_layout == "SEQ_MINOR"]
    assert [(s.block_q, s.block_kv, s.block_q_dkv) for s in capped] == [(1024, 1024, 1024)]


def test_labels_name_what_each_mode_runs():
    winner = TokamaxConfig().replace(**TOKAMAX_V5E_WINNER)
    assert winner.label("fwd") == "q1024 kv4096/512 layout shh exp-sched"
    assert winner.label() == "q1024 kv4096/512 dkv2048x2048/512 layout shh exp-sched"
    assert winner.replace(dq_reduction_steps=3, use_experimental_scheduler=False).label() == (
        "q1024 kv4096/512 dkv2048x2048/512 dq3 layout shh")


# --- a real deviceless compile -----------------------------------------------------------------

@pytest.mark.parametrize("kv_heads", [1, 2], ids=["mqa", "gqa"])
def test_profile_names_are_the_kernels_of_a_v5e_compile(kv_heads):
    """tokamax's kernels as a deviceless v5e compile names them (the MQA entry point for one
    K/V head), which ``profile`` timing counts: the forward saving residuals and the fused
    backward, nothing else."""
    pytest.importorskip("tokamax", reason=f"the tokamax kernel needs {INSTALL_HINT}")
    import jax

    from autotune.timing import op_names
    from kernel.aot import topology_device
    from kernel.contract import input_specs

    problem = _problem(q_len=512, kv_len=512, kv_heads=kv_heads)
    specs = input_specs(problem, topology_device("v5e"))
    config = TOKAMAX.default_config(problem, "v5e")
    compiled = jax.jit(TOKAMAX.build(problem, config)).trace(*specs).lower().compile()
    entry = "mqa" if kv_heads == 1 else "mha"
    counted = sorted({op.split(".")[0] for op in op_names(compiled)}
                     & set(TOKAMAX.profile_names))
    assert counted == [f"splash_{entry}_dkv_no_residuals", f"splash_{entry}_fwd_residuals"]


def test_the_backward_runs_as_tokamax_s_own_op_whatever_the_forward_s_layouts():
    """A forward with a SEQ_MINOR q and the experimental scheduler; its fused backward with
    HEAD_DIM_MINOR layouts and Mosaic's default scheduler, as tokamax's own op runs it (the
    program its tuner times), in a v5e lowering's kernel metadata and flags."""
    pytest.importorskip("tokamax", reason=f"the tokamax kernel needs {INSTALL_HINT}")
    import re

    import jax

    from kernel.aot import topology_device
    from kernel.contract import input_specs

    problem = _problem(q_len=512, kv_len=512)
    config = TOKAMAX.default_config(problem, "v5e").replace(q_layout="SEQ_MINOR",
                                                           use_experimental_scheduler=True)
    specs = input_specs(problem, topology_device("v5e"))
    text = jax.jit(TOKAMAX.build(problem, config)).trace(*specs).lower().as_text()
    kernels = {match[1]: line for line in text.splitlines()
               if (match := re.search(r'kernel_name = "(splash_\w+)"', line))}
    forward, backward = kernels["splash_mha_fwd_residuals"], kernels["splash_mha_dkv_no_residuals"]
    scheduler = r"FORCE_LP_LLO_SCHEDULER[^}]*boolean_value[^:]*: true"
    assert re.search(scheduler, forward) and not re.search(scheduler, backward)
    q_layout = r'q_layout[^:]*: (\d)'  # QKVLayout: 1 HEAD_DIM_MINOR, 2 SEQ_MINOR
    assert re.findall(q_layout, forward)[-1] == "2" and re.findall(q_layout, backward) == ["1"]
