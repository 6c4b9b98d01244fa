"""Every registered kernel through the tuner, storage and service, on this machine's CPU.

``autotune tune --kernel NAME --json`` tunes a tiny problem with ``jax_tpu_flash``, with
``pallas_gpu`` and with ``splash`` (Pallas interpret mode) into one database; the real service then answers each
kernel's lookup with that kernel's own winner, and nothing for ``flash``, which was not tuned.
Storage keeps the kernel name apart for the same problem and device, exact and nearest alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from autotune.tune import study_name
from conftest import problem_flags, run_cli
from kernel import FlashConfig
from kernel.problem import Problem
from kernel.registry import get_kernel
from present.plots import landscape_figure
from present.studies import StudyData
from storage import ResultError, Store, TunedResult
from storage.studies import get_storage

# Tiny f32 problems, one head: a few seconds per interpreted compile.
PROBLEMS = {
    "jax_tpu_flash": Problem(batch=1, q_heads=1, kv_heads=1, q_len=256, kv_len=256,
                             head_dim=64, dtype="float32", causal=False, mode="fwd"),
    "pallas_gpu": Problem(batch=1, q_heads=1, kv_heads=1, q_len=128, kv_len=128, head_dim=64,
                          dtype="float32", causal=True, mode="fwd"),
    # fwd_bwd: a flag (use_fused_bwd_kernel, the landscape's panel), layouts and null dQ
    # blocks through the study, storage, the service and the report
    "splash": Problem(batch=1, q_heads=1, kv_heads=1, q_len=256, kv_len=256, head_dim=64,
                      dtype="float32", causal=True, mode="fwd_bwd"),
}


def lookup_params(kernel: str, problem: Problem) -> dict[str, Any]:
    fields = {name: value for name, value in problem.to_dict().items() if value is not None}
    return {"kernel": kernel, "device_kind": "cpu", **fields,
            "causal": str(fields["causal"]).lower()}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """A SQLite database where ``autotune tune`` tuned each problem of PROBLEMS with its
    kernel, and each kernel's winner."""
    db = f"sqlite:///{tmp_path_factory.mktemp('kernels') / 'kernels.db'}"
    summaries = {}
    for name, problem in PROBLEMS.items():
        done = run_cli("tune", "--kernel", name, *problem_flags(problem), "--trials", "2",
                       "--db", db, "--json", timeout=300)
        assert done.returncode == 0, done.stderr
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        trials = [line for line in lines if not line.get("summary")]
        [summary] = [line for line in lines if line.get("summary")]
        kernel = get_kernel(name)
        assert len(trials) == 2 and all(t["status"] == "ok" for t in trials), trials
        assert (summary["kernel"], summary["method"]) == (name, "interpret")
        assert summary["study"] == study_name(problem, "cpu", kernel, "wallclock")
        best = kernel.config_from_dict(summary["best_config"])
        assert kernel.is_legal(problem, best)
        summaries[name] = best
    return db, summaries


def test_tune_each_kernel_and_look_it_up_under_its_own_name(
        tuned: tuple[str, dict[str, Any]], start_server: Any) -> None:
    db, summaries = tuned
    server = start_server(db)
    for name, problem in PROBLEMS.items():
        found = httpx.get(f"{server.url}/v1/configs/lookup", params=lookup_params(name, problem))
        assert found.status_code == 200, found.text
        body = found.json()
        assert body["match"] == "exact" and body["key"]["kernel"] == name
        assert body["key"]["kernel_version"] == get_kernel(name).version
        assert get_kernel(name).config_from_dict(body["config"]) == summaries[name]
        # Nothing was tuned under our own kernel: the other kernels' entries are not its.
        missing = httpx.get(f"{server.url}/v1/configs/lookup",
                            params=lookup_params("flash", problem))
        assert missing.status_code == 404, missing.text
    unknown = httpx.get(f"{server.url}/v1/configs/lookup",
                        params=lookup_params("nope", PROBLEMS["pallas_gpu"]))
    assert unknown.status_code == 422
    assert "'nope'" in unknown.text and "jax_tpu_flash" in unknown.text


def test_report_draws_each_kernel_landscape_on_that_kernel_axes(
        tuned: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    """The landscape's axes and panels are the fields each kernel declares, not FlashConfig's,
    in the figure and in the report's text."""
    db, _ = tuned
    storage = get_storage(db, create=False)
    for name, problem in PROBLEMS.items():
        x, y, panel = get_kernel(name).landscape_axes
        data = StudyData.load(storage, study_name(problem, "cpu", get_kernel(name), "wallclock"))
        assert data is not None and data.kernel == name
        figure = landscape_figure(data)
        panels = [ax for ax in figure.axes if ax.get_title()]
        assert [ax.get_title() for ax in panels] == [f"{panel}={v}" for v in data.space[panel]]
        assert {(ax.get_xlabel(), ax.get_ylabel()) for ax in panels} == {(x, y)}
        measured = {(p.params[x], p.params[y], p.params[panel]) for p in data.points}
        assert sum(len(ax.texts) for ax in panels) == len(measured)
    report = tmp_path / "report.html"
    done = run_cli("report", "--db", db, "-o", str(report))
    assert done.returncode == 0, done.stderr
    html = report.read_text()
    text = " ".join(html.split())
    for name in PROBLEMS:
        x, y, panel = get_kernel(name).landscape_axes
        assert f"Best search time per {x} × {y} cell (over the other fields), one panel per " \
               f"{panel};" in text
    assert html.count('data-plot="landscape"') == len(PROBLEMS)


def test_an_unknown_kernel_or_device_is_refused_before_anything_is_written(
        tmp_path: Path) -> None:
    db = tmp_path / "refused.db"
    flags = problem_flags(PROBLEMS["pallas_gpu"])
    unknown = run_cli("tune", "--kernel", "nope", *flags, "--db", f"sqlite:///{db}",
                      env={"COLUMNS": "400"})
    assert unknown.returncode == 2
    assert "unknown kernel 'nope'; choose one of flash, jax_tpu_flash, pallas_gpu" in (
        unknown.stderr)
    assert not db.exists()


def test_stored_entries_and_lookups_keep_the_kernel_name_apart(sqlite_db_url: str) -> None:
    problem = PROBLEMS["jax_tpu_flash"]
    wider = Problem(**{**problem.to_dict(), "q_len": 512, "kv_len": 512})
    flash = get_kernel("flash").default_config(problem)
    tpu = get_kernel("jax_tpu_flash").default_config(problem).replace(block_q=256)
    store = Store(sqlite_db_url)
    try:
        store.publish(TunedResult(kernel="flash", device_kind="cpu", problem=problem,
                                  config=flash, median_ms=2.0))
        store.publish(TunedResult(kernel="jax_tpu_flash", device_kind="cpu", problem=problem,
                                  config=tpu, median_ms=1.0))
        for kernel, config in (("flash", flash), ("jax_tpu_flash", tpu)):
            for asked, match in ((problem, "exact"), (wider, "nearest")):
                entry, found = store.lookup(kernel, "cpu", asked)
                assert (entry.result.kernel, entry.result.config, found) == (
                    kernel, config, match)
                assert entry.result.kernel_version == get_kernel(kernel).version
        assert store.lookup("pallas_gpu", "cpu", problem) is None
        with pytest.raises(ResultError, match="must be a JaxTpuFlashConfig"):
            TunedResult(kernel="jax_tpu_flash", device_kind="cpu", problem=problem,
                        config=FlashConfig(), median_ms=1.0)
    finally:
        store.close()


def test_precheck_compiles_the_jax_tpu_flash_space_for_v5e() -> None:
    """Deviceless: the upstream TPU kernel's whole space for a tiny problem, compiled by the
    real Mosaic compiler for v5e; the VMEM rule admits what compiles."""
    from autotune.precheck import candidates
    from kernel import get_target

    problem = Problem(batch=1, q_heads=1, kv_heads=1, q_len=256, kv_len=256, head_dim=128,
                      dtype="bfloat16", causal=False, mode="fwd")
    kernel = get_kernel("jax_tpu_flash")
    done = run_cli("precheck", "--kernel", "jax_tpu_flash", "--target", "v5e",
                   *problem_flags(problem), "--json", "--jobs", "2", "--timeout", "120",
                   timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    *rows, summary = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    expected = candidates(problem, get_target("v5e"), kernel)
    compiled = [kernel.config_from_dict(r["config"]) for r in rows]  # in completion order
    assert len(compiled) == len(set(compiled)) == len(kernel.search_space(problem, "v5e")) > 1
    assert set(compiled) == {c.config for c in expected}
    assert all(r["status"] == "ok" and r["predicted_fit"] for r in rows), rows
    assert summary["precision"] == 1.0


def test_precheck_refuses_what_a_kernel_cannot_check() -> None:
    done = run_cli("precheck", "--kernel", "pallas_gpu", "--target", "v5e", "--q-len", "256",
                   env={"COLUMNS": "400"})
    assert done.returncode == 2
    assert "kernel 'pallas_gpu' has no target 'v5e'; choose one of gpu, cpu" in done.stderr



def test_a_lowered_vmem_limit_applies_to_every_kernel_s_rules() -> None:
    """``--vmem-limit-kib`` lowers the target's scoped limit, which every kernel's VMEM rule
    reads: fewer configs are predicted to fit."""
    from autotune.precheck import candidates, vmem_limited
    from kernel import get_target

    problem = Problem(batch=1, q_heads=1, kv_heads=1, q_len=1024, kv_len=1024, head_dim=128,
                      dtype="bfloat16", causal=False, mode="fwd")
    for name in ("flash", "jax_tpu_flash"):
        kernel = get_kernel(name)
        full = candidates(problem, get_target("v5e"), kernel, include_rejected=True)
        low = candidates(problem, vmem_limited(get_target("v5e"), 2 << 20), kernel,
                         include_rejected=True)
        assert 0 < sum(c.predicted_fit for c in low) < sum(c.predicted_fit for c in full)


def test_tune_refuses_a_length_no_block_can_tile(tmp_path: Path) -> None:
    done = run_cli("tune", "--kernel", "flash", "--batch", "1", "--q-heads", "2", "--q-len",
                   "5000", "--head-dim",
                   "64", "--trials", "2", "--db", f"sqlite:///{tmp_path / 'x.db'}",
                   env={"COLUMNS": "400"})
    assert done.returncode == 2, done.stderr
    assert "[seq_len] q_len=5000 admits no legal block" in done.stderr
    assert "pad it to 5120" in done.stderr and "Traceback" not in done.stderr
