"""``autotune replay``: run the search engine on a measured landscape file (no accelerator)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def replay(
    landscape: Annotated[Path, typer.Argument(help="A landscape file (*.json.gz, format in "
                                              "bench/search/landscapes/README.md).")],
    budget: Annotated[int, typer.Option(min=1, help="Measured configs to spend.")] = 100,
    seed: Annotated[int, typer.Option(help="Random seed of the sampler.")] = 0,
    sampler: Annotated[str, typer.Option(help="tpe | random | grid | plain-tpe.")] = "tpe",
    db: Annotated[str | None, typer.Option(help="Optuna storage URL (e.g. sqlite:///replay.db);"
                                           " default: in memory.")] = None,
    study: Annotated[str | None, typer.Option(help="Study name (default: landscape name, "
                                              "sampler and seed).")] = None,
    warm_from: Annotated[Path | None, typer.Option(
        help="Warm start: seed the search with the best configs of this other landscape of the "
             "same kernel (a neighbouring problem already tuned), as tune seeds with the "
             "winners of the nearest tuned problems; a config one step from a seed already "
             "taken is skipped (near-duplicates transfer together or not at all).")] = None,
    warm_top: Annotated[int | None, typer.Option(
        min=1, help="How many of --warm-from's best configs to seed with (default: as many as "
                    "tune takes).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Replay a search on a measured landscape and print how close it got to the optimum."""
    import optuna

    from autotune.commands.db import database_errors, resolve_url
    from autotune.landscape import LandscapeError, load_landscape
    from autotune.samplers import SAMPLERS
    from autotune.search import StudyMismatchError, search
    from autotune.tune import MAX_WARM_SEEDS

    if sampler not in SAMPLERS:
        raise typer.BadParameter(f"unknown sampler {sampler!r}; choose one of "
                                 f"{', '.join(SAMPLERS)}", param_hint="--sampler")
    if warm_top is not None and warm_from is None:
        raise typer.BadParameter("--warm-top needs --warm-from (the landscape to seed from)",
                                 param_hint="--warm-top")
    try:
        land = load_landscape(landscape)
        seeds = [] if warm_from is None else land.warm_seeds(load_landscape(warm_from),
                                                             warm_top or MAX_WARM_SEEDS)
    except LandscapeError as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = resolve_url(db) if db else None
    try:
        with database_errors(url or "in memory"):
            result = search(land.space, land.measure, storage=url, trials=budget, seed=seed,
                            sampler=sampler, seeds=seeds,  # type: ignore[arg-type]
                            study_name=study or f"replay-{land.name}-{sampler}-{seed}",
                            of={"landscape": land.name})
    except StudyMismatchError as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None
    best = result.best.value if result.best else None
    out = {
        "landscape": land.name,
        "sampler": sampler,
        "seed": seed,
        "warm_seeds": seeds,
        "best_time_ms": best,
        "optimum_ms": land.optimum_ms,
        "measured": result.measured,
        "score": land.score(best),
        "best_config": result.best.config if result.best else None,
        "stop_reason": result.stop_reason,
        "overhead_ms_per_trial": round(1000 * result.overhead_per_trial_s, 3),
        "curve": result.curve,
    }
    if as_json:
        typer.echo(json.dumps(out))
        return
    from rich.console import Console
    from rich.markup import escape  # a landscape's name and values are no markup
    from rich.table import Table

    table = Table(title=escape(f"replay {land.name} ({sampler}, seed {seed})"),
                  show_header=False)
    for name in ("best_time_ms", "optimum_ms", "measured", "score", "best_config",
                 "stop_reason", "overhead_ms_per_trial"):
        value = out[name]
        table.add_row(name, f"{value:.4g}" if isinstance(value, float) else escape(str(value)))
    Console().print(table)
    curve = ", ".join("-" if v is None else f"{v:.4g}" for v in result.curve)
    typer.echo(f"best-so-far curve (ms): [{curve}]")
