"""``autotune precheck``: compile the whole search space for a TPU generation on this CPU."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from autotune.problem_options import (KernelOption, ShapesOption, given_problems,
                                      with_problem_options)
from kernel import DEFAULT_KERNEL, TARGETS, Problem, get_target


@with_problem_options
def precheck(
    context: typer.Context,
    problem: Problem,
    shapes: ShapesOption = None,
    target: Annotated[str, typer.Option(help="TPU generation: v4, v5e, v5p or v6e.")] = "v5e",
    kernel: KernelOption = DEFAULT_KERNEL,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per config, "
                                              "then a summary object per problem.")] = False,
    jobs: Annotated[int, typer.Option(min=1, help="Parallel compiler processes.")] = 2,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds allowed per compile.")] = 300,
    include_rejected: Annotated[bool, typer.Option(
        "--include-rejected",
        help="Also compile the configs the VMEM estimate rejects (to measure it).")] = False,
    vmem_limit_kib: Annotated[int | None, typer.Option(
        min=1, help="Scoped VMEM limit to check and compile against (default: the target's).")]
    = None,
) -> None:
    """Compile every legal config of a TPU kernel for a TPU generation (no TPU needed; needs
    libtpu) and report ok / vmem_oom / compile_error / timeout per config, with compile
    seconds; per problem of --shapes, each in turn."""
    from autotune.precheck import vmem_limited
    from kernel import ConfigError, get_kernel

    if target not in TARGETS or TARGETS[target].topology is None:
        raise typer.BadParameter(f"{target!r} is not a TPU generation; use v4, v5e, v5p or v6e",
                                 param_hint="--target")
    problems = given_problems(context, problem, shapes)
    rules = get_kernel(kernel).discover()
    try:  # a GPU kernel has no TPU generation to compile for; a problem it cannot run
        for problem in problems:
            rules.check_runs(problem, get_target(target))
        tpu = rules.target(get_target(target))
    except ConfigError as error:
        raise typer.BadParameter(str(error), param_hint="--kernel") from None
    tpu = vmem_limited(tpu, vmem_limit_kib * 1024 if vmem_limit_kib else None)
    options = {"xla_tpu_scoped_vmem_limit_kib": vmem_limit_kib} if vmem_limit_kib else None
    for problem in problems:
        _precheck_one(problem, rules, tpu, json_output=json_output, jobs=jobs,
                      timeout_s=timeout, include_rejected=include_rejected,
                      compiler_options=options)


def _precheck_one(problem: Problem, rules, tpu, *, json_output: bool,  # noqa: ANN001
                  include_rejected: bool, **precheck_options) -> None:  # noqa: ANN003
    """Compiles ``problem``'s configs and prints the per-config results and their summary."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from autotune.precheck import Agreement, candidates, precheck as run_precheck
    from autotune.progress import output_console

    total = len(candidates(problem, tpu, rules, include_rejected=include_rejected))
    console = output_console(stderr=json_output)
    with Progress(TextColumn("[bold]precheck {task.description}"), BarColumn(),
                  MofNCompleteColumn(), TextColumn("{task.fields[counts]}"),
                  console=console, transient=json_output) as progress:
        task = progress.add_task(f"{rules.name} {tpu.name} {problem.label()}", total=total,
                                 counts="")
        counts: dict[str, int] = {}

        def on_result(result):  # noqa: ANN001, ANN202 - a local callback
            counts[result.status] = counts.get(result.status, 0) + 1
            progress.update(task, advance=1, counts=" ".join(f"{k}={v}" for k, v in
                                                             sorted(counts.items())))
            if json_output:
                print(json.dumps(result.to_dict()), flush=True)

        results = run_precheck(problem, tpu, rules, include_rejected=include_rejected,
                               on_result=on_result, **precheck_options)
    agreement = Agreement.of(results)
    if json_output:
        print(json.dumps(agreement.to_dict()))
        return
    _print_table(console, results, agreement, problem.mode)


def _print_table(console, results, agreement, mode: str) -> None:  # noqa: ANN001
    """The results, each config labelled with the fields ``mode`` compiles."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="precheck")
    for column in ("config", "predicted fit", "status", "compile s", "error"):
        table.add_column(column)
    for r in sorted(results, key=lambda r: (r.status, r.compile_s)):
        table.add_row(r.config.label(mode), "yes" if r.predicted_fit else "no", str(r.status),
                      f"{r.compile_s:.2f}", escape(r.error or ""))  # compiler text: no markup
    console.print(table)
    fmt = lambda x: "n/a" if x is None else f"{x:.1%}"  # noqa: E731
    console.print(f"estimate admits {agreement.admitted}, of which {agreement.admitted_ok} "
                  f"compile (precision {fmt(agreement.precision)}); the compiler accepts "
                  f"{agreement.compiled_ok}, of which the estimate admits {agreement.admitted_ok} "
                  f"(recall {fmt(agreement.recall)})")
