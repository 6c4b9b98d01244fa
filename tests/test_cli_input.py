"""Hostile or awkward input to the CLI (issue 46, A7, A9, A10, item 11): Rich markup in stored
and user strings, YAML alias bombs, large shapes files, and ``--shapes`` on every command that
takes a problem."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from autotune.commands.tune import _report
from autotune.problem_options import ShapesOption, given_problems, load_shapes, \
    with_problem_options
from kernel import Problem, get_kernel
from kernel.resolve import installed_versions
from kernel.shapesfile import MAX_SHAPES_BYTES, append_shapes, save_shapes
from storage import Store, TunedResult
from tests.conftest import problem_flags, run_cli

OLD = {**{f"{p}_version": v for p, v in installed_versions().items()}, "jax_version": "0.4.1"}
PROBLEM = Problem(batch=1, q_heads=2, kv_heads=2, q_len=128, kv_len=128, head_dim=64,
                  dtype="float32", causal=False, mode="fwd")
# ~500 bytes whose batch expands to 9**9 (387M) scalars: each anchor repeats the last nine times.
BOMB = "- {q_heads: 1, q_len: 8, head_dim: 8, batch: [&a [x,x,x,x,x,x,x,x,x], " + ", ".join(
    f"&{b} [*{a},*{a},*{a},*{a},*{a},*{a},*{a},*{a},*{a}]"
    for a, b in zip("abcdefgh", "bcdefghi")) + "]}\n"


def test_stale_prints_markup_in_a_device_kind_as_text(sqlite_db_url: str, tmp_path: Path) -> None:
    """A7: a device kind holding ``[/x]`` crashed ``stale`` (Rich read it as a closing tag)."""
    with Store(sqlite_db_url) as store:
        store.publish(TunedResult(device_kind="evil [/x] kind", problem=PROBLEM, median_ms=1.0,
                                  config=get_kernel("flash").default_config(PROBLEM), **OLD))
    done = run_cli("stale", "--db", sqlite_db_url, "--output-dir", str(tmp_path),
                   env={"COLUMNS": "250"})
    assert done.returncode == 0, done.stderr
    assert "'evil [/x] kind' device" in done.stdout


def _summary(**fields: object) -> dict[str, object]:
    """A tune summary as ``autotune tune`` prints it (TuneSummary.to_dict's fields it shows)."""
    return {"problem": PROBLEM.to_dict(), "kernel": "flash", "device_kind": "cpu [/x]",
            "device_index": 0, "method": "interpret", "timing": "wallclock",
            "best_config": get_kernel("flash").default_config(PROBLEM).to_dict(),
            "best_time_ms": 1.0, "achieved_tflops": None, "roofline_fraction": None,
            "roofline_bound": None, "winner_is_default": True, "speedup": 1.0, "measured": 2,
            "failures": {}, "publish": "inserted", "study": "my [/x] study",
            "stop_reason": "budget", "patience": 10, **fields}


def test_a_study_name_with_markup_is_printed_as_text(capsys: pytest.CaptureFixture[str]) -> None:
    """A7: ``tune --study "my [/x] study"`` published, then exited 1 printing its summary."""
    _report(_summary(), json_output=False)
    out = " ".join(capsys.readouterr().out.split())
    assert "on cpu [/x] device 0" in out and "(study 'my [/x] study')" in out


def test_an_untunable_kernel_names_no_empty_study(capsys: pytest.CaptureFixture[str]) -> None:
    """Item 11: ``xla`` (no study) ended its result line ``(study '')``."""
    _report(_summary(kernel="xla", best_config={}, study=""), json_output=False)
    out = " ".join(capsys.readouterr().out.split())
    assert "published: inserted" in out and "study" not in out


@pytest.mark.parametrize(("stop", "said"), [
    (dict(stop_reason="patience", patience=7),
     "11 measured (stopped: --patience 7: the last 7 brought no faster config), failures "
     "none"),
    (dict(stop_reason="timeout"), "11 measured (stopped: --timeout reached), failures none"),
    (dict(stop_reason="budget"), "11 measured, failures none")])
def test_the_result_line_says_why_a_search_measured_fewer_than_its_trials(
        capsys: pytest.CaptureFixture[str], stop: dict[str, object], said: str) -> None:
    """Issue 63 item 3: a tune stopped by its patience or timeout at 11 of 30 configs said only
    ``11 measured``: the line now says why."""
    _report(_summary(measured=11, **stop), json_output=False)
    assert said in " ".join(capsys.readouterr().out.split())



def test_the_summaries_say_what_their_times_are(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 75 item 5: xla's line read "the default stays ... 0 measured"; the tune's and the
    choice's times differed with no word why; a CPU's summary lacked the report's "not a
    device figure" note (said once, after the choice)."""
    from autotune.trials import NOTHING_TO_SEARCH

    xla = _summary(kernel="xla", best_config={}, study="", method="device", measured=0,
                   stop_reason=NOTHING_TO_SEARCH)
    _report(xla, json_output=False)
    out = " ".join(capsys.readouterr().out.split())
    assert "best default at 1.000 ms (no roofline (CPU)), no tunable fields: its one config; " \
           "published: inserted" in out and "measured" not in out and "no device" not in out
    _report(_summary(), json_output=False)
    assert "(interpret mode: the TPU kernel emulated on a CPU; these times and their ratio " \
           "are no device figure)" in " ".join(capsys.readouterr().out.split())
    _report({"problem": PROBLEM.to_dict(), "device_kind": "cpu", "chosen_kernel": "flash",
             "choice_method": "interpret", "choice_timing": "wallclock",
             "choice_within_noise": False, "kernels": {"flash": 0.9, "xla": 1.2},
             "kernels_iqr_ms": {"flash": 0.1, "xla": 0.1}, "kernel_failures": {},
             "tuned": {"flash": _summary(), "xla": xla}}, json_output=False)
    out = " ".join(capsys.readouterr().out.split())
    assert "flash 0.900 ms ± 0.100, xla 1.200 ms ± 0.100 (each kernel's winner timed again, " \
           "against the others, as the wrapper calls it: these times, not each tune's above, " \
           "decide)" in out
    assert out.count("no device figure") == 1 and out.endswith("no device figure)")



def test_the_bar_of_a_kernel_without_fields_counts_its_one_config(tmp_path: Path) -> None:
    """Issue 75 item 5: xla's bar read ``0/30 ... confirming`` with nothing to measure (it
    looked stuck)."""
    db = f"sqlite:///{tmp_path / 'xla.db'}"
    done = run_cli("tune", "--kernel", "xla", *problem_flags(PROBLEM), "--db", db,
                   env={"COLUMNS": "250"})
    assert done.returncode == 0, done.stderr
    [bar] = [line for line in done.stdout.splitlines() if line.startswith("b1 h2/2")]
    assert " 1/1 " in bar and bar.endswith("no tunable fields: its one config timed"), bar

def test_the_help_shows_no_type_for_a_flag() -> None:
    """Issue 75 item 5: Typer's help showed ``--force <bool>`` (and ``--help <bool>``), as
    though the flag took a value."""
    for command, flag in ((["tune"], "--force"), (["db", "upgrade"], "--help"), ([], "--help")):
        done = run_cli(*command, "--help", env={"COLUMNS": "200"})
        assert done.returncode == 0, done.stderr
        assert flag in done.stdout and "<bool>" not in done.stdout, done.stdout

def test_replay_prints_markup_in_a_landscape_name_as_text(tmp_path: Path) -> None:
    """A7: a landscape named ``evil [/x] name`` crashed ``replay``'s table."""
    path = tmp_path / "evil.json.gz"
    path.write_bytes(gzip.compress(json.dumps({
        "name": "evil [/x] name", "params": {"a": [1, 2]},
        "records": [{"config": {"a": 1}, "status": "ok", "time_ms": 1.0},
                    {"config": {"a": 2}, "status": "ok", "time_ms": 2.0}]}).encode()))
    done = run_cli("replay", str(path), "--budget", "2", env={"COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert "replay evil [/x] name" in done.stdout


def test_an_alias_bomb_in_a_shapes_file_is_refused_in_one_short_line(tmp_path: Path) -> None:
    """A9: 500 bytes that expand to 1e9 values ran out of memory printing the value."""
    shapes = tmp_path / "bomb.yaml"
    shapes.write_text(BOMB)
    assert len(shapes.read_bytes()) < 600
    done = run_cli("tune", "--shapes", str(shapes), timeout=60)
    assert done.returncode == 2
    assert "expands to more than 1,000,000 YAML nodes" in done.stderr
    assert len(done.stderr) < 2000


def test_a_shapes_file_of_too_many_nodes_is_refused_early_saying_so(tmp_path: Path) -> None:
    """Issue 75 item 11d: a large file without aliases was built whole (60 MiB: 4.6 GB,
    200 s), then said "its aliases repeat what they name"; its nodes are counted as they are
    parsed, and the count stops at the bound."""
    shapes = tmp_path / "many.yaml"
    shapes.write_text("- [" + "1, " * 1_500_000 + "1]\n")
    done = run_cli("tune", "--shapes", str(shapes), timeout=120)
    assert done.returncode == 2, done.stderr
    assert "holds more than 1,000,000 YAML nodes" in done.stderr, done.stderr
    assert "alias" not in done.stderr and len(done.stderr) < 2000, done.stderr


def test_an_error_quoting_a_large_value_shows_its_start_only(tmp_path: Path) -> None:
    """A9: a value within the bound but large is quoted up to 200 characters."""
    shapes = tmp_path / "big.yaml"
    shapes.write_text(json.dumps([{"batch": list(range(20_000)), "q_heads": 1, "q_len": 128,
                                   "head_dim": 64}]))
    done = run_cli("tune", "--shapes", str(shapes))
    assert done.returncode == 2
    assert "characters)" in done.stderr and len(done.stderr) < 2000, done.stderr


def test_a_recursive_alias_is_refused(tmp_path: Path) -> None:
    shapes = tmp_path / "loop.yaml"
    shapes.write_text("- &a {batch: 1, q_heads: 1, q_len: 128, head_dim: 64, x: [*a]}\n")
    done = run_cli("tune", "--shapes", str(shapes), env={"COLUMNS": "250"})
    assert done.returncode == 2 and "holds a recursive alias" in done.stderr, done.stderr


def test_anchors_and_merge_keys_within_the_bound_still_load(tmp_path: Path) -> None:
    shapes = tmp_path / "merge.yaml"
    shapes.write_text("- &base {batch: 1, q_heads: 2, q_len: 128, head_dim: 64, dtype: float32}\n"
                      "- {<<: *base, q_len: 256}\n")
    assert [p.q_len for p in load_shapes(shapes)] == [128, 256]


def test_reading_shapes_with_a_repeat_is_linear(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A10: each distinct problem looked up its first index by a list scan (16k shapes with one
    repeat took 22 s instead of 3.4 s). Counted, not timed (a loaded machine flips a time): a
    scan compares each problem with those before it, a lookup by hash with none but its
    repeat."""
    rows = [{"batch": 1 + i % 100, "q_heads": 1, "q_len": 128 * (1 + i // 100), "head_dim": 64}
            for i in range(2_000)]
    path = tmp_path / "repeat.json"
    path.write_text(json.dumps([*rows, rows[0]]))
    compared = []
    equal = Problem.__eq__
    monkeypatch.setattr(Problem, "__eq__", lambda self, other: compared.append(1) or equal(
        self, other))
    assert len(load_shapes(path)) == 2_000
    assert len(compared) < 100, len(compared)  # a scan: about 2 million


def test_precheck_takes_shapes_like_tune(tmp_path: Path) -> None:
    """Item 11: every command that takes a problem takes ``--shapes`` (precheck did not)."""
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text("- {batch: 1, q_heads: 2, q_len: 128, head_dim: 64, dtype: int8}\n")
    done = run_cli("precheck", "--shapes", str(shapes), env={"COLUMNS": "250"})
    assert done.returncode == 2 and "problem 0: " in done.stderr, done.stderr  # the file read


def shapes_path(kind: str, tmp_path: Path) -> Path:
    """/dev/zero, a FIFO, or a sparse file one byte over the bound (no disk used)."""
    if kind == "device":
        return Path("/dev/zero")
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    else:
        with path.open("wb") as file:
            file.truncate(MAX_SHAPES_BYTES + 1)
    return path


@pytest.mark.parametrize("kind, message", [("device", "is not a regular file"),
                                           ("fifo", "is not a regular file"),
                                           ("huge", "is over the 64 MiB a shapes file may have")])
@pytest.mark.parametrize("command", [["tune"], ["precheck"], ["export", "--format", "maxtext"]])
def test_a_shapes_path_that_is_no_regular_file_of_bounded_size_is_refused(
        kind: str, message: str, command: list[str], tmp_path: Path) -> None:
    """Issue 62 item 2: ``--shapes /dev/zero`` grew to 24 GB until the OOM killer ended it, a
    FIFO hung, a file of 600 MiB was read whole; refused as a table path is."""
    path = shapes_path(kind, tmp_path)
    done = run_cli(*command, "--shapes", str(path), env={"COLUMNS": "250"}, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"{path} {message}" in done.stderr and "Traceback" not in done.stderr


def test_exponent_softcaps_are_numbers_in_a_shapes_file(tmp_path: Path) -> None:
    """Issue 55 item 12: YAML 1.1 read 5e1, 1e+20 and 1e-05 as strings, so a softcap written so
    was refused, and so were the files capture().save() and the misses file write (JSON
    writes 1e+20 and 1e-05)."""
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text("".join(
        f"- {{batch: 1, q_heads: 2, q_len: 128, head_dim: 64, softcap: {text}}}\n"
        for text in ("5e1", "1e+20", "1e-05", "2.5E2", ".5e1")))
    assert [p.softcap for p in load_shapes(shapes)] == [50.0, 1e20, 1e-05, 250.0, 5.0]
    written = [dataclasses.replace(PROBLEM, softcap=cap) for cap in (1e20, 1e-05, 50.0000001)]
    save_shapes(shapes, written[:1])
    append_shapes(shapes, written)  # as AUTOTUNE_RECORD_MISSES appends
    assert load_shapes(shapes) == written


@pytest.mark.parametrize("digits, message", [
    (400, "softcap must be positive and finite (logits become softcap * tanh(logits / "
          "softcap)), got an integer too large for a float"),
    (5000, "holds a value no problem field takes: Exceeds the limit (4300 digits)"),
])
def test_a_softcap_no_float_holds_is_refused_naming_it(tmp_path: Path, digits: int,
                                                       message: str) -> None:
    """Issue 55 item 9: a 400-digit softcap raised OverflowError (a traceback), a 5000-digit
    one YAML's ValueError."""
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text(f"- {{batch: 1, q_heads: 2, q_len: 128, head_dim: 64, "
                      f"softcap: 1{'0' * digits}}}\n")
    with pytest.raises(typer.BadParameter) as refused:
        load_shapes(shapes)
    assert message in str(refused.value) and len(str(refused.value)) < 1000


def _problems_app() -> typer.Typer:
    """A command that takes a problem as ``tune`` and ``precheck`` do, and prints its
    problems' labels."""
    app = typer.Typer()

    @app.command()
    @with_problem_options
    def show(context: typer.Context, problem: Problem, shapes: ShapesOption = None) -> None:
        for item in given_problems(context, problem, shapes):
            typer.echo(item.label())

    return app


def test_problem_flags_given_with_a_shapes_file_fill_what_its_problems_omit(
        tmp_path: Path) -> None:
    """Issue 55 item 6: ``--shapes`` with ``--mode`` was refused; a flag given with a shapes
    file is the default of the problems that omit its field, and one that every problem
    overrides is said to be unused."""
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text("- {batch: 1, q_heads: 2, q_len: 128, head_dim: 64}\n"
                      "- {batch: 1, q_heads: 2, q_len: 256, head_dim: 64, mode: fwd}\n")
    done = CliRunner().invoke(_problems_app(), ["--shapes", str(shapes), "--mode", "fwd_bwd",
                                                "--causal", "--q-len", "512"])
    assert done.exit_code == 0, done.output
    assert done.stdout.splitlines() == [
        "b1 h2/2 q128 kv128 d64 bfloat16 causal fwd_bwd",
        "b1 h2/2 q256 kv256 d64 bfloat16 causal fwd"]
    assert "--q-len not used: every problem gives its own" in done.stderr


@pytest.mark.parametrize(("flags", "flag"), [
    (["--window", "99999999999999999999,0"], "--window"),
    (["--q-len", "0"], "--q-len"),
    (["--q-heads", "3", "--kv-heads", "2"], "--q-heads")])
def test_a_problem_flag_out_of_range_is_named(flags: list[str], flag: str) -> None:
    """Issue 55 item 15: ``--window 99999999999999999999,0`` exited 2 without naming
    ``--window``."""
    done = CliRunner().invoke(_problems_app(), flags)
    assert done.exit_code == 2
    assert f"Invalid value for {flag}:" in " ".join(done.output.split()), done.output


def _commands(group: object, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every command of a click group, by the words that name it (``("db", "upgrade")``)."""
    commands = getattr(group, "commands", None)
    if commands is None:
        return {path: group}
    return {found: leaf for name, command in commands.items()
            for found, leaf in _commands(command, (*path, name)).items()}


def test_every_command_s_help_fits_80_columns() -> None:
    """Issue 55 item 6: at 80 columns Rich cut option names (``--include-reject…``,
    ``--allow-anonymou…``) and words of the help (``sqlite:///autotu…``)."""
    from autotune.cli import app

    paths = list(_commands(typer.main.get_command(app)))
    assert ("tune",) in paths and ("db", "upgrade") in paths
    for path in paths:
        done = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
        assert done.exit_code == 0, done.output
        assert max(map(len, done.stdout.splitlines())) <= 80
        assert "…" not in done.stdout, f"autotune {' '.join(path)} --help:\n{done.stdout}"


def test_every_option_s_help_is_printed_as_written() -> None:
    """Rich read ``dtype[d0,d1,...]`` in the help of ``tune --args`` as markup and printed
    ``dtype arrays``: each option's help is printed as written (``\\[`` escapes a bracket)."""
    from autotune.cli import app

    for path, command in _commands(typer.main.get_command(app)).items():
        done = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "400"})
        printed = " ".join(done.stdout.replace("│", " ").split())
        for param in command.params:
            written = " ".join((getattr(param, "help", None) or "").replace("\\[", "[").split())
            assert written in printed, f"autotune {' '.join(path)} --help: {written}"
