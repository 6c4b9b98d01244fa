"""Tuning one problem end to end: search, confirm the winner, publish it with provenance.

Composes a registered kernel (``kernel.registry``: space, rules, default, the measured function)
and ``storage`` (where the winner goes, and where warm-start seeds come from); nothing here
depends on which kernel is tuned. The Optuna study lives in the same database
as the results, named after the key, so re-running the same command resumes it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import jax
import optuna
from optuna.trial import FrozenTrial

from autotune.devices import measuring_index_problem
from autotune.failures import ChipStateCorrupted
from autotune.measure import Config, Measurer, Timing, claims_ahead
from autotune.peaks import device_roofline
from autotune.samplers import LEARNING_SAMPLERS, SAMPLERS, SamplerName
from autotune.search import SearchResult, measured_since_best, search
from autotune.searchspace import Space
from autotune.trials import (
    NOT_MEASURED,
    NOTHING_TO_SEARCH,
    OK,
    ONE_CONFIG_PHASE,
    TrialResult,
    is_measurement,
    trial_status,
)
from kernel import DEFAULT_KERNEL, ConfigError, Problem, Target, TunableKernel, device_target
from kernel.problem import shown_number
from kernel.registry import registered_kernel
from kernel.resolve import installed_versions
from kernel.roofline import Roofline
from storage import Entry, PublishOutcome, Store, TunedResult
from storage.results import faster_beyond_noise
from storage.studies import get_storage, refusing_study_writes

K = TypeVar("K", bound=Hashable)
MAX_WARM_SEEDS = 3
MAX_SEED = 2**32 - 1  # the largest seed numpy's RandomState, which TPE draws from, takes
CONFIRMED_ATTR = "confirmed"  # a study's measured count and stop reason at its last publish


@dataclass(frozen=True)
class TuneOptions:
    trials: int = 30
    timeout: float | None = None
    patience: int | None = None  # off: why, docs/tuning.md "Stopping early (--patience)"
    sampler: SamplerName = "tpe"
    seed: int | None = 0
    study: str | None = None  # default: derived from the key, so a rerun resumes
    confirm_top: int = 3
    confirm_rounds: int = 5
    compile_timeout_s: float = 300.0
    force: bool = False  # confirm a finished problem again; replace a stored entry timed otherwise
    device_index: int = 0  # which local device measures (its worker sees only that one)
    timing: str = "auto"  # autotune.timing: auto, step_profile, loop or wallclock

    def __post_init__(self) -> None:
        """Refuses what the CLI's options refuse, and values no tune runs with, naming the
        field (``TuneOptionError``). ``device_index`` is checked where the devices are known,
        when a tune starts (:func:`check_device_index`)."""
        seed, rounds, compile_s = self.seed, self.confirm_rounds, self.compile_timeout_s
        rules = (
            ("trials", _whole(self.trials, 1),
             "an integer of at least 1 (measured configs per problem)"),
            ("patience", self.patience is None or _whole(self.patience, 1),
             "None or an integer of at least 1 (measured configs without improvement)"),
            ("timeout", self.timeout is None or _seconds(self.timeout),
             "None or seconds of at least 0 (wall time per problem)"),
            ("sampler", self.sampler in SAMPLERS, f"one of {', '.join(SAMPLERS)}"),
            ("seed", seed is None or _whole(seed, 0) and seed <= MAX_SEED,
             "None or an integer from 0 to 2**32 - 1 (the sampler's random seed)"),
            ("confirm_top", _whole(self.confirm_top, 0),
             "an integer of at least 0 (best measured configs confirmed against the default)"),
            ("confirm_rounds", _whole(rounds, 1),
             "an integer of at least 1 (interleaved rounds of the confirmation)"),
            ("compile_timeout_s", _seconds(compile_s) and 0 < compile_s < math.inf,
             "seconds above 0, finite (the wait for one config's compile)"),
            ("device_index", _whole(self.device_index, 0),
             "an integer of at least 0 (the local device that measures)"))
        for name, holds, wanted in rules:
            if not holds:
                raise TuneOptionError(name, f"{name} must be {wanted}, got "
                                            f"{shown_number(getattr(self, name))}")


class TuneOptionError(ConfigError):
    """A ``TuneOptions`` field holds a value no tune runs with; ``field`` names it."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.field = name


def _whole(value: Any, least: int) -> bool:
    """Whether ``value`` is an int (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _seconds(value: Any) -> bool:
    """Whether ``value`` is a number (not a bool) of at least 0 seconds (not NaN)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def check_device_index(options: TuneOptions, platform: str) -> None:
    """Raises ``TuneOptionError`` unless ``options.device_index`` names the device this process
    measures on (:func:`autotune.devices.measuring_index_problem`): its provenance."""
    problem = measuring_index_problem(options.device_index, platform)
    if problem:
        raise TuneOptionError("device_index", problem)


@dataclass
class TuneSummary:
    """The outcome of tuning one problem (what ``autotune tune --json`` ends with)."""

    problem: Problem
    kernel: str
    device_kind: str
    method: str
    study: str
    best_config: Config
    best_time_ms: float
    default_time_ms: float | None  # None: the default failed on this device
    speedup: float | None
    measured: int
    failures: dict[str, int]
    winner_is_default: bool
    publish: str  # what storage did: inserted, replaced, kept
    stop_reason: str  # budget | patience | timeout | exhausted, or NOTHING_TO_SEARCH
    patience: int | None  # the tune's: a "patience" stop came after that many (None: off)
    device_index: int = 0
    timing: str = "wallclock"  # the method every trial and the confirmation were timed with
    timing_note: str | None = None  # why auto fell back from step_profile, if it did
    roofline: Roofline | None = None  # None on a CPU
    confirmation: dict[str, dict[str, Any]] = field(default_factory=dict)
    platform: str = ""  # JAX's platform of the device that measured it
    # The kernel's named baselines (TunableKernel.baselines): each one's config and confirmed
    # time with its ratio to the winner's, or why it did not run here.
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"problem": self.problem.to_dict(), "kernel": self.kernel,
                "device_kind": self.device_kind, "platform": self.platform,
                "method": self.method, "timing": self.timing, "timing_note": self.timing_note,
                **result_roofline(self.roofline), "study": self.study,
                "best_config": self.best_config.to_dict(),
                "best_time_ms": self.best_time_ms, "default_time_ms": self.default_time_ms,
                "speedup": self.speedup, "measured": self.measured, "failures": self.failures,
                "winner_is_default": self.winner_is_default, "publish": self.publish,
                "stop_reason": self.stop_reason, "patience": self.patience,
                "device_index": self.device_index, "baselines": self.baselines}


def result_roofline(roofline: Roofline | None) -> dict[str, Any]:
    """A roofline as a result's fields (all None without one: on a CPU)."""
    return {"achieved_tflops": roofline and roofline.tflops,
            "roofline_fraction": roofline and roofline.fraction,
            "roofline_bound": roofline and roofline.bound}


def study_name(problem: Problem, device_kind: str, kernel: TunableKernel, timing: str) -> str:
    """The study of a key, a timing method and the installed versions: a rerun resumes it, and
    times that are not comparable go to a study of their own: taken by another timing method,
    of another kernel version (a config may mean something else), or under another jax, jaxlib
    or libtpu (a re-tune after an upgrade searches again, seeded with the old winner)."""
    versions = " ".join(f"{package} {version}"
                        for package, version in installed_versions().items() if version)
    return (f"{kernel.name}/v{kernel.version}/{device_kind}/{timing}/{versions}/"
            f"{problem.label()}")


def finished_entry(store: Store, device_kind: str, problem: Problem, kernel_name: str,
                   options: TuneOptions) -> Entry | None:
    """The stored entry of ``kernel_name`` for exactly ``problem`` on ``device_kind`` when a
    rerun with ``options`` would measure nothing and only confirm it again: published under
    the installed versions and the asked timing, from the study the rerun resumes, with no
    config measured since and nothing left to measure (its budget reached, its space
    exhausted, or ``options.patience`` measured configs since its fastest), or of a kernel
    without fields. None with ``options.force``."""
    kernel = registered_kernel(kernel_name)
    found = None if options.force else store.lookup(kernel.name, device_kind, problem)
    if found is None or found[1] != "exact":
        return None
    entry, stored = found[0], found[0].result
    if stored.stale_versions() or options.timing not in ("auto", stored.timing):
        return None
    if not kernel.space_params(problem):
        return entry
    if stored.timing is None or stored.study != (
            options.study or study_name(problem, device_kind, kernel, stored.timing)):
        return None
    storage = get_storage(store.url, create=False)
    try:
        study = optuna.load_study(study_name=stored.study, storage=storage)
    except KeyError:  # no such study here (an imported entry's)
        return None
    confirmed = study.user_attrs.get(CONFIRMED_ATTR) or {}
    measurements = [t for t in study.get_trials(deepcopy=False) if is_measurement(t)]
    measured = len(measurements)
    searched = (measured >= options.trials or confirmed.get("stop_reason") == "exhausted"
                or options.patience is not None
                and options.patience <= measured_since_best(measurements))
    return entry if searched and confirmed.get("measured") == measured else None


def kernel_space(kernel: TunableKernel, problem: Problem,
                 target: Target) -> tuple[Space, Config]:
    """The search space of ``problem`` for ``kernel`` (only fields that matter for its mode)
    and the default config, whose values fill the fields the search does not vary."""
    base = kernel.default_config(problem, target)

    def is_legal(params: dict[str, Any]) -> bool:
        try:
            config = base.replace(**params)
        except ConfigError:  # e.g. a compute block that does not divide the kv block
            return False
        return kernel.is_legal(problem, config, target)

    space = Space(kernel.space_params(problem), is_legal, canonical=kernel.canonical_params)
    return space, base


def warm_seeds(store: Store, problem: Problem, device_kind: str, space: Space,
               base: Config, kernel: TunableKernel, target: Target) -> list[dict[str, Any]]:
    """The default first; then winners of the nearest tuned problems of its family
    (``Problem.family``) on the same device, the problem's own stored winner first
    (a re-tune under new versions, a new study), at most :data:`MAX_WARM_SEEDS`; then the
    kernel's hand-set families (``TunableKernel.seed_configs``) for this device."""
    family = {"kernel": kernel.name, "device_kind": device_kind, "dtype": problem.dtype,
              "head_dim": problem.head_dim}  # columns of either problem type
    entries, _ = store.list(family, limit=None, problem_type=kernel.problem_type)
    nearest = sorted((e.result for e in entries
                      if e.result.problem.family() == problem.family()),
                     key=lambda r: problem.distance(r.problem))
    warm = _legal_once(space, _params(space, [base] + [r.config for r in nearest]))
    families = _params(space, kernel.seed_configs(problem, target))
    return _legal_once(space, warm[:1 + MAX_WARM_SEEDS] + families)


def _legal_once(space: Space, params: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The legal ones of ``params``, each once, in order."""
    return list({space.key(p): p for p in params if space.is_legal(p)}.values())


def _params(space: Space, configs: list[Config]) -> list[dict[str, Any]]:
    return [{name: getattr(config, name) for name in space.names} for config in configs]


def _top_configs(study: optuna.Study, base: Config, count: int) -> list[Config]:
    ok = sorted((t for t in study.get_trials(deepcopy=False)
                 if t.state == optuna.trial.TrialState.COMPLETE
                 and t.user_attrs.get("status", "ok") == "ok"), key=lambda t: t.value)
    return list(dict.fromkeys(base.replace(**t.params) for t in ok))[:count]


def _failures(study: optuna.Study) -> dict[str, int]:
    return dict(Counter(t.user_attrs["status"] for t in study.get_trials(deepcopy=False)
                        if t.user_attrs.get("status", OK) not in (OK, *NOT_MEASURED)))


def choose_winner(timings: Mapping[K, Timing], default: K) -> K:
    """The fastest confirmed candidate (a config, or a kernel of a kernel choice), unless it
    does not beat the default beyond the noise: its median must be lower by more than the
    larger of the two spreads (IQR) and 1%. Without a timing of the default (it failed here,
    or is no candidate) the fastest wins."""
    best = min(timings, key=lambda c: timings[c].median_ms)
    if default not in timings:
        return best
    fast, slow = timings[best], timings[default]
    return best if faster_beyond_noise(fast.median_ms, fast.iqr_ms, slow.median_ms,
                                       slow.iqr_ms) else default


class NothingToPublish(RuntimeError):
    """No config of the problem worked on this device, not even the default. ``failures``:
    how many configs ended in each failure class."""

    def __init__(self, message: str, failures: dict[str, int] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}


class TuneInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a tuning run; the message says how to resume it."""


class TuneObserver(Protocol):
    """What a progress display gets told while a problem is tuned."""

    def on_start(self, measured: int) -> None:
        """The search starts with ``measured`` configs of the study already measured (by
        earlier runs of a resumed study, or other workers)."""

    def on_trial(self, result: TrialResult, best: TrialResult | None,
                 default_ms: float | None) -> None: ...

    def on_phase(self, phase: str) -> None: ...

    def on_notice(self, message: str) -> None: ...


class TuneJob:
    """One problem on this device, open from the search to the publish: the kernel, space,
    study and measurer. ``search`` may run more than once (a resume pass measures only what
    the study-wide budget still lacks); ``publish`` confirms the winner and stores it. A
    kernel without tunable fields (``xla``) has no space and no study: its one config is
    confirmed alone."""

    def __init__(self, problem: Problem, store: Store, db_url: str | None,
                 options: TuneOptions = TuneOptions(), observer: TuneObserver | None = None,
                 kernel_name: str = DEFAULT_KERNEL) -> None:
        self.kernel = kernel = registered_kernel(kernel_name).discover()
        self.device = jax.devices()[0]
        check_device_index(options, self.device.platform)
        self.target = target = device_target(self.device.platform, self.device.device_kind)
        kernel.check_runs(problem, target)
        self.problem, self.store, self.options, self.observer = problem, store, options, observer
        self.space, self.base = (kernel_space(kernel, problem, target)
                                 if kernel.space_params(problem)
                                 else (None, kernel.default_config(problem, target)))
        self.storage = get_storage(db_url)
        self.ahead = claims_ahead(options.sampler in LEARNING_SAMPLERS)
        self.measurer = Measurer(problem, self.base, kernel, pool_size=self.ahead + 1,
                                 compile_timeout_s=options.compile_timeout_s,
                                 timing=options.timing,
                                 notify=observer.on_notice if observer else None)
        self._default_params = ({name: getattr(self.base, name) for name in self.space.names}
                                if self.space else {})
        self._default_ms: list[float] = []  # the default's search-time measurement, once seen
        try:  # all trials then share one timing method, and its study
            self.measurer.settle_timing(self._default_params)
        except BaseException:
            self.measurer.close()
            raise
        self.name = options.study or study_name(problem, self.device.device_kind, kernel,
                                                self.measurer.timing)

    def close(self) -> None:
        self.measurer.close()

    def _on_trial(self, result: TrialResult, best: TrialResult | None) -> None:
        if result.config == self._default_params and result.measurement.ok:
            self._default_ms.append(result.measurement.value)
        if self.observer:
            self.observer.on_trial(result, best,
                                   self._default_ms[0] if self._default_ms else None)

    def _measurements(self) -> list[FrozenTrial]:
        """The study's measured trials, of every run ([] before the study exists)."""
        try:
            study_id = self.storage.get_study_id_from_name(self.name)
        except KeyError:
            return []
        return [t for t in self.storage.get_all_trials(study_id, deepcopy=False)
                if is_measurement(t)]

    def measured(self) -> int:
        """The study-wide number of measured configs (0 before the study exists)."""
        return len(self._measurements())

    def search(self) -> SearchResult:
        options = self.options
        if self.space is None:
            return SearchResult(self.name, None, 0, [], [], NOTHING_TO_SEARCH, 0.0)
        trials = self._measurements()
        if not self._default_ms:  # an earlier run measured the default: "x vs default" uses it
            self._default_ms += [t.value for t in trials if t.params == self._default_params
                                 and trial_status(t) == OK][:1]
        if self.observer:
            self.observer.on_start(len(trials))
        return search(self.space, self.measurer, storage=self.storage, study_name=self.name,
                      of={"problem": self.problem.to_dict(), "kernel": self.kernel.name,
                          "kernel_version": self.kernel.version,
                          "device_kind": self.device.device_kind, "timing": self.measurer.timing},
                      sampler=options.sampler, trials=options.trials, timeout=options.timeout,
                      patience=options.patience,
                      seeds=warm_seeds(self.store, self.problem, self.device.device_kind,
                                       self.space, self.base, self.kernel, self.target),
                      seed=options.seed, on_trial=self._on_trial,
                      prepare=self.measurer.prepare, ahead=self.ahead)

    def publish(self, result: SearchResult) -> TuneSummary:
        """Confirms the best measured configs against the default and publishes the winner."""
        problem, base, options, kernel, device = (self.problem, self.base, self.options,
                                                  self.kernel, self.device)
        if self.observer:
            self.observer.on_phase("confirming" if self.space else ONE_CONFIG_PHASE)
        study = (optuna.load_study(study_name=self.name, storage=self.storage)
                 if self.space else None)
        top = _top_configs(study, base, options.confirm_top) if study else []
        named = kernel.baselines(problem, self.target)
        legal = [c for c in named.values() if kernel.is_legal(problem, c, self.target)]
        timings = self.measurer.confirm([base, *legal, *top], rounds=options.confirm_rounds)
        failures = _failures(study) if study else {}
        if base not in timings and study and base in _top_configs(study, base, len(study.trials)):
            raise ChipStateCorrupted(
                f"the default config {base.label(problem.mode)} passed the search but failed "
                f"the confirmation on {device.device_kind}: the device's state is likely "
                f"corrupt; nothing published")
        if not timings:
            confirmed = (f"the default and the best {len(top)} measured" if top else
                         f"the default; none of the {result.measured} measured passed")
            raise NothingToPublish(
                f"no config of {problem.label()} compiled, ran and passed the correctness "
                f"check on {device.device_kind} ({confirmed}); nothing published", failures)
        winner = choose_winner(timings, base)
        winner_ms = timings[winner].median_ms
        default_ms = timings[base].median_ms if base in timings else None
        speedup = default_ms / winner_ms if default_ms is not None else None
        roofline = device_roofline(device, problem, winner_ms)
        confirmation = {c.label(): {"config": c.to_dict(), "samples_ms": list(t.samples_ms),
                                    "median_ms": t.median_ms, "iqr_ms": t.iqr_ms,
                                    "kernel_median_ms": t.kernel_median_ms,
                                    "is_default": c == base, "is_winner": c == winner,
                                    "baselines": [n for n, b in named.items() if b == c]}
                        for c, t in timings.items()}
        # The study is complete before the entry names it: a kill in between leaves no entry
        # whose study lacks its confirmation.
        previous = study.user_attrs.get("confirmation") if study else None
        if study:
            study.set_user_attr("confirmation", list(confirmation.values()))
            study.set_user_attr("device_kind", device.device_kind)  # problem, kernel: search()
        outcome = self._publish(TunedResult(
            kernel=kernel.name, kernel_version=kernel.version, device_kind=device.device_kind,
            problem=problem, config=winner, median_ms=winner_ms,
            iqr_ms=timings[winner].iqr_ms, default_median_ms=default_ms,
            speedup=speedup, trials=result.measured, method=self.measurer.method,
            timing=self.measurer.timing, **result_roofline(roofline),
            study=self.name if study else None, device_index=options.device_index,
            kernel_median_ms=timings[winner].kernel_median_ms,
            compositions=kernel.compositions(problem),
            **{f"{package}_version": version
               for package, version in installed_versions().items()}))
        if study:  # what a rerun compares: nothing measured since means nothing to confirm
            study.set_user_attr(CONFIRMED_ATTR, {"measured": result.measured,
                                                 "stop_reason": result.stop_reason})
        if study and previous and outcome.status == "kept" \
                and outcome.entry.result.study == self.name:
            # A rerun whose winner lost to the entry an earlier run of this study stored: the
            # study keeps that run's confirmation, whose winner is the stored config.
            study.set_user_attr("confirmation", previous)
        return TuneSummary(
            problem=problem, kernel=kernel.name, device_kind=device.device_kind,
            method=self.measurer.method, study=self.name if study else "",
            best_config=winner, best_time_ms=winner_ms, default_time_ms=default_ms,
            speedup=speedup, measured=result.measured,
            failures=failures, winner_is_default=winner == base,
            publish=outcome.status, stop_reason=result.stop_reason, patience=options.patience,
            device_index=options.device_index, timing=self.measurer.timing,
            timing_note=self.measurer.timing_note, roofline=roofline,
            confirmation=confirmation, platform=device.platform,
            baselines={name: self._baseline(config, timings, winner_ms)
                       for name, config in named.items()})

    def _baseline(self, config: Config, timings: Mapping[Config, Timing],
                  winner_ms: float) -> dict[str, Any]:
        """A named baseline in the summary: its confirmed time and the winner's speedup over
        it, or why it has none (the rules refuse it here, or it failed)."""
        out: dict[str, Any] = {"config": config.to_dict()}
        broken = self.kernel.violations(self.problem, config, self.target)
        if broken:
            return {**out, "refused": "; ".join(map(str, broken))}
        if config not in timings:
            return {**out, "refused": "failed to compile, run or pass the gate here"}
        ms = timings[config].median_ms
        return {**out, "median_ms": ms, "iqr_ms": timings[config].iqr_ms,
                "speedup": ms / winner_ms}

    def _publish(self, result: TunedResult) -> PublishOutcome:
        """Publishes ``result`` if it beats the stored entry beyond the noise of both. With
        ``--force`` it replaces one timed otherwise (another timing method, other jax, jaxlib
        or libtpu versions) even if that is faster; one it times again, never on noise."""
        stored = self.store.get(result.key)
        again = stored is not None and stored.result.timing == result.timing \
            and not stored.result.stale_versions()
        return self.store.publish(result, force=self.options.force and not again,
                                  beyond_noise=True)


def tune(problem: Problem, store: Store, db_url: str | None, options: TuneOptions = TuneOptions(),
         observer: TuneObserver | None = None, kernel_name: str = DEFAULT_KERNEL) -> TuneSummary:
    """Searches, confirms and publishes the best config of kernel ``kernel_name`` for
    ``problem`` on this device. Raises ``ConfigError`` (before anything is written) for an
    unknown kernel, a device it has no target for, or a problem it cannot run;
    ``WriteRefusedError`` when the database (results or study) cannot store."""
    with refusing_study_writes(db_url):
        job = TuneJob(problem, store, db_url, options, observer, kernel_name)
        try:
            return job.publish(job.search())
        except KeyboardInterrupt:
            raise TuneInterrupted(
                f"tuning {job.kernel.name} {problem.label()} stopped; its measured configs are "
                f"kept: run the same command again to resume study {job.name!r}") from None
        finally:
            job.close()
