"""Replay of measured tuning landscapes (gzip JSON, format in bench/landscapes/README.md).

A landscape answers "what would this config have measured" instantly, so a search strategy can
be tested and benchmarked without an accelerator: its space is the declared ``params`` with
"has a record" as the legality rule, and its measure function returns the recorded time or
failure status (with the recorded ``compile_s`` / ``benchmark_s`` as attrs).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.searchspace import Config, Key, Space
from autotune.trials import OK, Measurement
from kernel import AutotuneError


class LandscapeError(AutotuneError):
    """A landscape file is missing or malformed; the message names the file and the problem."""


@dataclass(frozen=True)
class Landscape:
    name: str
    params: dict[str, list[Any]]
    records: dict[Key, dict[str, Any]]  # config key (params order) -> record

    @property
    def space(self) -> Space:
        return Space(self.params, lambda config: self.key(config) in self.records)

    def key(self, config: Config) -> Key:
        return tuple(config[name] for name in self.params)

    @property
    def optimum_ms(self) -> float:
        return min(r["time_ms"] for r in self.records.values() if r["status"] == OK)

    def measure(self, config: Config) -> Measurement:
        """The recorded outcome of ``config`` (which must be legal: have a record)."""
        record = self.records.get(self.key(config))
        if record is None:
            raise LandscapeError(f"{self.name}: config {config} has no record (illegal); the "
                                 "searcher must never measure it")
        attrs = {k: record[k] for k in ("compile_s", "benchmark_s") if record.get(k) is not None}
        if record["status"] == OK:
            return Measurement(float(record["time_ms"]), OK, attrs)
        return Measurement(None, record["status"], attrs)

    def score(self, best_ms: float | None) -> float:
        """optimum / best found (1.0 = found the optimum; 0.0 = found nothing)."""
        return 0.0 if best_ms is None else self.optimum_ms / best_ms


def load_landscape(path: str | Path) -> Landscape:
    path = Path(path)
    try:
        with gzip.open(path, "rt") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise LandscapeError(f"landscape file {path} does not exist; pass the path of a "
                             "*.json.gz landscape (see bench/landscapes/README.md)") from None
    except (OSError, json.JSONDecodeError, EOFError) as exc:
        raise LandscapeError(f"{path} is not gzip-compressed JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("params"), dict) or not isinstance(
            doc.get("records"), list):
        raise LandscapeError(f"{path}: expected an object with 'params' (object) and 'records' "
                             "(list)")
    params = {name: list(values) for name, values in doc["params"].items()}
    records: dict[Key, dict[str, Any]] = {}
    for i, record in enumerate(doc["records"]):
        config = record.get("config") if isinstance(record, dict) else None
        if not isinstance(config, dict) or any(n not in config for n in params):
            raise LandscapeError(f"{path}: record {i} lacks a config with every parameter "
                                 f"{list(params)}")
        bad = [n for n in params if config[n] not in params[n]]
        if bad:
            raise LandscapeError(f"{path}: record {i} has undeclared value(s) for {bad}")
        status = record.get("status")
        if status == OK and not isinstance(record.get("time_ms"), int | float):
            raise LandscapeError(f"{path}: record {i} is ok but has no numeric time_ms")
        if not isinstance(status, str):
            raise LandscapeError(f"{path}: record {i} has no status")
        records[tuple(config[n] for n in params)] = record
    if not any(r["status"] == OK for r in records.values()):
        raise LandscapeError(f"{path}: no record has status 'ok'")
    return Landscape(str(doc.get("name") or path.name.removesuffix(".json.gz")), params, records)
