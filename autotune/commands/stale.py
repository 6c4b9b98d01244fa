"""``autotune stale``: the stored configs tuned under other jax, jaxlib or libtpu versions than
the installed ones, or timed by a retired timing method (``profile``, the named kernels only),
and the commands that re-tune them."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import shlex
from pathlib import Path
from typing import Annotated

import typer

from autotune.commands.db import DbOption, reading_store
from kernel import Problem, get_kernel, kernel_names


def shapes_file_name(kernel: str, device_kind: str, taken: set[str]) -> str:
    """``stale-<kernel>-<device kind>.json``, the device kind in lower-case words, made unique
    among the names in ``taken`` by a hash of the exact device kind ("TPU v5 lite" and
    "TPU v5-lite" are two kinds; one of no ASCII letters or digits has no words), and if that
    is taken too (kind "X" hashes to the words of kind "x c032adc1"), by a count."""
    words = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-")
    digest = hashlib.sha1(device_kind.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    stems = ([words] if words else []) + [f"{words + '-' if words else ''}{digest}"]
    names = (f"stale-{kernel}-{stem}.json" for stem in stems)
    counted = (f"stale-{kernel}-{stems[-1]}-{n}.json" for n in itertools.count(2))
    return next(name for name in itertools.chain(names, counted) if name not in taken)


def stale(
    db: DbOption = None,
    output_dir: Annotated[Path, typer.Option(
        "--output-dir", file_okay=False,
        help="Where to write the shapes files of the re-tune commands.")] = Path("."),
) -> None:
    """List the tuned configs whose jax, jaxlib or libtpu version differs from the installed
    one, or timed by a retired timing method (still legal, maybe no longer the fastest), and
    write per kernel and device kind a shapes file with the `autotune tune` command that
    re-tunes them there. Only entries of the installed kernel versions count: a re-tune
    publishes under those, so it would never replace an entry of another version (they are
    counted, not listed)."""
    from rich.console import Console
    from rich.markup import escape  # stored strings (a device kind) are no markup
    from rich.table import Table

    from kernel.resolve import installed_versions
    from storage import shown_url

    with reading_store(db) as store:
        url = shown_url(store.url)
        secret = url != store.url  # a password, masked in ``url``
        entries, _ = store.list(limit=None)
    console = Console()
    installed = installed_versions()
    here = ", ".join(f"{package} {version}" for package, version in installed.items() if version)
    kernel_versions = {name: get_kernel(name).version for name in kernel_names()}
    groups: dict[tuple[str, str], dict[Problem, None]] = {}  # problems once, in order
    other_versions = 0
    table = Table(title=escape(f"configs tuned under other versions than this environment's "
                               f"({here}) or timed by a retired method"))
    for column in ("kernel", "device kind", "problem", "config", "tuned under"):
        table.add_column(column)
    for entry in entries:
        result = entry.result
        changes = result.stale_versions(installed)
        if not changes:
            continue
        if result.kernel_version != kernel_versions.get(result.kernel):  # or not installed
            other_versions += 1
            continue
        groups.setdefault((result.kernel, result.device_kind), {})[result.problem] = None
        table.add_row(*map(escape, (result.kernel, result.device_kind, result.problem.label(),
                                    result.config.label(result.problem.mode), changes)))
    if other_versions:
        console.print(f"left out: {other_versions} stale config(s) of other kernel versions "
                      "than the installed ones (a re-tune publishes under the installed "
                      "version, so it never replaces them)", highlight=False)
    if not groups:
        counted = (f"all {len(entries) - other_versions} of the installed kernel versions"
                   if other_versions else f"all {len(entries)}")
        console.print(escape(f"no stale configs: {counted} were tuned under this environment's"
                             f" versions ({here}) or recorded none, and timed by a current "
                             "method"))
        return
    console.print(table)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        names: set[str] = set()
        for (kernel, device_kind), problems in groups.items():
            names.add(name := shapes_file_name(kernel, device_kind, names))
            path = output_dir / name
            path.write_text(json.dumps([p.to_dict() for p in problems], indent=2) + "\n")
            command = shlex.join(["autotune", "tune", "--kernel", kernel, "--shapes", str(path),
                                  "--force", "--db", *([] if secret else [url])])
            if secret:  # a masked password cannot run: the variable holds the real URL
                command += ' "$AUTOTUNE_DB_URL"'
            console.print(escape(f"re-tune the {len(problems)} stale {kernel} config(s) on a "
                                 f"{device_kind!r} device (--force replaces the stored timings "
                                 f"measured under the old versions or method):\n  {command}"),
                          soft_wrap=True, highlight=False)
    except OSError as error:
        typer.echo(f"error: cannot write the shapes file: {error}", err=True)
        raise typer.Exit(1) from None
