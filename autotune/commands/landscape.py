"""``autotune landscape``: write a tuning study's measured configs as a landscape file, which
``autotune replay`` and ``bench/search/replay.py`` replay like the published ones."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from autotune.commands.db import DbOption, database_errors, open_store
from autotune.files import is_stdout
from autotune.problem_options import output_file


def landscape(
    study: Annotated[str, typer.Argument(
        help="The study's name, as `autotune tune` prints it ('study' in its --json summary).")],
    output: Annotated[Path, typer.Option("-o", "--output", parser=output_file, metavar="<file>",
                                         help="Where to write the landscape (*.json.gz).")],
    partial: Annotated[bool, typer.Option(
        help="Write a study that did not measure its whole legal space (its unmeasured configs "
             "then replay as illegal).")] = False,
    db: DbOption = None,
) -> None:
    """Write a study's measured configs as a landscape file (format in
    bench/search/landscapes/README.md). Record one with `autotune tune ... --sampler grid
    --trials N`, N above the legal space, so that the search ends on 'exhausted'."""
    if not output.name.endswith(".json.gz"):
        raise typer.BadParameter(f"{output}: name the file *.json.gz (gzip JSON), as "
                                 "`autotune replay` and bench/search/replay.py expect",
                                 param_hint="--output")
    import optuna

    from autotune.landscape import LandscapeError, save_landscape, study_document
    from storage import shown_url
    from storage.studies import get_storage

    with open_store(db) as store, database_errors(store.url):
        storage = get_storage(store.url, create=False)
        names = [] if storage is None else optuna.get_all_study_names(storage)
        if study not in names:
            holds = ", ".join(map(repr, sorted(names))) or "no study"
            typer.echo(f"error: no study {study!r} in {shown_url(store.url)}"
                       f"; it holds {holds}", err=True)
            raise typer.Exit(1)
        try:
            document = study_document(optuna.load_study(study_name=study, storage=storage),
                                      partial=partial)
        except LandscapeError as error:
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(1) from None
    try:
        save_landscape(document, output)
    except OSError as error:
        typer.echo(f"error: cannot write {output}: {error.strerror}", err=True)
        raise typer.Exit(1) from None
    ok = sum(r["status"] == "ok" for r in document["records"])
    typer.echo(f"wrote {output}: {len(document['records'])} configs ({ok} ok) of "
               f"{document['kernel']} on {document['device']}"
               + ("" if document["complete"] else "; partial: unmeasured configs replay as "
                  "illegal"), err=is_stdout(output))
