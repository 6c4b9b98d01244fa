"""``autotune serve``: run the lookup service under uvicorn."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from autotune.commands.db import DbOption, open_store


def serve(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.", min=0, max=65535)] = 8000,
    db: DbOption = None,
    workers: Annotated[int, typer.Option(help="Worker processes.", min=1)] = 1,
    allow_anonymous_writes: Annotated[bool, typer.Option(
        "--allow-anonymous-writes",
        help="Accept writes without a bearer token (default: writes need AUTOTUNE_API_TOKEN).",
    )] = False,
    access_log: Annotated[bool, typer.Option(help="Log every request.")] = False,
) -> None:
    """Serve tuned configs over HTTP (reads open; writes need AUTOTUNE_API_TOKEN)."""
    import uvicorn

    store = open_store(db)  # refuses a missing or old schema, naming `autotune db upgrade`
    url = store.url
    store.close()
    # Worker processes build their app from the environment (api.main:create_app, factory).
    os.environ["AUTOTUNE_DB_URL"] = url
    if allow_anonymous_writes:
        os.environ["AUTOTUNE_ALLOW_ANONYMOUS_WRITES"] = "true"
    elif not os.environ.get("AUTOTUNE_API_TOKEN"):
        typer.echo("warning: AUTOTUNE_API_TOKEN is not set, so writes are refused; set it or "
                   "pass --allow-anonymous-writes", err=True)
    uvicorn.run("api.main:create_app", factory=True, host=host, port=port, workers=workers,
                access_log=access_log, log_level="info")
