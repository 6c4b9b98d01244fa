"""``autotune demo``: the whole loop on the local device, end to end."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Annotated

import typer

from autotune.commands.db import DbOption, ensure_schema, open_store, resolve_url
from kernel import Problem
from present.text import INTERPRET_NOTE

DEMO_PROBLEM = Problem(batch=1, q_heads=4, kv_heads=2, q_len=512, kv_len=512, head_dim=128,
                       dtype="bfloat16", causal=True, mode="fwd")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(db_url: str, port: int) -> subprocess.Popen:
    """``autotune serve`` in a subprocess, once it answers /readyz."""
    import httpx

    process = subprocess.Popen([sys.executable, "-m", "autotune", "serve", "--db", db_url,
                                "--port", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"autotune serve exited: {process.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("autotune serve did not become ready within 60 s")


def demo(
    db: DbOption = None,
    trials: Annotated[int, typer.Option(min=2, help="Measured configs.")] = 10,
) -> None:
    """Tune a small attention problem on this device, publish the winner, serve it over HTTP,
    and show the kernel wrapper resolving that config from the service at trace time."""
    from rich.console import Console
    from rich.markup import escape

    from autotune.progress import TuneProgress
    from autotune.tune import TuneOptions, tune

    console = Console()
    db_url = resolve_url(db)
    ensure_schema(db_url)
    store = open_store(db_url)
    console.rule("1. tune")
    try:
        with TuneProgress(DEMO_PROBLEM, trials) as progress:
            summary = tune(DEMO_PROBLEM, store, db_url, TuneOptions(trials=trials),
                           observer=progress, kernel_name=_wrapper_kernel())
        # What the service serves: this winner, or a faster one stored before ("kept").
        published = store.lookup(summary.kernel, summary.device_kind, DEMO_PROBLEM)
    finally:
        store.close()
    default = ("the default failed" if summary.default_time_ms is None
               else f"default {summary.default_time_ms:.3f} ms")
    console.print(f"winner {summary.best_config.label(DEMO_PROBLEM.mode)}: "
                  f"{summary.best_time_ms:.3f} ms vs {default} on {summary.device_kind} "
                  f"({summary.method}); stored: {summary.publish}")
    if published is not None and summary.publish == "kept":
        stored = published[0].result
        console.print(f"the stored {stored.config.label(DEMO_PROBLEM.mode)} "
                      f"({stored.median_ms:.3f} ms) stays, and is what the service serves: "
                      "this run's winner is not faster than it beyond the noise")
    if summary.method == "interpret":
        console.print(f"({INTERPRET_NOTE})")

    console.rule("2. serve")
    port = _free_port()
    server = _start_server(db_url, port)
    url = f"http://127.0.0.1:{port}"
    console.print(f"autotune serve on {url} (database {escape(db_url)})")
    try:
        console.rule("3. resolve at trace time")
        source, config, error = _trace_with_service(url)
    finally:
        server.terminate()
        server.wait(timeout=15)
    console.print(f"kernel.flash_attention traced {DEMO_PROBLEM.label()}: config "
                  f"{config.label(DEMO_PROBLEM.mode)} from [bold]{source}[/]; max error vs XLA "
                  f"reference {error:.2e}")
    if source != "service" or published is None or config != published[0].result.config:
        console.print("[red]the traced config is not the one the service published[/]")
        raise typer.Exit(1)
    console.print("[green]the wrapper used the tuned config served over HTTP[/]")


def _wrapper_kernel() -> str:
    """The kernel ``kernel.flash_attention`` runs on this device."""
    import jax

    from kernel.resolve import get_resolver

    return get_resolver().platform_kernel(jax.devices()[0].platform).name


def _trace_with_service(url: str) -> tuple[str, object, float]:
    """Jits the kernel with ``AUTOTUNE_URL`` pointing at the service; returns the resolution
    source, the config used and the error against the reference."""
    import jax
    import jax.numpy as jnp

    import kernel
    from kernel.resolve import reset_resolver

    os.environ["AUTOTUNE_URL"] = url
    resolver = reset_resolver()
    p = DEMO_PROBLEM
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (p.batch, p.q_heads, p.q_len, p.head_dim), p.dtype)
    k, v = (jax.random.normal(key, (p.batch, p.kv_heads, p.kv_len, p.head_dim), p.dtype)
            for key in keys[1:])
    attend = jax.jit(lambda q, k, v: kernel.flash_attention(q, k, v, causal=p.causal))
    out = attend(q, k, v)
    want = kernel.reference_attention(q, k, v, causal=p.causal)
    error = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))))
    device = jax.devices()[0]
    resolution = resolver.resolve(p, device.device_kind, _wrapper_kernel(),
                                  kernel.device_target(device.platform, device.device_kind))
    return resolution.source, resolution.config, error
