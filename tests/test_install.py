"""Install sets: the bare wheel in a fresh virtual environment is what a model build gets (jax
and ``kernel``); every ``autotune`` command names the extra it needs."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

from autotune.cli import app
from autotune.extras import COMMAND_EXTRAS, EXTRA_MODULES

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = [p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]

# Runs in the bare environment: a pinned table drives kernel.flash_attention on the CPU.
MODEL_BUILD = """
import importlib.util, json, sys
import jax, jax.numpy as jnp, numpy as np
import kernel

absent = [m for m in ("optuna", "sqlalchemy", "fastapi", "matplotlib", "typer", "sklearn")
          if importlib.util.find_spec(m) is not None]
assert not absent, f"the bare install brought {absent}"

problem = kernel.Problem(batch=1, q_heads=4, kv_heads=2, q_len=256, kv_len=256, head_dim=64,
                         dtype="float32", causal=True, mode="fwd")
tuned = kernel.FlashConfig(block_q=128, block_kv=256, block_kv_compute=128)
assert tuned != kernel.get_kernel("flash").default_config(problem)
table = kernel.LookupTable(kernel="flash", kernel_version="1", device_kind="cpu",
                           entries=(kernel.TableEntry(problem, tuned),))
with open(sys.argv[1], "w") as f:
    json.dump(table.to_dict(), f)
kernel.use_table(sys.argv[1])

keys = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(keys[0], (1, 4, 256, 64), jnp.float32)
k, v = (jax.random.normal(key, (1, 2, 256, 64), jnp.float32) for key in keys[1:])
out = jax.jit(lambda q, k, v: kernel.flash_attention(q, k, v, causal=True))(q, k, v)
layout = lambda x: jnp.swapaxes(x, 1, 2)  # [batch, seq, heads, dim] for jax.nn
want = layout(jax.nn.dot_product_attention(layout(q), layout(k), layout(v), is_causal=True))
np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-4, atol=1e-4)
print(json.dumps({f"{name}/{device}": source.split(", config")[0] for (name, device, _), source
                  in kernel.resolution_sources().items()}))
"""


@pytest.fixture(scope="module")
def bare_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment holding the wheel without extras (its dependencies pinned
    to this environment's versions, so pip reuses what it already fetched)."""
    tmp = tmp_path_factory.mktemp("bare")
    source = tmp / "source"  # the packaged files only: no build leftovers of the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--quiet"]
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--verbose", "--no-deps",
                            "--wheel-dir", tmp / "dist", source], check=True,
                           capture_output=True, text=True, timeout=300, env=_environment())
    (tmp / "build.log").write_text(built.stdout + built.stderr)  # the build backend's words
    wheel, = (tmp / "dist").glob("flash_autotune-*.whl")
    constraints = tmp / "constraints.txt"
    constraints.write_text("".join(
        f"{d.metadata['Name']}=={d.version}\n" for d in importlib.metadata.distributions()
        if d.metadata["Name"] != "flash-autotune"))
    venv.create(tmp / "venv", with_pip=False)
    python = tmp / "venv" / "bin" / "python"
    subprocess.run([*pip, "--python", python, "install", "--constraint", constraints, wheel],
                   check=True, capture_output=True, text=True, timeout=600, env=_environment())
    return tmp / "venv"


def _environment() -> dict[str, str]:
    """This environment without the checkout on the path (only the installed wheel counts)
    and without a lookup service or table."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "AUTOTUNE_URL", "AUTOTUNE_TABLE")}


def _run(env: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300,
                          env=_environment(), cwd=env)


def test_the_wheel_builds_without_a_deprecation_warning(bare_env: Path) -> None:
    """Issue 75 item 8: setuptools warned that ``project.license`` as a TOML table is
    deprecated (an error from 2027-02-18)."""
    log = (bare_env.parent / "build.log").read_text()
    assert "Successfully built flash-autotune" in log, log[-2000:]
    assert "BuildBackendWarning" not in log and "deprecated" not in log.lower(), log


def test_bare_install_runs_a_pinned_table_on_cpu_without_the_tuning_or_service_stack(
        bare_env: Path, tmp_path: Path) -> None:
    result = _run(bare_env, bare_env / "bin" / "python", "-c", MODEL_BUILD,
                  tmp_path / "table.json")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == '{"flash/cpu": "table, exact"}'


@pytest.mark.parametrize("args, extra", [
    (["serve"], "serve"), (["db", "upgrade"], "serve"), (["tune", "--q-len", "256"], "tune"),
    (["demo"], "tune,serve"), (["precheck"], "tune,tpu")])
def test_bare_install_commands_name_the_missing_extra(bare_env: Path, args: list[str],
                                                      extra: str) -> None:
    result = _run(bare_env, bare_env / "bin" / "autotune", *args)
    assert result.returncode == 2
    assert f"pip install 'flash-autotune[{extra}]'" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_bare_install_without_a_command_names_every_extra(bare_env: Path) -> None:
    result = _run(bare_env, bare_env / "bin" / "autotune", "--help")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "[serve]: db, serve;" in result.stderr
    assert "pip install 'flash-autotune[all]'" in result.stderr


def test_every_command_declares_its_extra() -> None:
    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    commands |= {group.name for group in app.registered_groups}
    assert commands == set(COMMAND_EXTRAS)
    for choices in COMMAND_EXTRAS.values():
        for extras in choices:
            assert set(extras.split(",")) <= set(EXTRA_MODULES)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_normalized(re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0]) for r in requirements}


def test_each_extra_installs_the_modules_the_guard_checks() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    provided_by = importlib.metadata.packages_distributions()
    for extra, modules in EXTRA_MODULES.items():
        names = _requirement_names(extras[extra])
        if extra == "tpu":  # jax[tpu] brings libtpu
            names.add("libtpu")
        for module in modules:
            dists = {_normalized(d) for d in provided_by.get(module, [])}
            assert dists & names, f"extra {extra!r} does not install module {module!r}"
    assert _requirement_names(PYPROJECT["project"]["dependencies"]) == {"jax"}
    assert extras["all"] == ["flash-autotune[tune,serve,tpu]"]
    assert "flash-autotune[all]" in extras["test"]
