"""MaxText's splash attention settings (the ``sa_*`` and ``local_sa_*`` flags of its
``train.py``) from tuned splash configs: the stored entry of one shape, or, for several shapes,
the config best for each layer type's shapes together. MaxText's local sliding-window layers
(``AttentionType.LOCAL_SLIDING``: a problem with a window) read ``local_sa_*`` (each inherits
its ``sa_*`` flag when unset; MaxText since 2026-06), every other attention layer ``sa_*``; a
layer type's own shapes share one set, so each shape's own best config, where it differs, is
named as not expressed.

MaxText takes one ``BlockSizes`` per layer type, field for field (``block_q`` is
``sa_block_q``, ...; a null dQ block of a fused backward is left out). For a layer type's
shapes the candidates are the configs measured in every shape's study whose search times sum
lowest, and each shape's stored winner; they are confirmed on this device as a tune confirms
its winner (``Measurer.confirm``: interleaved rounds, with MaxText's default among them), shape
by shape, and the one whose confirmed times sum lowest wins (each shape counted once) unless it
does not beat MaxText's default beyond the noise (``autotune.tune.choose_winner``). A single
search trial is too noisy to choose by: a config one search timed fastest can be slower than
the default when timed again.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import optuna

from autotune.measure import Measurer, Timing
from autotune.tune import TuneOptions, choose_winner
from kernel import AutotuneError, Problem, TunableKernel, device_target, get_kernel
from storage import Entry, Store
from storage.studies import OK, get_storage, is_measurement, trial_status

KERNEL = "splash"
DEFAULT = "MaxText's default"  # the default's key among the confirmed candidates
# The flags' prefix of each MaxText layer type, and its layers.
LAYER_TYPES = {"sa_": "global attention layers", "local_sa_": "local sliding-window layers"}


class MaxTextError(AutotuneError):
    """No splash config to give for these shapes; the message says what to tune."""


@dataclass(frozen=True)
class SharedConfig:
    """The config best for several shapes together, confirmed on this device."""

    config: Any  # a SplashConfig
    confirmed: dict[Any, dict[Problem, Timing]]  # each candidate's (DEFAULT too) per shape
    chosen: Any  # the key of ``config`` in ``confirmed``
    device_kind: str
    timing: str  # the method the confirmation timed with (the stored entries')
    rounds: int
    own: dict[Problem, Any]  # each shape's stored winner: its best config tuned alone

    @property
    def problems(self) -> list[Problem]:
        return list(self.confirmed[self.chosen])

    def total(self, candidate: Any) -> float:
        """``candidate``'s confirmed medians, summed over the shapes."""
        return sum(timing.median_ms for timing in self.confirmed[candidate].values())


def sa_flags(config: Any, prefix: str = "sa_") -> str:
    """``config``'s fields as MaxText arguments: ``sa_block_q=512 ...`` (``prefix`` before each
    field), nulls left out, booleans as ``true``/``false``."""
    return " ".join(f"{prefix}{name}={json.dumps(value) if isinstance(value, bool) else value}"
                    for name, value in config.to_dict().items() if value is not None)


def layer_types(problems: Sequence[Problem]) -> dict[str, list[Problem]]:
    """``problems`` by the flags their MaxText layers read (``LAYER_TYPES``' prefixes): those
    with a window ``local_sa_*``, the others ``sa_*``; a type without shapes left out."""
    groups = {"sa_": [p for p in problems if p.window is None],
              "local_sa_": [p for p in problems if p.window is not None]}
    return {prefix: group for prefix, group in groups.items() if group}


def maxtext_flags(store: Store, device_kind: str, problems: Sequence[Problem],
                  kernel_version: str | None = None) -> tuple[str, list[str]]:
    """MaxText's flags for ``problems`` and what to say of them: of one shape, its stored
    entry's, as its layer type's flags; of several, each layer type's ``shared_config``, with
    its confirmation lines."""
    if len(problems) == 1:
        [prefix] = layer_types(problems)
        entry = stored_entry(store, device_kind, problems[0], kernel_version)
        return sa_flags(entry.result.config, prefix), []
    flags, lines = [], []
    for prefix, group in layer_types(problems).items():
        shared = shared_config(store, device_kind, group, kernel_version)
        flags.append(sa_flags(shared.config, prefix))
        lines += confirmation_lines(shared, prefix)
    return " ".join(flags), lines


def stored_entry(store: Store, device_kind: str, problem: Problem,
                 kernel_version: str | None = None) -> Entry:
    """The splash entry tuned for exactly ``problem`` on ``device_kind``."""
    found = store.lookup(KERNEL, device_kind, problem, kernel_version=kernel_version)
    if found is None or found[1] != "exact":
        raise MaxTextError(f"no tuned splash entry for {problem.label()} on {device_kind!r}: "
                           "tune that shape with `autotune tune --kernel splash`")
    return found[0]


def shared_config(store: Store, device_kind: str, problems: Sequence[Problem],
                  kernel_version: str | None = None,
                  options: TuneOptions = TuneOptions()) -> SharedConfig:
    """The config best for ``problems`` together, confirmed on this device against MaxText's
    default in ``options.confirm_rounds`` interleaved rounds a shape: among the
    ``options.confirm_top`` configs whose search times over every shape sum lowest and each
    shape's stored winner (all timed by one method, which the confirmation times with)."""
    entries = [stored_entry(store, device_kind, p, kernel_version) for p in problems]
    methods = sorted({str(e.result.timing) for e in entries})
    if len(methods) > 1:
        raise MaxTextError(f"the shapes were timed by different methods ({', '.join(methods)}), "
                           "whose times do not add up: tune them with one --timing")
    kernel = get_kernel(KERNEL).discover()
    _check_measurable(kernel, device_kind, entries)
    candidates = _candidates(store, entries, options.confirm_top)
    target = device_target(jax.devices()[0].platform, device_kind)
    defaults = {p: kernel.default_config(p, target) for p in problems}
    candidates = [c for c in candidates if set(defaults.values()) != {c}]  # not the default
    per_shape = {p: _confirmed(p, defaults[p], candidates, kernel, methods[0], options)
                 for p in problems}
    confirmed = {key: {p: per_shape[p][key] for p in problems}
                 for key in (DEFAULT, *candidates) if all(key in per_shape[p] for p in problems)}
    if not confirmed:
        raise MaxTextError(f"neither MaxText's default nor any of the {len(candidates)} "
                           f"candidate configs compiled, ran and passed the correctness check "
                           f"for every shape on {device_kind}")
    chosen = choose_winner({key: _summed(list(times.values()))
                            for key, times in confirmed.items()}, DEFAULT)
    config = chosen if chosen != DEFAULT else _default_flags(kernel, set(defaults.values()))
    return SharedConfig(config, confirmed, chosen, device_kind, methods[0],
                        options.confirm_rounds, {e.result.problem: e.result.config
                                                 for e in entries})


def _check_measurable(kernel: TunableKernel, device_kind: str, entries: list[Entry]) -> None:
    """Raises ``MaxTextError`` unless this machine can confirm ``entries``: its device is of
    their kind and its splash is their version."""
    here = jax.devices()[0].device_kind
    if here != device_kind:
        raise MaxTextError(f"the shared config is confirmed by measuring it, and this machine's "
                           f"device is {here!r}, not {device_kind!r}: export on a "
                           f"{device_kind!r} machine")
    versions = sorted({e.result.kernel_version for e in entries} - {kernel.version})
    if versions:
        raise MaxTextError(f"the entries are of splash version {', '.join(versions)} and the "
                           f"installed splash is version {kernel.version}, which the "
                           "confirmation measures: tune the shapes with this version")


def _candidates(store: Store, entries: list[Entry], top: int) -> list[Any]:
    """The ``top`` configs measured in every entry's study whose times there sum lowest, then
    each entry's own config, each once."""
    measured = [_measured(store, entry) for entry in entries]
    common = set.intersection(*(set(times) for times in measured))
    ranked = sorted(common, key=lambda config: sum(times[config] for times in measured))
    return list(dict.fromkeys([*ranked[:top], *(e.result.config for e in entries)]))


def _confirmed(problem: Problem, default: Any, candidates: list[Any], kernel: TunableKernel,
               timing: str, options: TuneOptions) -> dict[Any, Timing]:
    """``candidates`` and ``default`` (keyed ``DEFAULT``) re-measured on ``problem`` by the
    tuner's confirmation; those that fail here are left out."""
    measurer = Measurer(problem, default, kernel, compile_timeout_s=options.compile_timeout_s,
                        timing=timing)
    try:
        timings = measurer.confirm([default, *candidates], rounds=options.confirm_rounds)
    finally:
        measurer.close()
    keys = {DEFAULT: default, **{config: config for config in candidates}}
    return {key: timings[config] for key, config in keys.items() if config in timings}


def _summed(timings: list[Timing]) -> Timing:
    """Round by round sums of interleaved timings (one sample a round each)."""
    return Timing(tuple(map(sum, zip(*(t.samples_ms for t in timings), strict=True))))


def _default_flags(kernel: TunableKernel, defaults: set[Any]) -> Any:
    """MaxText's default as flags: the shapes' one default, or, when their sequence lengths
    cap it differently, MaxText's uncapped one (which MaxText caps per shape)."""
    return next(iter(defaults)) if len(defaults) == 1 else kernel.config_type()


def confirmation_lines(shared: SharedConfig, prefix: str) -> list[str]:
    """The confirmed figures of the shapes of one layer type (the flags ``prefix`` names):
    each candidate's median per shape and their sum, fastest first, the chosen one marked, why
    when MaxText's default stays, and the shapes' own best configs the one set misses."""
    problems = shared.problems
    lines = [f"{LAYER_TYPES[prefix]} ({prefix}*): confirmed on {shared.device_kind} against "
             f"MaxText's default: the median ms of {shared.rounds} interleaved rounds a "
             f"shape, timed by {shared.timing}",
             *(f"  shape {n}: {p.label()}" for n, p in enumerate(problems, 1)),
             "  " + "".join(f"{f'shape {n}':>9}" for n in range(1, len(problems) + 1))
             + f"{'sum':>8}  config"]
    for key in sorted(shared.confirmed, key=shared.total):
        times = "".join(f"{t.median_ms:9.3f}" for t in shared.confirmed[key].values())
        name = key if key == DEFAULT else key.label(problems[0].mode)
        mark = "  <- chosen" if key == shared.chosen else ""
        lines.append(f"  {times}{shared.total(key):8.3f}  {name}{mark}")
    if shared.chosen == DEFAULT and min(shared.confirmed, key=shared.total) != DEFAULT:
        lines.append("MaxText's default stays: no candidate beat it beyond the measured noise")
    alone = [f"shape {n} {config.label(problem.mode)}"
             for n, (problem, config) in enumerate(shared.own.items(), 1)
             if config != shared.config]
    if alone and len(problems) > 1:
        lines.append(f"not expressed: MaxText takes one set of {prefix}* flags for all its "
                     f"{LAYER_TYPES[prefix]}, so a shape's own best config cannot be given to "
                     f"its layers alone (tuned alone: {'; '.join(alone)}); the flags serve "
                     "these shapes together")
    return lines


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
