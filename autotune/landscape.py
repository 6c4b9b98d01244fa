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

    def best_configs(self, k: int) -> list[Config]:
        """The ``k`` fastest recorded configs, fastest first."""
        ok = sorted((r["time_ms"], key) for key, r in self.records.items() if r["status"] == OK)
        return [dict(zip(self.params, key, strict=True)) for _, key in ok[:k]]

    def warm_seeds(self, other: Landscape, k: int) -> list[Config]:
        """``k`` of the fastest configs of ``other`` (a neighbouring problem already tuned) that
        are legal here, fastest first, skipping any one step (:meth:`Space.neighbours`) from a
        seed already taken: what ``tune`` seeds with, the winners of the nearest tuned problems.

        A landscape's fastest configs are mostly one basin, a flag or a size apart, and they
        transfer to another device together or not at all (convolution: on each other device,
        the three fastest of one device score within 0.05 of each other). Seeds apart are
        distinct bets: A4000's three fastest score 0.20, 0.17 and 0.19 on W6600, the three
        taken here 0.20, 0.17 and 0.82."""
        if list(other.params) != list(self.params):
            raise LandscapeError(f"{other.name} has parameters {list(other.params)}, {self.name} "
                                 f"has {list(self.params)}: warm-start from a landscape of the "
                                 "same kernel (the same parameters)")
        seeds: list[Config] = []
        near: set[Key] = set()  # the seeds taken and their neighbours
        for config in other.best_configs(len(other.records)):
            if len(seeds) == k:
                break
            key = self.key(config)
            if key in self.records and key not in near:
                seeds.append(config)
                near |= {key, *map(self.key, self.space.neighbours(config))}
        return seeds

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
