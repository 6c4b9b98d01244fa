"""``autotune report``: write one self-contained HTML file of what tuning found."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from autotune.commands.db import DbOption, reading_store
from autotune.files import is_stdout, write_output
from autotune.problem_options import output_file
from kernel.problem import DTYPES, MODES


def report(
    output: Annotated[Path, typer.Option("-o", "--output", parser=output_file, metavar="<file>",
                                         help="Where to write the HTML file (- for stdout).")]
    = Path("report.html"),
    device_kind: Annotated[str | None, typer.Option(
        help="Only this device kind, as JAX reports it, e.g. 'TPU v5 lite'.",
        show_default=False)] = None,
    dtype: Annotated[str | None, typer.Option(
        help=f"Only problems of this dtype ({' | '.join(DTYPES)}).", show_default=False)] = None,
    mode: Annotated[str | None, typer.Option(
        help=f"Only problems of this mode ({' | '.join(MODES)}).", show_default=False)] = None,
    head_dim: Annotated[int | None, typer.Option(
        min=1, help="Only problems of this head_dim.", show_default=False)] = None,
    db: DbOption = None,
) -> None:
    """Write an HTML report of the tuned configs: an index per device kind, and per problem
    the time landscape, the convergence, the confirmation runs and the failures."""
    for name, value, allowed in (("--dtype", dtype, DTYPES), ("--mode", mode, MODES)):
        if value is not None and value not in allowed:
            raise typer.BadParameter(f"{value!r}: use one of {', '.join(allowed)}",
                                     param_hint=name)
    filters = {name: value for name, value in (("device_kind", device_kind), ("dtype", dtype),
                                                ("mode", mode), ("head_dim", head_dim))
               if value is not None}

    from autotune.report import ReportError, render

    with reading_store(db) as store:
        try:
            html = render(store, filters)
        except ReportError as error:
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(1) from None
    try:
        write_output(output, html.encode("utf-8"))
    except OSError as error:
        typer.echo(f"error: cannot write {output}: {error.strerror}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {output} ({len(html) // 1024} KiB)", err=is_stdout(output))
