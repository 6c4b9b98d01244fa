"""MaxText's splash attention settings (the ``sa_*`` flags of its ``train.py``) from tuned
splash configs: the stored entry of one shape, or the config best for several shapes that
one set of settings must serve (a model's local and global attention layers).

MaxText takes one ``BlockSizes`` per model, field for field (``block_q`` is ``sa_block_q``,
...; a null dQ block of a fused backward is left out). For several shapes the configs
measured in every shape's study are the candidates, and the one whose times sum lowest wins
(each shape counted once): a config one of the searches never measured has no time there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna

from kernel import AutotuneError, Problem, device_target, get_kernel
from storage import Entry, Store
from storage.studies import OK, get_storage, is_measurement, trial_status

KERNEL = "splash"


class MaxTextError(AutotuneError):
    """No splash config to give for these shapes; the message says what to tune."""


@dataclass(frozen=True)
class SharedConfig:
    """The config best for several shapes together, from their stored trials."""

    config: Any  # a SplashConfig
    times_ms: dict[Problem, float]  # its measured time per shape
    best_ms: dict[Problem, float]  # each shape's own best measured time
    candidates: int  # configs measured for every shape


def sa_flags(config: Any) -> str:
    """``config``'s fields as MaxText arguments: ``sa_block_q=512 ...``, nulls left out,
    booleans as ``true``/``false``."""
    return " ".join(f"sa_{name}={json.dumps(value) if isinstance(value, bool) else value}"
                    for name, value in config.to_dict().items() if value is not None)


def stored_entry(store: Store, device_kind: str, problem: Problem,
                 kernel_version: str | None = None) -> Entry:
    """The splash entry tuned for exactly ``problem`` on ``device_kind``."""
    found = store.lookup(KERNEL, device_kind, problem, kernel_version=kernel_version)
    if found is None or found[1] != "exact":
        raise MaxTextError(f"no tuned splash entry for {problem.label()} on {device_kind!r}: "
                           "tune that shape with `autotune tune --kernel splash`")
    return found[0]


def shared_config(store: Store, device_kind: str, problems: Sequence[Problem],
                  kernel_version: str | None = None) -> SharedConfig:
    """The config whose measured times over ``problems`` sum lowest, among the configs every
    problem's study measured (the studies of their stored splash entries, all timed by one
    method)."""
    entries = [stored_entry(store, device_kind, p, kernel_version) for p in problems]
    methods = sorted({str(e.result.timing) for e in entries})
    if len(methods) > 1:
        raise MaxTextError(f"the shapes were timed by different methods ({', '.join(methods)}), "
                           "whose times do not add up: tune them with one --timing")
    measured = [_measured(store, entry) for entry in entries]
    common = set.intersection(*(set(times) for times in measured))
    if not common:
        raise MaxTextError("no config was measured for every shape, so none has a time for "
                           "each: tune them again with more --trials, or --sampler grid")
    best = min(common, key=lambda config: sum(times[config] for times in measured))
    return SharedConfig(best, {p: times[best] for p, times in zip(problems, measured)},
                        {p: min(times.values()) for p, times in zip(problems, measured)},
                        len(common))


def _measured(store: Store, entry: Entry) -> dict[Any, float]:
    """The configs the study of ``entry`` measured without failure, with their times (ms)."""
    result = entry.result
    missing = MaxTextError(f"the splash entry for {result.problem.label()} was not tuned in "
                           "this database (imported: its trials are elsewhere): tune that "
                           "shape here with `autotune tune --kernel splash`")
    storage = get_storage(store.url, create=False)
    if result.study is None or storage is None:
        raise missing
    try:
        study = optuna.load_study(study_name=result.study, storage=storage)
    except KeyError:
        raise missing from None
    kernel = get_kernel(KERNEL).discover()
    base = kernel.default_config(result.problem, device_target(result.platform,
                                                               result.device_kind))
    return {base.replace(**trial.params): trial.value
            for trial in study.get_trials(deepcopy=False)
            if is_measurement(trial) and trial_status(trial) == OK}
