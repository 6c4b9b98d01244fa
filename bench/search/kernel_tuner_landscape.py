"""A Kernel Tuner brute-force cache file written as a landscape
(bench/search/landscapes/README.md), so any published Kernel Tuner cache can be replayed by
``autotune replay`` and ``bench/search/replay.py``: landscapes the searcher was never developed
on, to check that it generalises.

The six files in bench/search/landscapes came from AutoTuningAssociation/benchmark_hub this way. A
cache entry's ``time`` (ms) becomes ``time_ms``; ``RuntimeFailedConfig`` and
``CompilationFailedConfig`` become ``runtime_error`` and ``compile_error`` records (legal, they
cost a measurement); ``InvalidConfig`` (the kernel's restrictions or launch limits refused it)
gets no record, so it is illegal. ``compile_time`` and ``benchmark_time`` (ms) become
``compile_s`` and ``benchmark_s``.

    python bench/search/kernel_tuner_landscape.py CACHE.json[.gz] -o NAME.json.gz [--name NAME] \
        [--device D]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

from autotune.landscape import load_landscape, save_landscape

CACHE_KEYS = ("tune_params", "cache", "kernel_name", "device_name", "problem_size")
FAILURES = {"RuntimeFailedConfig": "runtime_error", "CompilationFailedConfig": "compile_error"}
SOURCE = "AutoTuningAssociation/benchmark_hub (Kernel Tuner brute-force cache), converted"


def landscape_document(cache: dict[str, Any], name: str, device: str | None = None
                       ) -> dict[str, Any]:
    """The landscape of a Kernel Tuner cache document (``tune_params``, ``cache``, ...);
    ``device`` names the device where the cache's ``device_name`` is empty. A document that is
    not such a cache is a ValueError that says what it lacks."""
    missing = [k for k in CACHE_KEYS if k not in cache] if isinstance(cache, dict) else CACHE_KEYS
    if missing:
        raise ValueError(f"{name}: not a Kernel Tuner cache file: it lacks {', '.join(missing)}")
    names = list(cache["tune_params"])
    records = []
    for entry in cache["cache"].values():
        time = entry.get("time")
        if time is None or any(n not in entry for n in names):
            raise ValueError(f"{name}: a cache entry lacks its time or a parameter: {entry}")
        if time == "InvalidConfig":
            continue
        if isinstance(time, str) and time not in FAILURES:
            raise ValueError(f"{name}: unknown cache time {time!r}; expected a number, "
                             f"InvalidConfig or one of {sorted(FAILURES)}")
        ok = not isinstance(time, str)
        records.append({
            "config": {n: entry[n] for n in names},
            "status": "ok" if ok else FAILURES[time],
            "time_ms": float(time) if ok else None,
            "compile_s": _seconds(entry.get("compile_time")),
            "benchmark_s": _seconds(entry.get("benchmark_time")),
        })
    return {"name": name, "source": SOURCE, "kernel": cache["kernel_name"],
            "device": cache["device_name"] or device or "", "problem_size": cache["problem_size"],
            "objective": "time_ms, lower is better", "params": cache["tune_params"],
            "records": records}


def _seconds(ms: Any) -> float | None:
    return None if not isinstance(ms, int | float) else round(ms / 1000, 6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache", type=Path, help="a Kernel Tuner cache file (.json or .json.gz)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="NAME.json.gz")
    parser.add_argument("--name", help="the landscape's name (default: the output's stem)")
    parser.add_argument("--device", help="the device, where the cache does not name it")
    args = parser.parse_args()
    if not args.output.name.endswith(".json.gz"):
        sys.exit(f"error: the output {args.output} must end in .json.gz")
    name = args.name or args.output.name.removesuffix(".json.gz")
    try:  # nothing is written unless the whole cache converts
        raw = args.cache.read_bytes()
        cache = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
        document = landscape_document(cache, name, args.device)
    except json.JSONDecodeError as exc:
        sys.exit(f"error: {args.cache}: not a JSON file ({exc})")
    except (OSError, EOFError, ValueError) as exc:  # unreadable or truncated; not a cache
        sys.exit(f"error: {args.cache}: {exc}")
    save_landscape(document, args.output)
    land = load_landscape(args.output)  # the file must replay
    print(f"{args.output}: {len(land.records)} legal configs, optimum {land.optimum_ms:.4g} ms")


if __name__ == "__main__":
    main()
