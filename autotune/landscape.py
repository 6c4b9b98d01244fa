"""Replay of measured tuning landscapes (gzip JSON, format in bench/search/landscapes/README.md).

A landscape answers "what would this config have measured" instantly, so a search strategy can
be tested and benchmarked without an accelerator: its space is the declared ``params`` with
"has a record" as the legality rule, and its measure function returns the recorded time or
failure status (with the recorded ``compile_s`` / ``benchmark_s`` as attrs).

:func:`study_document` turns a tuning study that measured its whole legal space (``autotune
tune --sampler grid`` run until the space is exhausted) into a landscape, so our own kernels on
a real TPU or GPU can be replayed like the published ones (``autotune landscape``).
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.files import write_output
from autotune.searchspace import Config, Key, Space
from autotune.trials import OK, Measurement, is_measurement, trial_status
from kernel import AutotuneError

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial


MAX_LANDSCAPE_BYTES = 256 << 20  # decompressed
CHUNK_BYTES = 1 << 20


class LandscapeError(AutotuneError):
    """A landscape file is missing or malformed; the message names the file and the problem."""


@dataclass(frozen=True)
class Landscape:
    name: str
    params: dict[str, list[Any]]
    records: dict[Key, dict[str, Any]]  # config key (params order) -> record

    @cached_property
    def space(self) -> Space:
        """The declared params; the legal configs are the records (walked, never the product
        of the params: a sparse landscape declares far more combinations than it measured)."""
        return Space(self.params, legal=self.records)

    def key(self, config: Config) -> Key:
        return tuple(config[name] for name in self.params)

    @cached_property
    def optimum_ms(self) -> float:
        """The fastest recorded time; scanned once (every score divides by it)."""
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
        doc = json.loads(_decompressed(path))
    except FileNotFoundError:
        raise LandscapeError(f"landscape file {path} does not exist; pass the path of a "
                             "*.json.gz landscape (see bench/search/landscapes/README.md)"
                             ) from None
    except (OSError, ValueError, EOFError) as exc:  # ValueError: not UTF-8, not JSON
        raise LandscapeError(f"{path} is not gzip-compressed JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("params"), dict) or not isinstance(
            doc.get("records"), list):
        raise LandscapeError(f"{path}: expected an object with 'params' (object) and 'records' "
                             "(list)")
    for name, values in doc["params"].items():
        if not (isinstance(values, list) and values
                and all(isinstance(v, int | float | str) for v in values)):
            raise LandscapeError(f"{path}: parameter {name!r} must be a non-empty list of "
                                 f"numbers, strings or booleans, got {str(values)[:60]}")
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
        time_ms = record.get("time_ms")
        if status == OK and (isinstance(time_ms, bool) or not isinstance(time_ms, int | float)
                             or not (math.isfinite(time_ms) and time_ms > 0)):
            raise LandscapeError(f"{path}: record {i} is ok but its time_ms is not a positive "
                                 f"number, got {time_ms!r}")
        if not isinstance(status, str):
            raise LandscapeError(f"{path}: record {i} has no status")
        records[tuple(config[n] for n in params)] = record
    if not any(r["status"] == OK for r in records.values()):
        raise LandscapeError(f"{path}: no record has status 'ok'")
    land = Landscape(str(doc.get("name") or path.name.removesuffix(".json.gz")), params, records)
    try:
        land.space  # noqa: B018 - a parameter repeating a value, or none at all, is refused here
    except ValueError as exc:
        raise LandscapeError(f"{path}: {exc}") from None
    return land


def _decompressed(path: Path) -> bytes:
    """The file's gzip content, read in chunks and refused past ``MAX_LANDSCAPE_BYTES`` (a
    1 MB file can inflate to gigabytes)."""
    chunks, size = [], 0
    with gzip.open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            size += len(chunk)
            if size > MAX_LANDSCAPE_BYTES:
                raise LandscapeError(
                    f"{path} decompresses to more than {MAX_LANDSCAPE_BYTES >> 20} MiB, the "
                    "limit for a landscape (the bundled ones inflate to under 5 MiB); "
                    "pass a landscape file, not an archive of something else")
            chunks.append(chunk)
    return b"".join(chunks)


# Trials that hold a config but never claimed it: an illegal proposal, a config taken by
# another trial (duplicate), the marker of an exhausted space.
_NOT_CLAIMS = ("illegal", "duplicate", "exhausted")


def study_document(study: optuna.Study, *, partial: bool = False) -> dict[str, Any]:
    """The measured configs of a tuning ``study`` as a landscape document (the format of
    bench/search/landscapes/README.md, plus the study's kernel, device and problem): its declared
    values as ``params``, one record per measured config with its ``iqr_ms`` and ``measure_s``
    (seconds the search spent measuring it; the compile ran ahead, in ``compile_s``).

    A landscape's legality rule is "has a record", so a study that did not measure every legal
    config would replay its unmeasured ones as illegal; unless ``partial``, such a study (one
    whose search did not end on an exhausted space) is refused with the fix."""
    attrs = study.user_attrs
    params = attrs.get("params")
    if not isinstance(params, dict) or not params:
        raise LandscapeError(f"study {study.study_name!r} has no declared search space (the "
                             "'params' attr that autotune's search writes); it was not made by "
                             "`autotune tune` or `autotune replay`")
    trials = study.get_trials(deepcopy=False)

    def in_space(t: FrozenTrial) -> bool:
        # A trial from before the declared space last changed may hold a value no longer in it.
        return all(t.params.get(name, ...) in values for name, values in params.items())

    def key_of(t: FrozenTrial) -> Key:
        return tuple(t.params[name] for name in params)

    measured = sorted((t for t in trials if is_measurement(t) and in_space(t)),
                      key=lambda t: t.number)
    if not measured:
        raise LandscapeError(f"study {study.study_name!r} has no measured config yet")
    # The search drops one trial as "exhausted" when it finds no legal config left, counting
    # the claims still open; a claim given back (Ctrl-C, a dead worker) leaves its config
    # unmeasured, so the space is whole only if a later trial measured it.
    keys = {key_of(t) for t in measured}
    given_back = any(in_space(t) and trial_status(t) not in _NOT_CLAIMS
                     and key_of(t) not in keys for t in trials)
    complete = any(trial_status(t) == "exhausted" for t in trials) and not given_back
    if not partial and not complete:
        raise LandscapeError(
            f"study {study.study_name!r} measured {len(measured)} configs but did not measure its "
            "whole legal space, so the configs it never measured would replay as illegal; run "
            "the same `autotune tune` command with `--sampler grid` and a --trials larger than "
            "the space until it stops with 'exhausted' (it resumes the study), or pass "
            "--partial to write the measured part only")
    records: dict[Key, dict[str, Any]] = {}
    for t in measured:
        key = key_of(t)
        records.setdefault(key, {
            "config": dict(zip(params, key, strict=True)), "status": trial_status(t),
            "time_ms": t.value if trial_status(t) == OK else None,
            **{k: t.user_attrs.get(k) for k in ("iqr_ms", "compile_s", "measure_s")}})
    return {"name": study.study_name, "source": f"autotune study {study.study_name!r}",
            "kernel": attrs.get("kernel"), "device": attrs.get("device_kind"),
            "problem": attrs.get("problem"), "objective": "time_ms, lower is better",
            "complete": complete,
            "params": params, "records": list(records.values())}


def save_landscape(document: dict[str, Any], path: str | Path) -> None:
    """Writes ``document`` as gzip JSON to ``path`` (as :func:`autotune.files.write_output`)."""
    write_output(path, gzip.compress(json.dumps(document).encode("utf-8")))
