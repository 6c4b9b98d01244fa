"""``autotune tune``: search, confirm and publish the best config for one or more problems."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from autotune.commands.db import (DbOption, database_errors, ensure_schema, open_store,
                                  resolve_url)
from autotune.problem_options import (ShapesOption, given_problems, known_kernels,
                                      problem_flags_given, tunable_kernel, with_problem_options)
from kernel import Problem
from present.text import INTERPRET_NOTE


@with_problem_options
def tune(
    context: typer.Context,
    problem: Problem,
    shapes: ShapesOption = None,
    from_function: Annotated[str | None, typer.Option(
        "--from", help="module:function whose attention problems to tune, found by tracing "
                       "it abstractly (instead of --shapes or the problem flags).")] = None,
    args: Annotated[str | None, typer.Option(
        help="The --from function's arguments: dtype\\[d0,d1,...] arrays separated by spaces, "
             "or module:function returning the argument tuple (default: none).")] = None,
    trials: Annotated[int, typer.Option(min=1, help="Measured configs per problem.")] = 30,
    timeout: Annotated[float | None, typer.Option(min=0, help="Wall seconds per problem.")]
    = None,
    patience: Annotated[int | None, typer.Option(
        min=1, help="Stop a problem's search after this many measured configs without a "
                    "faster one (default: off, all --trials measured; docs/tuning.md).")]
    = None,
    kernel: Annotated[str | None, typer.Option(
        "--kernel", callback=tunable_kernel,
        help="Tune this one registered kernel only (no kernel choice). A serving kernel "
             "(rpa) tunes the serving problems of a --shapes file (docs/serving.md).")] = None,
    kernels: Annotated[str | None, typer.Option(
        help="Comma-separated kernels to tune, confirm against each other and choose among "
             "(default: every registered kernel with rules for this device).")] = None,
    sampler: Annotated[str, typer.Option(
        help="tpe (ours) | random | grid | plain-tpe (Optuna's TPESampler, the baseline).")]
    = "tpe",
    seed: Annotated[int, typer.Option(help="Sampler seed.")] = 0,
    db: DbOption = None,
    study: Annotated[str | None, typer.Option(
        help="Optuna study name (default: derived from the key, so a rerun resumes).")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Tune a problem already tuned again (else it is kept as it is). Its "
                        "winner replaces a stored one timed under other versions or another "
                        "--timing even if that is faster; one timed alike, only beyond the "
                        "noise.")] = False,
    timing: Annotated[str, typer.Option(
        help="How runs are timed: step_profile (the whole step's device time, every op of "
             "the measured program, from a profiler trace; the named kernels' part beside "
             "it), loop (many runs in one compiled program), wallclock (host time per call), "
             "or auto: step_profile on a TPU or GPU (loop if the trace shows none of the "
             "program), wallclock on a CPU.")] = "auto",
    json_output: Annotated[bool, typer.Option(
        "--json", help="One JSON object per trial, then one summary object per problem.")]
    = False,
    devices: Annotated[str, typer.Option(
        help="Local devices to tune on, one worker process each: all, a count (2) or device "
             "indices (0,2,5). Workers share the database and spread over the problems.")]
    = "1",
) -> None:
    """Tune each candidate kernel's block sizes (and pipeline depth) on the local device,
    confirm each winner against its default and publish it under the kernel's name; then
    confirm the kernels' winners against each other and publish the kernel choice. With
    --kernel, tune that one kernel (on several devices with --devices). Every problem given
    is tuned: one that cannot be (too large for the device's memory, or no config of it ran
    and passed the correctness check) is reported in one line and the others go on; the exit
    status is then 1. Exit 2 stops the run at once: a bad option, shapes file or database, a
    problem the --kernel given cannot run, a --timing that cannot time here."""
    from autotune.devices import DeviceSelectionError, LocalDevices, parse_devices, select_devices

    try:
        selection = parse_devices(devices)
    except DeviceSelectionError as error:
        raise typer.BadParameter(str(error), param_hint="--devices") from None
    from storage import unknown_timing

    if unknown_timing(timing) is not None:
        raise typer.BadParameter(unknown_timing(timing), param_hint="--timing")
    from autotune.tune import TuneOptionError, TuneOptions

    try:  # refused before anything runs, as the option it came from
        options = TuneOptions(trials=trials, timeout=timeout, patience=patience,
                              sampler=sampler, seed=seed, study=study, force=force,
                              timing=timing)
    except TuneOptionError as error:
        raise typer.BadParameter(str(error), param_hint=f"--{error.field}") from None
    if kernel is not None and kernels is not None:
        raise typer.BadParameter("give --kernel (one kernel) or --kernels (a choice), not both",
                                 param_hint="--kernels")
    try:
        candidates = [kernel] if kernel else known_kernels(kernels)
    except typer.BadParameter as error:
        raise typer.BadParameter(error.message, param_hint="--kernels") from None
    problem_type = _problem_type(context, kernel, shapes, from_function, selection)
    problems = _problems(context, problem, shapes, from_function, args,
                         host_only=selection != 1, problem_type=problem_type)
    if study and len(problems) > 1:
        raise typer.BadParameter("--study names one study; leave it out with --shapes",
                                 param_hint="--study")
    if study and kernel is None:
        raise typer.BadParameter("--study names one kernel's study; give --kernel NAME too",
                                 param_hint="--study")
    if study is not None:
        from storage import ResultError, check_text

        try:  # stored with the result: refused now, not after the whole search
            check_text("study", study)
        except ResultError as error:
            raise typer.BadParameter(str(error), param_hint="--study") from None
    if selection != 1:  # before the database is opened (or created)
        try:
            chosen = select_devices(selection, local := LocalDevices.probe())
        except DeviceSelectionError as error:
            raise typer.BadParameter(str(error), param_hint="--devices") from None
    db_url = resolve_url(db)
    ensure_schema(db_url)
    store = open_store(db_url)

    from autotune.choice import choose_kernel, local_kernels
    from autotune.progress import TuneProgress
    from autotune.failures import ChipStateCorrupted, ProblemTooLarge
    from autotune.tune import NothingToPublish, TuneInterrupted
    from autotune.search import StudyMismatchError
    from autotune.timing import TimingError
    from autotune.tune import tune as run_tune
    from kernel import ConfigError

    if selection != 1:
        candidates = candidates or local_kernels(local.platform, local.device_kind)
        with store:
            problems = _unfinished(problems, store, local.device_kind, kernel, candidates,
                                   options, json_output)
        if problems:
            _tune_on_workers(problems, chosen, local.platform, db_url, kernel, options,
                             json_output, candidates)
        return
    import jax

    candidates = candidates or local_kernels()
    failed = 0
    with store, database_errors(db_url):  # a full disk or a lost database: one line
        for item in _unfinished(problems, store, jax.devices()[0].device_kind, kernel,
                                candidates, options, json_output):
            def progress_for(name: str, item: Problem = item) -> TuneProgress:
                return TuneProgress(item, trials, json_output=json_output,
                                    kernel=name if kernel is None else None)

            try:
                if kernel is not None:
                    with progress_for(kernel) as progress:
                        summary = run_tune(item, store, db_url, options, observer=progress,
                                           kernel_name=kernel)
                else:
                    summary = choose_kernel(item, store, db_url, candidates, options,
                                            observer_for=progress_for)
            except ProblemTooLarge as error:  # the other problems may fit: they are tuned
                typer.echo(f"error: {error}", err=True)
                failed += 1
                continue
            except (ConfigError, TimingError, StudyMismatchError) as error:  # nothing to tune
                typer.echo(f"error: {error}", err=True)
                raise typer.Exit(2) from None
            except ChipStateCorrupted as error:  # nothing more runs right in this process
                typer.echo(f"error: {error} (under --devices, a fresh worker process takes "
                           "over the device by itself)", err=True)
                raise typer.Exit(1) from None
            except NothingToPublish as error:  # the other problems are still tuned
                typer.echo(f"error: {error}", err=True)
                failed += 1
                continue
            except TuneInterrupted as stop:  # Ctrl-C: one line, the shell's status for SIGINT
                typer.echo(f"interrupted: {stop}", err=True)
                raise typer.Exit(130) from None
            _report(summary.to_dict(), json_output)
    if failed:
        raise typer.Exit(1)


def _problem_type(context: typer.Context, kernel: str | None, shapes: Path | None,
                  from_function: str | None, selection: Any) -> type:
    """The type of the problems ``kernel`` tunes (an attention call's without one); a serving
    kernel's come from a --shapes file only, on one device."""
    from kernel.registry import registered_kernel

    problem_type = registered_kernel(kernel).problem_type if kernel else Problem
    if problem_type is Problem:
        return problem_type
    other = [*problem_flags_given(context), *(["--from"] if from_function else []),
             *(["--devices"] if selection != 1 else [])]
    if other or not shapes:
        raise typer.BadParameter(
            f"kernel {kernel!r} tunes serving problems: give them in a --shapes file (a list "
            f"of {problem_type.__name__} objects, docs/serving.md), on one device"
            + (f"; not {', '.join(other)}" if other else ""), param_hint="--kernel")
    return problem_type


def _problems(context: typer.Context, problem: Problem, shapes: Path | None,
              from_function: str | None, args: str | None, host_only: bool,
              problem_type: type = Problem) -> list[Any]:
    """What to tune: the problems of a shapes file (of ``problem_type``), of a function's
    trace, or of the flags (one source only). ``host_only``: the devices are the workers';
    trace on the CPU."""
    given = [*problem_flags_given(context), *(["--shapes"] if shapes else [])]
    if from_function and given:
        raise typer.BadParameter("give --from, --shapes or the problem flags, one of them "
                                 f"(also given: {', '.join(given)})", param_hint="--from")
    if args is not None and not from_function:
        raise typer.BadParameter("--args gives the arguments of a --from function; give "
                                 "--from too", param_hint="--args")
    if from_function:
        from autotune.traced import TraceError, abstract_args, captured_problems, load_function

        if host_only:
            import jax

            jax.config.update("jax_platforms", "cpu")
        try:
            function, arguments = load_function(from_function), abstract_args(args)
        except TraceError as error:  # it names --from or --args
            raise typer.BadParameter(str(error)) from None
        try:
            return captured_problems(function, *arguments)
        except TraceError as error:
            raise typer.BadParameter(str(error), param_hint="--from") from None
    problems = given_problems(context, problem, shapes, problem_type)
    if shapes:
        _note_borrowed(shapes, problem_type)
    return problems


def _note_borrowed(shapes: Path, problem_type: type) -> None:
    """Says which problems of ``shapes`` (of ``problem_type``) ran on a config borrowed from
    the nearest tuned problem (an ``AUTOTUNE_RECORD_MISSES`` file marks them): they are tuned
    with the misses."""
    from kernel.misses import BORROWED_FROM
    from kernel.shapesfile import notes

    lent = [note for note in notes(shapes.read_text(encoding="utf-8"), problem_type)
            if note.startswith(BORROWED_FROM)]
    if lent:
        typer.echo(f"note: {shapes}: {len(lent)} problem(s) ran on a config borrowed from the "
                   f"nearest tuned problem ({lent[0]}{', ...' if len(lent) > 1 else ''}): "
                   "tuning gives each its own", err=True)


def _unfinished(problems: list[Problem], store: Any, device_kind: str, kernel: str | None,
                candidates: list[str], options: Any, json_output: bool) -> list[Problem]:
    """``problems`` but those already tuned (:func:`autotune.tune.finished_entry` of
    ``kernel``, or :func:`autotune.choice.finished_choice` among ``candidates``), which are
    said to be kept."""
    from autotune.choice import finished_choice
    from autotune.tune import finished_entry

    def finished(problem: Problem) -> bool:
        if kernel is not None:
            return finished_entry(store, device_kind, problem, kernel, options) is not None
        return finished_choice(store, device_kind, problem, candidates, options) is not None

    out = []
    for problem in problems:
        if finished(problem):
            say_finished(problem, json_output)
        else:
            out.append(problem)
    return out


def say_finished(problem: Problem, json_output: bool) -> None:
    """Says that ``problem`` is already tuned and is kept (nothing measured)."""
    note = "already tuned under the installed versions; kept (--force tunes it again)"
    if json_output:
        print(json.dumps({"problem": problem.to_dict(), "kept": note}), flush=True)
    else:
        typer.echo(f"{problem.label()}: {note}")


def _tune_on_workers(problems: list[Problem], devices: tuple[int, ...], platform: str,
                     db_url: str, kernel: str | None, options: Any, json_output: bool,
                     candidates: list[str]) -> None:
    from dataclasses import asdict

    from autotune.workers import WorkerPool, WorkersFailed, WorkersInterrupted

    pool = WorkerPool(problems, devices, platform, db_url=db_url, kernel=kernel,
                      options={k: v for k, v in asdict(options).items() if k != "device_index"},
                      json_output=json_output,
                      on_summary=lambda summary: _report(summary, json_output),
                      kernels=candidates)
    try:
        failed = pool.run()
    except WorkersFailed as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(error.status) from None
    except WorkersInterrupted as stop:  # Ctrl-C: one line, the shell's status for SIGINT
        typer.echo(f"interrupted: {stop}", err=True)
        raise typer.Exit(130) from None
    if failed:
        raise typer.Exit(1)


def _report(summary: dict[str, Any], json_output: bool) -> None:
    """Prints one problem's summary (``TuneSummary.to_dict()``, or ``ChoiceSummary``'s: the
    chosen kernel's with the kernel choice and each candidate's summary under ``tuned``), and
    that interpret-mode times are no device figure, where they are (once)."""
    if json_output:
        print(json.dumps({"summary": True, **summary}), flush=True)
    elif "chosen_kernel" in summary:
        for tuned in summary["tuned"].values():
            _print_tune(tuned, note=False)
        _print_choice(summary)
    else:
        _print_tune(summary, note=True)


def _print_choice(summary: dict[str, Any]) -> None:
    """The kernel choice's line: each candidate's confirmed time and the chosen one."""
    from rich.markup import escape  # stored and user strings (a study, an error) are no markup

    from autotune.progress import output_console

    times = ", ".join(
        f"{name} failed ({escape(summary['kernel_failures'][name])})" if ms is None else
        f"{name} {ms:.3f} ms ± {summary['kernels_iqr_ms'][name]:.3f}"
        for name, ms in summary["kernels"].items())
    output_console().print(
        f"[bold]chosen: {summary['chosen_kernel']}[/] for "
        f"{Problem.from_dict(summary['problem']).label()} on "
        f"{escape(summary['device_kind'])} "
        f"({_method_label(summary['choice_method'], summary)}, "
        f"{summary['choice_timing']}): {times}"
        + ("; the platform's default kernel kept: the faster one led within the measured "
           "noise" if summary["choice_within_noise"] else "")
        + " (each kernel's winner timed again, against the others, as the wrapper calls "
          "it: these times, not each tune's above, decide)" + _interpret_note(summary))


def _print_tune(summary: dict[str, Any], note: bool) -> None:
    """One kernel's tune line (``note``: with the interpret-mode note where it applies)."""
    from rich.markup import escape

    from autotune.progress import output_console
    from autotune.trials import NOTHING_TO_SEARCH
    from kernel.registry import registered_kernel

    tuned = registered_kernel(summary["kernel"])
    problem = tuned.problem_type.from_dict(summary["problem"])
    best = tuned.config_from_dict(summary["best_config"])
    tflops, fraction = summary["achieved_tflops"], summary["roofline_fraction"]
    roofline = ("no roofline (CPU)" if tflops is None
                else f"{tflops:.1f} TFLOP/s, " + ("no peaks known for this device"
                                                  if fraction is None else
                                                  f"{fraction:.0%} of the "
                                                  f"{summary['roofline_bound']} roofline"))
    one_config = summary["stop_reason"] == NOTHING_TO_SEARCH
    verdict = ("no tunable fields: its one config" if one_config else
               "the default stays: no candidate beat it beyond the measured noise"
               if summary["winner_is_default"] else "the default failed on this device"
               if summary["speedup"] is None else f"{summary['speedup']:.2f}x over the default")
    searched = "" if one_config else (f"{summary['measured']} measured{_stop_note(summary)}, "
                                      f"failures {escape(str(summary['failures'] or 'none'))}; ")
    output_console().print(
        f"[bold]{summary['kernel']} {problem.label()}[/] on {escape(summary['device_kind'])} "
        f"device {summary['device_index']} ({_method_label(summary['method'], summary)}, "
        f"timed by {summary['timing']}): "
        f"best {best.label(problem.mode)} at {summary['best_time_ms']:.3f} ms ({roofline}), "
        f"{verdict}; {searched}published: {summary['publish']}"
        + (f" (study {escape(repr(summary['study']))})" if summary["study"] else "")
        + (_interpret_note(summary) if note else ""))


def _stop_note(summary: dict[str, Any]) -> str:
    """Why a search measured fewer than --trials configs, said after their count ('' when it
    reached them)."""
    notes = {"patience": f"--patience {summary['patience']}: the last {summary['patience']} "
                         "brought no faster config",
             "timeout": "--timeout reached", "exhausted": "every legal config"}
    note = notes.get(summary["stop_reason"])
    return f" (stopped: {note})" if note else ""


def _interpret_note(summary: dict[str, Any]) -> str:
    """The note that interpret-mode times are no device figure, where the summary's are."""
    method = summary.get("choice_method") or summary["method"]
    return f" ({INTERPRET_NOTE})" if method == "interpret" else ""


def _method_label(method: str, summary: dict[str, Any]) -> str:
    """``method`` as what measured it: ``device`` on a CPU is the CPU itself (a kernel native
    to it, such as xla), no accelerator."""
    return "cpu" if method == "device" and summary.get("platform") == "cpu" else method
