"""Deviceless precheck: real Mosaic compiles for v5e and v6e on this CPU-only host (libtpu),
classification of the compiler's failures (VMEM overflow, timeout), the ``autotune precheck``
CLI and the agreement of the VMEM estimate with the compiler on a small problem.

Failing compiles fail fast here because the scoped VMEM limit is lowered
(``xla_tpu_scoped_vmem_limit_kib``) instead of the blocks being made huge.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from autotune.failures import (
    Status,
    classify_compile_error,
    physical_vmem_use,
    scoped_vmem_allocation,
)
from autotune.precheck import Agreement, PrecheckResult, candidates, precheck, vmem_limited
from kernel import FlashConfig, Problem, get_kernel, get_target
from kernel.aot import compile_for_target
from kernel.backends.flash.config import DKV_FIELDS, DQ_FIELDS
from kernel.backends.flash.rules import fp32_dot_bytes, vmem_estimate, vmem_violations

FLASH = get_kernel("flash").discover()

TARGETS = ["v5e", "v6e"]
SMALL = Problem(batch=1, q_heads=2, kv_heads=1, q_len=512, kv_len=512, head_dim=128,
                dtype="bfloat16", causal=True, mode="fwd")
TINY = Problem(**{**SMALL.to_dict(), "q_len": 256, "kv_len": 256})  # 12 forward configs
BIG_BLOCKS = FlashConfig(block_q=512, block_kv=512, block_kv_compute=512)
# A limit far below the footprint of BIG_BLOCKS (several MiB), so its compile fails at once.
LOW_LIMIT_KIB = 256
FIELDS = {"config", "status", "compile_s", "predicted_fit", "error"}


def test_classify_compile_error_reads_both_vmem_messages():
    scoped = ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\nRan out of memory in "
              "memory space vmem while allocating on stack for %flash_fwd.1 = ... Scoped "
              "allocation with size 18.02M and limit 16.00M exceeded scoped vmem limit by 2.02M.")
    physical = "Ran out of memory in memory space vmem. Used 275.35M of 128.00M vmem"
    assert classify_compile_error(scoped) == Status.VMEM_OOM
    assert classify_compile_error(physical) == Status.VMEM_OOM
    assert classify_compile_error("INVALID_ARGUMENT: Mosaic failed to compile TPU kernel: "
                                  "unsupported shape") == Status.COMPILE_ERROR
    assert classify_compile_error("RESOURCE_EXHAUSTED: out of HBM memory") \
        == Status.COMPILE_ERROR


def test_scoped_vmem_allocation_reads_the_kernel_and_its_bytes():
    message = ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\nRan out of memory in "
               "memory space vmem while allocating on stack for %splash_mha_fwd_no_residuals.1 "
               "= (f32[1024,128]{1,0:T(8,128)}) custom-call(%copy-done.3), ... Scoped "
               "allocation with size 16.54M and limit 16.00M exceeded scoped vmem limit by 552K.")
    assert scoped_vmem_allocation(message) == ("splash_mha_fwd_no_residuals.1",
                                               round(16.54 * 1024**2))
    assert scoped_vmem_allocation("Ran out of memory in memory space vmem. Used 275.35M of "
                                  "128.00M vmem") is None


def test_physical_vmem_use_reads_what_the_whole_program_needed():
    """v4's compiler reports the program against the chip's VMEM, not a scoped allocation."""
    message = ("RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem. Used 19.35M of "
               "16.00M vmem. Exceeded vmem capacity by 3.35M.")
    assert physical_vmem_use(message) == round(19.35 * 1024**2)
    assert scoped_vmem_allocation(message) is None
    assert physical_vmem_use("... Scoped allocation with size 16.54M and limit 16.00M") is None


@pytest.mark.parametrize("target", TARGETS)
def test_default_config_compiles_for_target(target):
    problem = Problem(**{**TINY.to_dict(), "mode": "fwd_bwd"})
    config = FLASH.default_config(problem, target)
    assert not vmem_violations(problem, config, get_target(target))
    assert compile_for_target(FLASH, problem, config, target) > 0


@pytest.mark.parametrize("target", TARGETS)
def test_config_over_the_scoped_limit_is_classified_vmem_oom(target):
    limited = vmem_limited(get_target(target), LOW_LIMIT_KIB * 1024)
    assert vmem_violations(SMALL, BIG_BLOCKS, limited)  # the estimate agrees
    with pytest.raises(Exception) as raised:
        compile_for_target(FLASH, SMALL, BIG_BLOCKS, target,
                           {"xla_tpu_scoped_vmem_limit_kib": LOW_LIMIT_KIB})
    assert classify_compile_error(str(raised.value)) == Status.VMEM_OOM, str(raised.value)
    # ... while the same config compiles under the target's own limit.
    assert not vmem_violations(SMALL, BIG_BLOCKS, get_target(target))
    assert compile_for_target(FLASH, SMALL, BIG_BLOCKS, target) > 0


def test_fwd_bwd_forward_variants_compile_the_forward_kernel_alone():
    problem = Problem(**{**TINY.to_dict(), "mode": "fwd_bwd"})
    base = FLASH.default_config(problem, "v5e")
    todo = candidates(problem, get_target("v5e"), FLASH, include_rejected=True)
    for candidate in todo:  # backward variants and the default compile the whole gradient
        backward_at_default = all(getattr(candidate.config, f) == getattr(base, f)
                                  for f in DKV_FIELDS + DQ_FIELDS)
        assert candidate.forward_only == (backward_at_default and candidate.config != base)
    forward_variant = next(c.config for c in todo if c.forward_only)
    assert compile_for_target(FLASH, problem, forward_variant, "v5e", forward_only=True) > 0


# A large block_q x head_dim: the forward step's f32 P @ V product, as large as the accumulator,
# spills to VMEM like the logits. An estimate counting only the logits' spill admitted both,
# and the compiler needed 16.80 and 17.08 MiB of v5e's 16 MiB.
@pytest.mark.parametrize("problem, config", [
    (Problem(1, 4, 1, 4096, 4096, 256, "bfloat16", True, "fwd"),
     FlashConfig(block_q=2048, block_kv=2048, block_kv_compute=256, pipeline_depth=3)),
    (Problem(1, 2, 1, 4096, 1024, 512, "bfloat16", False, "fwd"),
     FlashConfig(block_q=2048, block_kv=128, block_kv_compute=128, pipeline_depth=4)),
], ids=["d256-q2048-kv2048/256", "d512-q2048-kv128/128"])
def test_estimate_rejects_a_large_block_q_x_head_dim_that_overflows(problem, config):
    try:
        compile_for_target(FLASH, problem, config, "v5e")
    except Exception as error:  # then the estimate must have said so
        assert classify_compile_error(str(error)) == Status.VMEM_OOM, str(error)
        assert vmem_violations(problem, config, get_target("v5e")), (
            f"{config.label()}: admitted (estimate {vmem_estimate(problem, config)}), yet "
            "the compiler ran out of VMEM")


def _smallest_estimate_kib(problem: Problem) -> int:
    """The smallest estimated footprint (KiB) in the problem's space: used as the scoped limit,
    the estimate admits at least that config, and the largest configs (which need more than
    that) overflow."""
    return min(max(vmem_estimate(problem, c.config).values())
               for c in candidates(problem, get_target("v5e"), FLASH,
                                   include_rejected=True)) // 1024


@pytest.fixture(scope="module")
def cli_sweep() -> tuple[list[dict], dict, int]:
    """``autotune precheck --json --include-rejected`` on a tiny problem, under a lowered
    limit: (per-config objects, summary object, number of candidates)."""
    limit_kib = _smallest_estimate_kib(TINY)
    done = run_cli("precheck", "--target", "v5e", "--q-len", str(TINY.q_len), "--q-heads",
                   str(TINY.q_heads), "--kv-heads", str(TINY.kv_heads), "--head-dim",
                   str(TINY.head_dim), "--causal", "--json", "--jobs", "2",
                   "--include-rejected", "--vmem-limit-kib", str(limit_kib), "--timeout", "120",
                   timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    expected = len(candidates(TINY, vmem_limited(get_target("v5e"), limit_kib * 1024), FLASH,
                              include_rejected=True))
    return lines[:-1], lines[-1], expected


def test_cli_prints_one_object_per_config_then_a_summary(cli_sweep):
    rows, summary, expected = cli_sweep
    assert len(rows) == expected
    assert len({json.dumps(r["config"], sort_keys=True) for r in rows}) == expected
    for row in rows:
        assert set(row) == FIELDS
        FlashConfig.from_dict(row["config"])
        assert row["status"] in {s.value for s in Status}
        assert row["compile_s"] >= 0 and isinstance(row["predicted_fit"], bool)
        assert (row["error"] is None) == (row["status"] == "ok")
    assert summary["summary"] is True
    assert sum(summary["counts"].values()) == expected
    assert summary["admitted"] == sum(r["predicted_fit"] for r in rows)
    assert summary["compiled"] == sum(r["status"] == "ok" for r in rows)


def test_estimate_agrees_with_the_compiler_on_the_small_problem(cli_sweep):
    rows, summary, _ = cli_sweep
    statuses = {r["status"] for r in rows}
    assert {"ok", "vmem_oom"} <= statuses, statuses  # the limit splits the space
    assert statuses <= {"ok", "vmem_oom"}, [r for r in rows if r["status"] not in
                                            ("ok", "vmem_oom")]
    for row in rows:
        if row["predicted_fit"]:  # never admit a config that overflows
            assert row["status"] == "ok", row
        if row["status"] == "vmem_oom":
            assert not row["predicted_fit"], row
    assert summary["precision"] == 1.0
    assert summary["recall"] == summary["admitted_and_compiled"] / summary["compiled"] > 0


@pytest.mark.parametrize("target", ["cpu", "v9x"])
def test_cli_refuses_a_target_that_is_not_a_tpu_generation(target):
    done = run_cli("precheck", "--target", target, "--q-len", "256", "--json")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr + done.stdout
    message = " ".join(done.stderr.replace("│", " ").split())  # unwrap rich's error panel
    assert f"'{target}' is not a TPU generation; use v4, v5e, v5p or v6e" in message, message


def test_compile_over_the_timeout_is_classified_timeout_and_the_sweep_finishes():
    """Also: ``sample_every`` compiles every n-th candidate (here the 1st and 3rd of 4)."""
    problem = Problem(batch=1, q_heads=1, kv_heads=1, q_len=128, kv_len=128, head_dim=128)
    todo = candidates(problem, get_target("v5e"), FLASH)[::2]
    assert len(todo) >= 2  # one worker is killed and replaced for the second candidate
    seen: list[PrecheckResult] = []
    results = precheck(problem, get_target("v5e"), FLASH, jobs=1, timeout_s=0.001,
                       on_result=seen.append, sample_every=2)
    assert [r.config for r in results] == [c.config for c in todo]
    assert seen and len(seen) == len(results)
    for result in results:
        assert result.status == Status.TIMEOUT and result.compile_s > 0.001
        assert "0.001 s" in result.error
    assert Agreement.of(results).counts == {Status.TIMEOUT: len(todo)}


def test_cli_refuses_a_problem_the_kernel_cannot_run():
    done = run_cli("precheck", "--kernel", "jax_tpu_flash", "--q-len", "100", "--json")
    assert done.returncode == 2 and "Traceback" not in done.stderr + done.stdout
    message = " ".join(done.stderr.replace("│", " ").split())
    assert "kv_len=100 is not a multiple of 128" in message, message


def test_cli_in_fwd_mode_labels_forward_fields_without_libtpu_s_start_up_noise():
    """Issue 62 item 12: in fwd mode the table labelled each config with the backward blocks
    it never compiles, and every compiler process's libtpu start-up wrote ``E0000 ...
    INVALID_ARGUMENT`` and its source location trace to stderr; redirected, the lines were
    cut at 80 columns."""
    problem = Problem(batch=1, q_heads=1, kv_heads=1, q_len=128, kv_len=128, head_dim=128,
                      mode="fwd")
    done = run_cli("precheck", "--target", "v5e", "--q-len", "128", "--q-heads", "1",
                   "--kv-heads", "1", "--head-dim", "128", "--mode", "fwd", "--jobs", "2",
                   timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for noise in ("E0000", "INVALID_ARGUMENT", "Source Location Trace", "libtpu_init_utils",
                  "Failed to find host bounds"):
        assert noise not in done.stderr, done.stderr
    rows = [line.split("│")[1].strip() for line in done.stdout.splitlines()
            if line.startswith("│")]
    labels = [c.config.label("fwd") for c in candidates(problem, get_target("v5e"), FLASH)]
    assert sorted(rows) == sorted(labels) and not any("dkv" in row for row in rows)
    assert any(line.startswith("estimate admits") and line.endswith("(recall 100.0%)")
               for line in done.stdout.splitlines()), done.stdout


# The backward kernels keep lse and delta as (1, block_q) f32 rows, (8, block_q) in VMEM. An
# estimate counting them as lane-padded (block_q, 128) columns, one per ring buffer, rejected
# these (16.25 MiB estimated each), which compile on v5e's 16 MiB: dQ's two row windows,
# dK/dV's ring of rows at depth 3.
@pytest.mark.parametrize("config", [
    FlashConfig(block_q=512, block_kv=512, block_kv_compute=512, block_q_dq=1024,
                block_kv_dq=1024),
    FlashConfig(block_q=512, block_kv=512, block_kv_compute=512, block_q_dkv=2048,
                block_kv_dkv=256, pipeline_depth_dkv=3),
], ids=["dq-1024x1024", "dkv-2048x256-depth3"])
def test_estimate_counts_the_backward_statistics_as_rows(config):
    problem = Problem(1, 1, 1, 2048, 2048, 256, "bfloat16", True, "fwd_bwd")
    assert not vmem_violations(problem, config, get_target("v5e")), vmem_estimate(problem, config)
    assert compile_for_target(FLASH, problem, config, "v5e") > 0


def test_estimate_counts_the_statistics_columns_dkv_broadcasts():
    """... but dK/dV broadcasts them along the keys as (block_q, 1) f32 columns, lane padded,
    which stay in VMEM: with 4096 queries a step, 4 MiB. Counting the rows alone admitted this
    config (14.0 MiB), and the compiler needed 17.90."""
    problem = Problem(1, 1, 1, 4096, 4096, 256, "bfloat16", True, "fwd_bwd")
    config = FlashConfig(block_q=512, block_kv=512, block_kv_compute=512, block_q_dkv=4096,
                         block_kv_dkv=128)
    with pytest.raises(Exception) as raised:
        compile_for_target(FLASH, problem, config, "v5e")
    assert classify_compile_error(str(raised.value)) == Status.VMEM_OOM, str(raised.value)
    assert vmem_violations(problem, config, get_target("v5e"))


def test_float32_estimate_counts_its_fp32_precision_dots():
    """Issue 74: float32 dots run at fp32 contract precision (``Precision.HIGHEST``; Mosaic's
    default rounds f32 operands to bf16), several MXU passes over bf16 parts of each operand. Here
    (d256, dK/dV 2048x256 depth 1) dK/dV allocated 27.83 MiB, against 13.91 at the default
    precision: the estimate without its float32 term (15.38 MiB, which counts the column of 1 / l
    that float32's m and 1 / l add) no longer bounds it; with it (30.38) it does."""
    problem = Problem(1, 1, 1, 2048, 2048, 256, "float32", True, "fwd_bwd")
    config = FlashConfig(block_q=512, block_kv=512, block_kv_compute=512, block_q_dkv=2048,
                         block_kv_dkv=256, pipeline_depth_dkv=1)
    estimate = vmem_estimate(problem, config)["dkv"]
    without = estimate - fp32_dot_bytes(problem, "dkv", config.block_q_dkv, config.block_kv_dkv)
    assert compile_for_target(FLASH, problem, config, "v5e",
                              {"xla_tpu_scoped_vmem_limit_kib": estimate // 1024}) > 0
    with pytest.raises(Exception) as raised:
        compile_for_target(FLASH, problem, config, "v5e",
                           {"xla_tpu_scoped_vmem_limit_kib": without // 1024})
    assert classify_compile_error(str(raised.value)) == Status.VMEM_OOM, str(raised.value)


BENCH = Path(__file__).parent.parent / "bench/kernels"
FLASH_VMEM = BENCH / "data/flash_vmem"


def test_float32_estimate_bounds_every_measured_allocation():
    """Issue 74, with no compile: the float32 allocations measured deviceless (v5e), each kernel
    alone (``flash_vmem_sizes.py``: 108 points, d 64-256) and whole sampled configs
    (``vmem_sizes.py --dtype float32``: three sweeps, estimate-rejected configs included), are
    within the estimate: no sampled config the compiler refuses is admitted."""
    alone = subprocess.run([sys.executable, str(BENCH / "flash_vmem_sizes.py"), "--rescore",
                            str(FLASH_VMEM / "v5e_float32.jsonl")], capture_output=True, text=True)
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    assert len(re.findall(r"^\w+: \d+ points", alone.stdout, re.M)) == 3, alone.stdout
    sweeps = sorted(FLASH_VMEM.glob("v5e_float32_*_sweep.jsonl"))
    out = subprocess.run([sys.executable, str(BENCH / "vmem_sizes.py"), "--kernel", "flash",
                          "--rescore", *map(str, sweeps)], capture_output=True, text=True,
                         check=True)
    precisions = re.findall(r"float32: .* precision (\S+),", out.stdout)
    assert len(precisions) == len(sweeps) == 3 and set(precisions) == {"1.0"}, out.stdout
