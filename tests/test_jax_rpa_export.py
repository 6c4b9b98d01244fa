"""``autotune export --format jax-rpa`` (docs/serving.md): JAX's TUNED_BLOCK_SIZES from the tuned
serving configs, as a user runs it. The round trip: a store of serving entries exported, the
module imported from its file, each key mapping to its config under the full device kind (and
JAX's two-word key), each key what JAX's own ``simplify_key`` makes of the problem's raw key;
what JAX's table cannot hold is left out saying why."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

from autotune.jax_rpa import raw_key
from conftest import run_cli
from kernel import ServingProblem
from kernel.backends.rpa import RpaConfig
from storage import Store, TunedResult

DEVICE = "TPU v5 lite"
LLAMA = ServingProblem(32, 8, 128, page_size=16, pages_per_seq=128, max_num_batched_tokens=512,
                       max_num_seqs=64)
QWEN = ServingProblem(28, 4, 128, page_size=32, pages_per_seq=64, max_num_batched_tokens=2048,
                      max_num_seqs=128)  # JAX simplifies its 28 query heads per block to 32


def _publish(url: str, problem: ServingProblem, config: RpaConfig) -> None:
    with Store(url) as store:
        store.publish(TunedResult(device_kind=DEVICE, problem=problem, config=config,
                                  median_ms=1.0, kernel="rpa", trials=4, method="device"))


def _module(path: Path):
    spec = importlib.util.spec_from_file_location("tuned_block_sizes_v5e", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_export_round_trips_through_jaxs_own_keys(sqlite_db_url: str, tmp_path: Path):
    tuned = {LLAMA: RpaConfig(8, 32), QWEN: RpaConfig(16, 64)}
    for problem, config in tuned.items():
        _publish(sqlite_db_url, problem, config)
    _publish(sqlite_db_url, dataclasses.replace(LLAMA, max_num_seqs=32),  # JAX's key: LLAMA's
             RpaConfig(4, 16))
    _publish(sqlite_db_url, dataclasses.replace(LLAMA, page_size=32, pages_per_seq=64),
             RpaConfig(4, 32, vmem_limit_mib=32))  # a VMEM limit JAX's table cannot carry
    out = tmp_path / "tuned_block_sizes_v5e.py"
    done = run_cli("export", "--format", "jax-rpa", "--jax-device-key", "-o", str(out),
                   "--db", sqlite_db_url)
    assert done.returncode == 0, done.stderr
    assert "needs a VMEM limit" in done.stderr and "is h32/8" in done.stderr
    table = _module(out).TUNED_BLOCK_SIZES
    assert set(table) == {DEVICE, "TPU v5"} and table[DEVICE] == table["TPU v5"]
    expected = {tuned_block_sizes.simplify_key(raw_key(problem)): (
        config.num_kv_pages_per_block, config.num_queries_per_block)
        for problem, config in tuned.items()}
    assert table[DEVICE] == expected
    assert any(key[2] == 32 and key[3] == 4 for key in expected)  # Qwen's, as JAX looks it up
    written = json.loads(out.with_suffix(".json").read_text())
    assert {tuple(item["key"]): tuple(item["value"]) for item in written[DEVICE]} == expected


def test_without_serving_configs_the_export_says_so(sqlite_db_url: str, tmp_path: Path):
    done = run_cli("export", "--format", "jax-rpa", "-o", str(tmp_path / "t.py"),
                   "--device-kind", DEVICE, "--db", sqlite_db_url)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "no tuned 'rpa' config on 'TPU v5 lite'" in done.stderr
    bad = run_cli("export", "--format", "jax-rpa", "-o", str(tmp_path / "t.json"),
                  "--db", sqlite_db_url)
    assert bad.returncode == 2 and "give the Python module to write" in bad.stderr
