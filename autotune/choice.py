"""Choosing the kernel for one problem by measurement: tune each candidate kernel in its own
study, confirm their winners against each other in interleaved rounds, publish the choice.
The platform's default kernel (what the wrapper runs without a choice) is kept unless another
beats it beyond the measured noise, by the rule a config must meet to replace the default
config (:func:`autotune.tune.choose_winner`); the choice records whether that kept it.

Kernel-agnostic: candidates come from the registry and are run through the contract; a
kernel that cannot run the problem here, or whose every config fails, is recorded with its
failure class and never chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import jax

from autotune.failures import ProblemTooLarge, Status
from autotune.measure import Measurer, Timing, check_fits, interleaved
from autotune.tune import (
    NothingToPublish,
    TuneObserver,
    TuneOptions,
    check_device_index,
    choose_winner,
    finished_entry,
    tune,
)
from kernel import ConfigError, Problem, device_target, get_kernel, kernel_names
from kernel.resolve import Resolver, ResolverSettings, installed_versions, stale_versions
from kernel.table import KernelChoice, KernelTiming
from storage import Store
from storage.choices import StoredChoice

ObserverFor = Callable[[str], AbstractContextManager[TuneObserver | None]]


def local_kernels(platform: str | None = None, device_kind: str | None = None) -> list[str]:
    """Every registered kernel with rules for the local device (default: this process's
    first) that runs on its platform, or on the platform of the kernel the wrapper runs there
    (on a CPU: the TPU kernels, which it interprets as their correctness oracle; not a GPU
    kernel, whose interpreted trials no CPU user runs and take tens of ms each): the default
    candidates of ``autotune tune`` (``--kernel`` still picks any kernel with rules here)."""
    if platform is None or device_kind is None:
        device = jax.devices()[0]
        platform, device_kind = device.platform, device.device_kind
    target = device_target(platform, device_kind)
    runs_as = {platform, *get_kernel(default_kernel(platform)).platforms}
    out = []
    for name in kernel_names():
        try:
            get_kernel(name).target(target)
        except ConfigError:
            continue
        if runs_as & set(get_kernel(name).platforms):
            out.append(name)
    return out


def default_kernel(platform: str) -> str:
    """The kernel the wrapper runs on ``platform`` without a kernel choice
    (:meth:`kernel.resolve.Resolver.platform_kernel`): a choice keeps it unless another
    candidate beats it beyond the noise."""
    return Resolver(ResolverSettings()).platform_kernel(platform).name


@dataclass
class ChoiceSummary:
    """The outcome of choosing a kernel for one problem: each candidate's tuning summary
    (``TuneSummary.to_dict()``) or failure, their confirmed timings, and the published choice."""

    problem: Problem
    device_kind: str
    choice: KernelChoice
    tuned: dict[str, dict[str, Any]]  # the candidates confirmed here
    failures: dict[str, str] = field(default_factory=dict)  # candidate -> why it failed

    def to_dict(self) -> dict[str, Any]:
        """The chosen kernel's tuning summary with ``chosen_kernel``, ``kernels`` (each
        candidate's confirmed median, null when it failed), ``kernel_failures`` (the failure
        class of those), ``kernels_iqr_ms`` and every candidate's own summary (``tuned``)."""
        candidates = self.choice.candidates
        return {**self.tuned[self.choice.kernel], "chosen_kernel": self.choice.kernel,
                "kernels": self.choice.times_ms(),
                "kernels_iqr_ms": {name: t.iqr_ms for name, t in candidates.items()
                                   if t.failure is None},
                "kernel_failures": {name: t.failure for name, t in candidates.items()
                                    if t.failure is not None},
                "kernel_failure_details": dict(self.failures),
                "choice_method": self.choice.provenance["method"],
                "choice_timing": self.choice.provenance["timing"],
                "choice_within_noise": self.choice.provenance["within_noise"],
                "tuned": dict(self.tuned)}


def choose_kernel(problem: Problem, store: Store, db_url: str | None, kernels: Sequence[str],
                  options: TuneOptions = TuneOptions(),
                  observer_for: ObserverFor | None = None) -> ChoiceSummary:
    """Tunes each of ``kernels`` for ``problem`` (``options.trials`` each, its own study and
    published result), then :func:`publish_choice`. Raises ``NothingToPublish`` when no
    candidate produced a confirmed timing, ``ProblemTooLarge`` when measuring the problem does
    not fit the device (:func:`autotune.measure.check_fits`, or its memory running out while
    the gate's reference runs)."""
    check_fits(problem, jax.devices()[0])
    check_device_index(options, jax.devices()[0].platform)  # not each candidate's loss
    tuned: dict[str, dict[str, Any]] = {}
    lost: dict[str, tuple[str, str]] = {}
    for name in kernels:
        try:
            with (observer_for(name) if observer_for else nullcontext()) as observer:
                tuned[name] = tune(problem, store, db_url, options, observer,
                                   kernel_name=name).to_dict()
        except ProblemTooLarge:  # the problem's, not the candidate's: no other runs it
            raise
        except (ConfigError, NothingToPublish) as error:
            lost[name] = tuning_failure(error)
    return publish_choice(problem, store, kernels, tuned, lost, options)


def tuning_failure(error: ConfigError | NothingToPublish) -> tuple[str, str]:
    """``(failure class, detail)`` of a candidate whose tuning raised ``error``: ``illegal``
    (no target here, or a problem it cannot run), else its configs' most frequent failure."""
    if isinstance(error, ConfigError):
        return Status.ILLEGAL, str(error)
    counts = error.failures
    return (max(counts, key=counts.get) if counts else Status.RUNTIME_ERROR), str(error)


def publish_choice(problem: Problem, store: Store, kernels: Sequence[str],
                   tuned: Mapping[str, dict[str, Any]], lost: Mapping[str, tuple[str, str]],
                   options: TuneOptions = TuneOptions()) -> ChoiceSummary:
    """Confirms the tuned winners of ``kernels`` (``tuned``: their ``TuneSummary.to_dict()``;
    ``lost``: ``(failure class, detail)`` of those that did not tune) against each other on
    this device in ``options.confirm_rounds`` interleaved rounds, and publishes as the choice
    the kernel of the choice published before (else the platform's default kernel) unless
    another is faster beyond the noise (then the fastest; ``within_noise`` in its provenance
    says whether a faster one was passed over): noisy timings do not flip a choice.
    Raises ``NothingToPublish`` when no candidate produced a confirmed timing."""
    device = jax.devices()[0]
    classes = {name: status for name, (status, _) in lost.items()}
    failures = {name: detail for name, (_, detail) in lost.items()}
    winners = {name: get_kernel(name).config_from_dict(summary["best_config"])
               for name, summary in tuned.items()}
    timing = confirm_timing(summary["timing"] for summary in tuned.values())
    timings, unconfirmed = _confirm_winners(problem, winners, options, timing)
    for name, (status, detail) in unconfirmed.items():
        classes[name], failures[name] = status, detail
    if not timings:
        raise NothingToPublish(f"no candidate kernel ({', '.join(kernels)}) ran "
                               f"{problem.label()} on {device.device_kind}: "
                               + "; ".join(f"{k}: {v}" for k, v in failures.items()))
    incumbent = _published_choice(store, device.device_kind, problem)
    kept = incumbent.choice.kernel if incumbent and incumbent.choice.kernel in timings \
        else default_kernel(device.platform)
    chosen, within_noise = choose_among(timings, kept)
    candidates = {name: KernelTiming(timings[name].median_ms, timings[name].iqr_ms)
                  if name in timings else KernelTiming(failure=str(classes[name]))
                  for name in kernels}
    methods = {tuned[name]["method"] for name in timings}
    choice = KernelChoice(
        problem=problem, kernel=chosen, config=winners[chosen], candidates=candidates,
        provenance={"platform": device.platform, "kernel_version": get_kernel(chosen).version,
                    "method": "interpret" if "interpret" in methods else "device",
                    "timing": timing, "within_noise": within_noise,
                    **{f"{package}_version": version for package, version
                       in installed_versions().items() if version is not None}})
    store.publish_choice(device.device_kind, choice)
    return ChoiceSummary(problem, device.device_kind, choice,
                         {name: tuned[name] for name in timings}, failures)


def _published_choice(store: Store, device_kind: str,
                      problem: Problem) -> StoredChoice | None:
    """The kernel choice stored for exactly ``problem`` on ``device_kind``, if any."""
    found = store.lookup_choices([(device_kind, problem)])[0]
    return found[0] if found is not None and found[1] == "exact" else None


def finished_choice(store: Store, device_kind: str, problem: Problem,
                    candidates: Sequence[str], options: TuneOptions) -> StoredChoice | None:
    """The stored kernel choice for ``problem`` on ``device_kind`` when a rerun among
    ``candidates`` with ``options`` would measure nothing and only confirm it again: made
    among (at least) ``candidates`` under the installed versions, each candidate that tuned
    then finished (:func:`autotune.tune.finished_entry`). None with ``options.force``."""
    stored = None if options.force else _published_choice(store, device_kind, problem)
    if stored is None:
        return None
    choice = stored.choice
    timings = choice.candidates
    current = (set(candidates) <= set(timings)
               and choice.provenance.get("kernel_version") == get_kernel(choice.kernel).version
               and not stale_versions(choice.provenance, installed_versions()))
    return stored if current and all(
        finished_entry(store, device_kind, problem, name, options)
        for name in candidates if timings[name].failure is None) else None


def choose_among(timings: Mapping[str, Timing], default: str) -> tuple[str, bool]:
    """The kernel to choose among the confirmed ``timings``: ``default`` unless another beats
    it beyond the noise (:func:`autotune.tune.choose_winner`), and whether that kept it
    although another measured faster (within the noise)."""
    chosen = choose_winner(timings, default)
    return chosen, chosen != min(timings, key=lambda name: timings[name].median_ms)


def confirm_timing(methods: Iterable[str]) -> str:
    """The one timing method the candidates' winners are confirmed with: theirs when they
    agree, else ``loop``, which times any kernel on any device. Times of two methods are not
    compared: a loop's run includes the loop's own cost, a step profile's does not (see
    :mod:`autotune.timing`)."""
    distinct = set(methods)
    return distinct.pop() if len(distinct) == 1 else "loop"


def _confirm_winners(problem: Problem, winners: dict[str, Any], options: TuneOptions,
                     timing: str) -> tuple[dict[str, Timing], dict[str, tuple[str, str]]]:
    """Each kernel's tuned winner (``winners``: kernel -> config) re-measured with ``timing``
    as the wrapper runs it (``TunableKernel.as_called``), all interleaved (as a search's
    candidates are against the default): timings by kernel, and ``(failure class, detail)`` of those whose winner fails
    to compile, run or pass the correctness check here that way, which are never chosen."""
    measurers, timers, lost = [], {}, {}
    try:
        for name, config in winners.items():
            kernel = get_kernel(name).discover()
            measurer = Measurer(problem, config, kernel,
                                compile_timeout_s=options.compile_timeout_s,
                                timing=timing, build=kernel.as_called)
            measurers.append(measurer)
            executable, failure = measurer.checked(config)
            if failure is not None:
                lost[name] = (failure.status, "as kernel.flash_attention runs it: "
                              + failure.attrs.get("error", ""))
                continue
            timers[name] = measurer.timer(executable)
        return interleaved(timers, options.confirm_rounds), lost
    finally:
        for measurer in measurers:
            measurer.close()
