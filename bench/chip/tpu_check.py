"""One command for a TPU VM: numerics of every registered kernel, the timing methods against
each other, tuned against default against ``jax_tpu_flash`` against ``xla`` with roofline
fractions, and precheck's predicted fit against the real chip's compiles. Writes one JSON file
and an HTML report.

On a fresh TPU VM, from the repository root: the README's two Quickstart commands (install and
``autotune demo``, then ``bash .ci/run``, which also installs libtpu), then this::

    python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/autotune demo
    bash .ci/run
    .venv/bin/python bench/chip/tpu_check.py               # tpu_check.json, tpu_check.html

Sections (each kernel and config is checked against the XLA reference before it is timed):

1. ``numerics``: every registered kernel that runs here, default config, ``fwd`` and
   ``fwd_bwd``; the others are listed with the reason they are skipped.
2. ``timing``: three shapes, each tuned (``autotune.tune``, a throwaway SQLite file) once per
   timing method; per shape, the default config timed by each method, as a ratio to
   ``step_profile``, and whether the methods' winners agree.
3. ``comparison``: per shape, the tuned winner, the default, ``jax_tpu_flash`` and ``xla``
   timed in interleaved rounds (every device op counted, for a like-for-like figure), each
   with achieved TFLOP/s and its fraction of the chip's roofline.
4. ``splash``: per shape, splash tuned (``--trials``) against what MaxText users run: its
   default (every block 512, unfused) and its two hand-set recipes (all blocks 2048 with the
   fused backward; ``block_q=1024, block_q_dkv=2048`` with ``SEQ_MINOR`` layouts), capped at
   the sequence as MaxText caps them, interleaved like ``comparison``.
5. ``precheck``: for the first shape, every candidate with the VMEM estimate's verdict next to
   the chip's compile result (with ``--interpret``: a deviceless compile for v5e).
6. ``choice`` (``--choice grid|full|none``; default grid on a TPU, none with ``--interpret``):
   ``bench/chip/choice.py``, every candidate kernel's confirmed time and the chosen kernel over a
   grid of shapes.

``--interpret`` runs it all on a CPU with tiny shapes (the kernels in interpret mode, whose
steps ``step_profile`` reads as host-side op events; times are no device figure)::

    python bench/chip/tpu_check.py --interpret
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from storage import CURRENT_TIMINGS  # noqa: E402

TUNED_KERNEL = "flash"
BASELINES = ("jax_tpu_flash", "xla")
SPLASH = "splash"  # tuned against MaxText's default and recipes (section 4)
METHODS = CURRENT_TIMINGS  # step_profile first: the others are shown over it
DEVICE_SHAPES = [  # (batch, q_heads, kv_heads, seq, head_dim, causal, mode), bfloat16
    (1, 8, 8, 1024, 128, False, "fwd"),  # ~4.3 GFLOP: dispatch is as long as the kernel
    (4, 16, 16, 4096, 128, True, "fwd"),
    (1, 8, 8, 2048, 128, True, "fwd_bwd"),
]
INTERPRET_SHAPES = [  # float32 in interpret mode
    (1, 1, 1, 256, 128, False, "fwd"),
    (1, 2, 1, 256, 128, True, "fwd"),
    (1, 1, 1, 256, 128, False, "fwd_bwd"),
]

HTML = """<!doctype html><html><head><meta charset="utf-8"><title>TPU check</title>
<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}.num{text-align:right}</style>
</head><body><h1>TPU check on {{ r.device }}</h1>
<p>jax {{ r.versions.jax }}, libtpu {{ r.versions.libtpu or "–" }}; {{ r.mode }}.</p>
<h2>Numerics</h2><table><tr><th>kernel</th><th>mode</th><th>status</th><th>max error</th></tr>
{% for n in r.numerics %}<tr><td>{{ n.kernel }}</td><td>{{ n.mode or "–" }}</td>
<td>{{ n.status }}</td><td class="num">{{ fmt(n.max_error, ".2e") }}</td></tr>{% endfor %}</table>
<h2>Timing methods</h2>
{% for t in r.timing %}<h3>{{ t.problem }}</h3><table><tr><th>method</th><th>winner</th>
<th>best (ms)</th><th>default (ms)</th><th>default / step_profile</th><th>note</th></tr>
{% for m, v in t.methods.items() %}<tr><td>{{ m }}</td><td>{{ v.winner or "–" }}</td>
<td class="num">{{ fmt(v.best_ms) }}</td><td class="num">{{ fmt(v.default_ms) }}</td>
<td class="num">{{ fmt(t.default_over_profile.get(m), ".2f") }}</td><td>{{ v.note or "" }}</td>
</tr>{% endfor %}</table><p>Winners agree: {{ t.winners_agree }}</p>{% endfor %}
<h2>Tuned against the baselines, and splash against MaxText's settings</h2>
{% for c in r.comparison + r.splash %}<h3>{{ c.problem }} (timed by {{ c.timing }})</h3><table>
<tr><th>contender</th><th>config</th><th>median (ms)</th><th>IQR (ms)</th><th>TFLOP/s</th>
<th>roofline</th></tr>{% for e in c.contenders %}<tr><td>{{ e.name }}</td>
<td>{{ e.config or "–" }}</td><td class="num">{{ fmt(e.median_ms) }}</td>
<td class="num">{{ fmt(e.iqr_ms) }}</td><td class="num">{{ fmt(e.achieved_tflops, ".1f") }}</td>
<td>{{ fmt(e.roofline_fraction, ".0%") }} {{ e.roofline_bound or "" }} {{ e.error or "" }}</td>
</tr>{% endfor %}</table>{% endfor %}
<h2>Precheck against the chip ({{ r.precheck.compiled_on }})</h2>
<p>{{ r.precheck.problem }}: estimate and compiler agree on {{ r.precheck.agree }} of
{{ r.precheck.rows | length }} configs.</p><table><tr><th>config</th><th>predicted fit</th>
<th>compiled</th><th>error</th></tr>{% for p in r.precheck.rows %}<tr><td>{{ p.config }}</td>
<td>{{ p.predicted_fit }}</td><td>{{ p.status }}</td><td>{{ p.error or "" }}</td></tr>
{% endfor %}</table></body></html>"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true",
                        help="run on a CPU in interpret mode, with tiny shapes")
    parser.add_argument("--shapes", type=int, default=3, help="how many of the shapes to run")
    parser.add_argument("--trials", type=int, default=20, help="configs measured per tuning")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--kernels", default=None,
                        help="comma-separated kernels whose numerics to check (default: all)")
    parser.add_argument("--precheck-limit", type=int, default=None,
                        help="compile at most this many candidates (default: all; 4 with "
                             "--interpret)")
    parser.add_argument("--choice", default=None, choices=["grid", "full", "none"],
                        help="then bench/chip/choice.py (which kernel wins each shape): its "
                             "default grid, its full grid, or not (default: grid on the device, "
                             "none with --interpret)")
    parser.add_argument("--out", type=Path, default=Path("tpu_check.json"))
    parser.add_argument("--html", type=Path, default=Path("tpu_check.html"))
    return parser.parse_args()


def problems(args: argparse.Namespace) -> list[Any]:
    from kernel import Problem

    dtype = "float32" if args.interpret else "bfloat16"
    shapes = INTERPRET_SHAPES if args.interpret else DEVICE_SHAPES
    return [Problem(b, hq, hkv, seq, seq, d, dtype, causal, mode)
            for b, hq, hkv, seq, d, causal, mode in shapes[:args.shapes]]


def target_here(kernel: Any) -> str:
    """The rules' target of this device for ``kernel`` (``cpu``: interpret mode)."""
    import jax

    from kernel import device_target

    device = jax.devices()[0]
    name = device_target(device.platform, device.device_kind).name
    return name if name in kernel.targets else "cpu"


def runs_here(kernel: Any, interpret: bool) -> str | None:
    """None when ``kernel`` runs on this device (natively, or interpreted with
    ``--interpret``), else why not."""
    import jax

    platform = jax.devices()[0].platform
    if platform in kernel.platforms or (interpret and "cpu" in kernel.targets):
        return None
    return f"runs on {', '.join(kernel.platforms)}, not {platform}"


def numerics(args: argparse.Namespace) -> list[dict[str, Any]]:
    from autotune.measure import Measurer, relative_error
    from kernel.tolerance import MAX_RELATIVE_ERROR
    from kernel import Problem, get_kernel, kernel_names

    dtype = "float32" if args.interpret else "bfloat16"
    out = []
    for name in args.kernels.split(",") if args.kernels else kernel_names():
        kernel = get_kernel(name).discover()
        reason = runs_here(kernel, args.interpret)
        if reason:
            out.append({"kernel": name, "mode": None, "status": f"skipped: {reason}",
                        "max_error": None})
            continue
        for mode in ("fwd", "fwd_bwd"):
            problem = Problem(1, 2, 2, 256, 256, 128, dtype, True, mode)
            measurer = Measurer(problem, kernel.default_config(problem, target_here(kernel)),
                                kernel)
            try:
                program = measurer.compile(kernel.build(problem, measurer.base))
                error = relative_error(measurer.run(program), measurer.expected)
                status = "ok" if error <= MAX_RELATIVE_ERROR[dtype] else "wrong result"
            except Exception as failure:  # noqa: BLE001 - reported, the check goes on
                error, status = None, f"failed: {str(failure).splitlines()[0][:200]}"
            finally:
                measurer.close()
            out.append({"kernel": name, "mode": mode, "status": status, "max_error": error})
    return out


def timing_methods(problem: Any, db_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """``problem`` tuned once per timing method, and its default timed by each."""
    from autotune.measure import Measurer
    from autotune.timing import TimingError
    from autotune.tune import TuneOptions, tune
    from kernel import get_kernel
    from storage import Store

    kernel = get_kernel(TUNED_KERNEL).discover()
    methods: dict[str, dict[str, Any]] = {}
    default_ms: dict[str, float] = {}
    with Store(db_url) as store:
        for method in METHODS:
            options = TuneOptions(trials=args.trials, confirm_rounds=args.rounds, timing=method,
                                  force=True, seed=0)
            try:
                summary = tune(problem, store, db_url, options, kernel_name=kernel.name)
            except TimingError as error:
                methods[method] = {"winner": None, "best_ms": None, "default_ms": None,
                                   "note": str(error)}
                continue
            methods[method] = {"winner": summary.best_config.label(),
                               "config": summary.best_config.to_dict(),
                               "best_ms": summary.best_time_ms,
                               "default_ms": summary.default_time_ms,
                               "timing": summary.timing, "note": summary.timing_note}
            measurer = Measurer(problem, kernel.default_config(problem, target_here(kernel)),
                                kernel, timing=method)
            try:  # the same default program, timed by this method alone
                program = measurer.compile(kernel.build(problem, measurer.base),
                                           kernel.profile_names)
                default_ms[method] = statistics.median(
                    measurer.time(program, runs=5).median_ms for _ in range(args.rounds))
            except Exception as error:  # noqa: BLE001 - e.g. a profile that fell back
                methods[method]["note"] = f"default not timed: {error}"
            finally:
                measurer.close()
    profile_ms = default_ms.get(METHODS[0])
    winners = {v["winner"] for v in methods.values() if v["winner"]}
    return {"problem": problem.label(), "methods": methods, "default_ms": default_ms,
            "default_over_profile": {m: ms / profile_ms for m, ms in default_ms.items()}
            if profile_ms else {},
            "winners_agree": len(winners) == 1 if winners else None}


def comparison(problem: Any, tuned: dict[str, Any] | None,
               args: argparse.Namespace) -> dict[str, Any]:
    """Tuned, default and the baselines, interleaved, each with its roofline."""
    from kernel import get_kernel

    kernel = get_kernel(TUNED_KERNEL).discover()
    contenders: dict[str, tuple[Any, Any]] = {
        "default": (kernel, kernel.default_config(problem, target_here(kernel)))}
    if tuned is not None:
        contenders["tuned"] = (kernel, kernel.config_from_dict(tuned))
    rows: list[dict[str, Any]] = []
    for name in BASELINES:
        baseline = get_kernel(name).discover()
        reason = runs_here(baseline, args.interpret) or "; ".join(
            map(str, baseline.problem_violations(problem))) or None
        if reason:
            rows.append({"name": name, "config": None, "error": reason})
        else:
            contenders[name] = (baseline,
                                baseline.default_config(problem, target_here(baseline)))
    return interleaved(problem, contenders, rows, args)


def splash_recipes(problem: Any, db_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Splash tuned against what MaxText users run: its default and its two hand-set
    recipes, interleaved (a recipe the chip's rules refuse is listed with the reason)."""
    from autotune.tune import NothingToPublish, TuneOptions, tune
    from kernel import get_kernel
    from kernel.backends.splash import RECIPES, recipe
    from storage import Store

    kernel = get_kernel(SPLASH).discover()
    target = target_here(kernel)
    contenders = {"splash MaxText default": (kernel, kernel.default_config(problem, target))}
    rows: list[dict[str, Any]] = []
    with Store(db_url) as store:
        try:
            summary = tune(problem, store, db_url, TuneOptions(
                trials=args.trials, confirm_rounds=args.rounds, force=True, seed=0),
                kernel_name=SPLASH)
            contenders["splash tuned"] = (kernel, summary.best_config)
        except NothingToPublish as error:
            rows.append({"name": "splash tuned", "config": None, "error": str(error)})
    for name, changes in RECIPES.items():
        config = recipe(problem, **changes)
        broken = kernel.violations(problem, config, target)
        if broken:
            rows.append({"name": f"splash recipe {name}", "config": config.label(),
                         "error": "; ".join(map(str, broken))})
        else:
            contenders[f"splash recipe {name}"] = (kernel, config)
    return interleaved(problem, contenders, rows, args)


def interleaved(problem: Any, contenders: dict[str, tuple[Any, Any]],
                rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Each contender (name -> kernel, config) checked against the reference, then timed in
    interleaved rounds (every device op counted), with its roofline; appended to ``rows``."""
    import jax

    from autotune.measure import Measurer, Timing, relative_error
    from autotune.peaks import device_roofline

    first_kernel, first_config = next(iter(contenders.values()))
    measurer = Measurer(problem, first_config, first_kernel)
    programs = {}
    try:
        for name, (owner, config) in contenders.items():
            try:
                program = measurer.compile(owner.build(problem, config),  # every device op
                                           owner.profile_names)  # and the kernel's share
                error = relative_error(measurer.run(program), measurer.expected)
            except Exception as failure:  # noqa: BLE001 - reported, the others still run
                rows.append({"name": name, "config": config.label(),
                             "error": str(failure).splitlines()[0][:200]})
                continue
            programs[name] = (program, config, error)
        samples: dict[str, list[Timing]] = {name: [] for name in programs}
        for _ in range(args.rounds):
            for name, (program, _, _) in programs.items():
                samples[name].append(measurer.time(program, runs=3))
    finally:
        measurer.close()
    device = jax.devices()[0]
    for name, (_, config, error) in programs.items():
        timing = Timing(tuple(t.median_ms for t in samples[name]),
                        tuple(t.kernel_median_ms for t in samples[name]
                              if t.kernel_median_ms is not None))
        roof = device_roofline(device, problem, timing.median_ms)
        rows.append({"name": name, "config": config.label(), "median_ms": timing.median_ms,
                     "iqr_ms": timing.iqr_ms, "kernel_ms": timing.kernel_median_ms,
                     "max_error": error,
                     "achieved_tflops": roof and roof.tflops,
                     "roofline_fraction": roof and roof.fraction,
                     "roofline_bound": roof and roof.bound})
    return {"problem": problem.label(), "timing": measurer.timing, "contenders": rows}


def precheck_against_chip(problem: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The VMEM estimate's verdict per candidate next to a real compile of it."""
    import jax

    from autotune.failures import classify_compile_error
    from autotune.measure import Measurer
    from autotune.precheck import candidates
    from kernel import device_target, get_kernel
    from kernel.aot import compile_for_target

    kernel = get_kernel(TUNED_KERNEL).discover()
    device = jax.devices()[0]
    target = (kernel.target("v5e") if args.interpret
              else device_target(device.platform, device.device_kind))
    limit = args.precheck_limit or (4 if args.interpret else None)
    todo = candidates(problem, target, kernel, include_rejected=True)[:limit]
    measurer = None if args.interpret else Measurer(
        problem, kernel.default_config(problem, target), kernel, timing="wallclock")
    rows = []
    try:
        for candidate in todo:
            start = time.perf_counter()
            try:
                if measurer is None:
                    compile_for_target(kernel, problem, candidate.config, target,
                                       forward_only=candidate.forward_only)
                else:
                    measurer.compile(kernel.build(problem, candidate.config,
                                                  forward_only=candidate.forward_only))
                status, error = "ok", None
            except Exception as failure:  # noqa: BLE001 - the compiler's verdict is the data
                status = str(classify_compile_error(str(failure)))
                error = str(failure).splitlines()[0][:200]
            rows.append({"config": candidate.config.label(),
                         "predicted_fit": candidate.predicted_fit, "status": status,
                         "compile_s": round(time.perf_counter() - start, 3), "error": error})
    finally:
        if measurer is not None:
            measurer.close()
    return {"problem": problem.label(), "target": target.name,
            "compiled_on": f"{target.name} (deviceless AOT)" if args.interpret
            else device.device_kind,
            "agree": sum(r["predicted_fit"] == (r["status"] == "ok") for r in rows),
            "rows": rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import importlib.metadata

    import jax

    from storage import upgrade

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    shapes = problems(args)
    report: dict[str, Any] = {
        "device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
        "mode": "interpret (CPU)" if args.interpret else "device",
        "versions": {"jax": version("jax"), "jaxlib": version("jaxlib"),
                     "libtpu": version("libtpu")},
        "shapes": [p.to_dict() for p in shapes],
        "numerics": numerics(args), "timing": [], "comparison": [], "splash": []}
    with tempfile.TemporaryDirectory(prefix="tpu-check-") as tmp:
        db_url = f"sqlite:///{Path(tmp) / 'tune.db'}"
        upgrade(db_url)
        for problem in shapes:
            timed = timing_methods(problem, db_url, args)
            report["timing"].append(timed)
            tuned = next((v["config"] for v in timed["methods"].values() if v["winner"]), None)
            report["comparison"].append(comparison(problem, tuned, args))
            report["splash"].append(splash_recipes(problem, db_url, args))
    report["precheck"] = precheck_against_chip(dataclasses.replace(shapes[0], mode="fwd"), args)
    return report


def write_html(report: dict[str, Any], path: Path) -> None:
    import jinja2

    def fmt(value: float | None, spec: str = ".3f") -> str:
        return "–" if value is None else format(value, spec)

    env = jinja2.Environment(autoescape=True)
    path.write_text(env.from_string(HTML).render(r=report, fmt=fmt))


def main() -> None:
    args = parse_args()
    if args.interpret:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if not args.interpret and jax.devices()[0].platform != "tpu":
        sys.exit(f"no TPU found (JAX sees {jax.devices()[0].device_kind}); pass --interpret "
                 "to run on a CPU")
    report = run(args)
    from gpu_check import run_choice  # bench/chip/gpu_check.py, beside this script

    report["choice"] = run_choice(args)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    write_html(report, args.html)
    for timed in report["timing"]:
        print(f"{timed['problem']}: default / step_profile "
              + (", ".join(f"{m} {r:.2f}" for m, r in timed["default_over_profile"].items())
                 or "n/a (no profile here)"))
    for compared in report["comparison"] + report["splash"]:
        print(f"{compared['problem']} ({compared['timing']}): " + "; ".join(
            f"{row['name']} " + (f"{row['median_ms']:.3f} ms" if "median_ms" in row
                                 else f"n/a ({row['error']})")
            for row in compared["contenders"]))
    print(f"wrote {args.out} and {args.html}")


if __name__ == "__main__":
    main()
