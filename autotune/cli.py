"""The ``autotune`` command line. Each command imports its heavy dependencies lazily, so that
``autotune serve`` never loads jax and ``autotune precheck`` never loads the web stack. The
console script enters through ``autotune.__main__``, which first checks the command's extra."""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperOption

app = typer.Typer(
    name="autotune",
    help="Find, store and serve the fastest flash-attention tile shapes per shape and chip.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def root() -> None:
    """Find, store and serve the fastest flash-attention tile shapes per shape and chip."""


def main() -> None:
    without_flag_types(typer.main.get_command(app))(prog_name="autotune")


def without_flag_types(command: Any) -> Any:
    """``command`` (a command Typer built, and its subcommands) with no type shown for a flag
    in its help: Typer shows one (``--force <bool>``), as though the flag took a value."""
    help_option = command.get_help_option(command.context_class(command))  # made once, kept
    for param in [*command.params, help_option]:
        if isinstance(param, TyperOption) and param.is_flag:
            param.metavar = ""
    for subcommand in getattr(command, "commands", {}).values():
        without_flag_types(subcommand)
    return command


from autotune.commands import precheck  # noqa: E402

app.command()(precheck.precheck)

from autotune.commands import db, serve, tables  # noqa: E402

app.add_typer(db.app, name="db")
app.command()(serve.serve)
app.command("export")(tables.export_table)
app.command("import")(tables.import_table)

from autotune.commands import tune  # noqa: E402

app.command()(tune.tune)
from autotune.commands import demo  # noqa: E402

app.command()(demo.demo)
from autotune.commands import report  # noqa: E402

app.command()(report.report)
from autotune.commands import replay  # noqa: E402

app.command()(replay.replay)
from autotune.commands import landscape  # noqa: E402

app.command()(landscape.landscape)
from autotune.commands import stale  # noqa: E402

app.command()(stale.stale)
