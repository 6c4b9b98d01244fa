"""``autotune serve``: run the lookup service under uvicorn, with connection limits."""

from __future__ import annotations

import os
import resource
from typing import TYPE_CHECKING, Annotated

import typer

from autotune.commands.db import DbOption, open_store

if TYPE_CHECKING:
    from api.settings import ApiSettings

# The listen backlog, which is also how many connections asyncio accepts in one go, before the
# protocol can refuse those beyond the limit: a few such batches may be open at once.
ACCEPT_BATCH = 64
SPARE_FILE_DESCRIPTORS = 64  # per worker: database pool, logs, the listening socket


def _limits() -> ApiSettings:
    """The settings from the environment, with enough file descriptors for
    ``AUTOTUNE_MAX_CONNECTIONS`` (the soft limit raised if needed); exits 2 saying why not."""
    from pydantic import ValidationError

    from api.settings import ApiSettings

    try:
        settings = ApiSettings()
    except ValidationError as error:
        problems = "; ".join(f"AUTOTUNE_{str(e['loc'][0]).upper()}: {e['msg']}"
                             for e in error.errors())
        typer.echo(f"error: {problems}", err=True)
        raise typer.Exit(2) from None
    needed = settings.max_connections + 4 * ACCEPT_BATCH + SPARE_FILE_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            typer.echo(f"error: AUTOTUNE_MAX_CONNECTIONS={settings.max_connections} needs "
                       f"{needed} file descriptors per worker, but `ulimit -n` allows at most "
                       f"{hard}; lower AUTOTUNE_MAX_CONNECTIONS or raise the limit", err=True)
            raise typer.Exit(2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return settings


def serve(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.", min=0, max=65535,
                                      metavar="PORT")] = 8000,
    db: DbOption = None,
    workers: Annotated[int, typer.Option(help="Worker processes.", min=1)] = 1,
    allow_anonymous_writes: Annotated[bool, typer.Option(
        "--allow-anonymous-writes",
        help="Accept writes without a bearer token (default: writes need AUTOTUNE_API_TOKEN).",
    )] = False,
    access_log: Annotated[bool, typer.Option("--access-log", help="Log every request.")] = False,
) -> None:
    """Serve tuned configs over HTTP (reads open; writes need AUTOTUNE_API_TOKEN).

    Per worker, AUTOTUNE_MAX_CONNECTIONS connections (more get a 503), AUTOTUNE_KEEP_ALIVE_S
    idle seconds between requests and AUTOTUNE_READ_TIMEOUT_S to send a whole request."""
    import uvicorn

    settings = _limits()
    if settings.api_token is not None and (allow_anonymous_writes
                                           or settings.allow_anonymous_writes):
        typer.echo("error: AUTOTUNE_API_TOKEN is set and anonymous writes are allowed "
                   "(--allow-anonymous-writes or AUTOTUNE_ALLOW_ANONYMOUS_WRITES), which would "
                   "accept writes without the token; drop one of the two", err=True)
        raise typer.Exit(2)
    store = open_store(db)  # refuses a missing or old schema, naming `autotune db upgrade`
    url = store.url
    store.close()
    # Worker processes build their app from the environment (api.main:create_app, factory).
    os.environ["AUTOTUNE_DB_URL"] = url
    if allow_anonymous_writes:
        os.environ["AUTOTUNE_ALLOW_ANONYMOUS_WRITES"] = "true"
    elif settings.api_token is None:
        typer.echo("warning: AUTOTUNE_API_TOKEN is not set, so writes are refused; set it or "
                   "pass --allow-anonymous-writes", err=True)
    uvicorn.run("api.main:create_app", factory=True, host=host, port=port, workers=workers,
                access_log=access_log, log_level="info", http="api.server:LimitedH11Protocol",
                limit_concurrency=settings.max_connections, backlog=ACCEPT_BATCH,
                timeout_keep_alive=settings.keep_alive_s)
