"""One command for a Hopper GPU, within a time budget (``--budget-s``, default 480 s, JAX's
compiles included): ``mosaic_gpu`` (JAX's Mosaic GPU attention) tuned, confirmed against
``cudnn``, ``pallas_gpu`` and ``xla``, its landscape for one shape, and its shared-memory
estimate against the compiler. Writes one JSON and one HTML file under ``--out-dir``.

Problems (``--seqs``, default 2048, 4096, 8192): batch 1, 32 query and 8 K/V heads (GQA),
head_dim 128, bfloat16; ``fwd`` causal, ``fwd_bwd`` not causal (upstream's backward has no
causal mask: ``--fwd-bwd-causal`` asks anyway, and ``mosaic_gpu`` is then refused by its
rules). Sections, in order, each skipped (and saying so) when the budget is spent:

1. ``problems``: per problem, ``mosaic_gpu`` searched (``autotune.search``, our TPE sampler,
   the default first, ``--trials`` configs), then its tuned and default configs and every
   candidate's default timed in interleaved rounds (``--rounds``) by step_profile timing (every
   device op of each program; ``loop`` when the trace holds none): median, IQR, achieved
   TFLOP/s, fraction of the device's bf16 dense roofline, tuned over default, the winner.
   Every program is checked against the XLA reference before it is timed.
2. ``landscape``: every legal ``mosaic_gpu`` config of the first ``fwd`` problem at seq 4096
   (``--landscape-seq``) measured (grid), written as a landscape file that
   ``bench/search/replay.py DIR`` and ``autotune replay`` replay.
3. ``smem``: the configs the shared-memory estimate rejects for that problem compiled too:
   false admits (predicted to fit, the compiler says "exceeds available shared memory") and
   recall (of the configs the compiler refused for shared memory, the share the estimate
   rejected); also the op names of the default's compiled program, to check the kernel names
   ``mosaic_gpu`` guesses (``kernel_names``).

On the GPU machine, from the repository root (the ``tune`` extra installed; see README's Install)::

    PYTHONPATH=. python bench/chip/gpu_check.py --out-dir bench/results/h200

``--interpret`` is the CPU dry run CI runs (tests/test_gpu_check.py): tiny float32 shapes,
``pallas_gpu`` in interpret mode standing in for ``mosaic_gpu`` (which has no interpret mode;
it and ``cudnn`` are listed as not running here), every section and both files written.
``run_choice`` is ``bench/chip/tpu_check.py``'s entry to ``bench/chip/choice.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
TUNED = "mosaic_gpu"
STAND_IN = "pallas_gpu"  # tuned instead with --interpret: mosaic_gpu cannot run on a CPU
CANDIDATES = ("mosaic_gpu", "cudnn", "pallas_gpu", "xla")
SMEM_ERROR = "exceeds available shared memory"  # Mosaic GPU's own message
DEVICE_SHAPE = dict(batch=1, q_heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")
SEARCH_SHARE = 0.5
INTERPRET_SHAPE = dict(batch=1, q_heads=2, kv_heads=1, head_dim=64, dtype="float32")

HTML = """<!doctype html><html><head><meta charset="utf-8"><title>GPU check</title>
<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}.num{text-align:right}</style>
</head><body><h1>GPU check on {{ r.device }}</h1>
<p>{{ r.date }}; driver {{ r.driver or "–" }}; jax {{ r.versions.jax }}, jaxlib
{{ r.versions.jaxlib }}; {{ r.mode }}; tuned kernel {{ r.tuned_kernel }};
{{ "%.0f" % r.elapsed_s }} s of a {{ r.budget_s }} s budget.</p>
<h2>Tuned and confirmed against the candidates</h2>
{% for p in r.problems %}<h3>{{ p.problem }} (timed by {{ p.timing or "–" }})</h3>
{% if p.skipped %}<p>skipped: {{ p.skipped }}</p>{% else %}
<p>search: {{ p.search.measured }} configs in {{ p.search.seconds }} s, failures
{{ p.search.failures }}; tuned {{ p.tuned_config }}, tuned / default
{{ fmt(p.default_over_tuned, ".2f") }}x faster; winner <b>{{ p.winner or "–" }}</b>.</p>
<table><tr><th>contender</th><th>config</th><th>median (ms)</th><th>IQR (ms)</th>
<th>TFLOP/s</th><th>roofline</th><th>note</th></tr>{% for e in p.contenders %}<tr>
<td>{{ e.name }}</td><td>{{ e.config or "–" }}</td><td class="num">{{ fmt(e.median_ms) }}</td>
<td class="num">{{ fmt(e.iqr_ms) }}</td><td class="num">{{ fmt(e.achieved_tflops, ".1f") }}</td>
<td>{{ fmt(e.roofline_fraction, ".0%") }} {{ e.roofline_bound or "" }}</td>
<td>{{ e.error or "" }}</td></tr>{% endfor %}</table>{% endif %}{% endfor %}
<h2>Landscape</h2><p>{{ r.landscape.problem }}: {{ r.landscape.note }}</p>
<h2>Shared-memory estimate against the compiler</h2><p>{{ r.smem.problem }}:
{{ r.smem.note }}</p><table><tr><th>config</th><th>estimate (KiB)</th><th>predicted fit</th>
<th>compiled</th><th>error</th></tr>{% for s in r.smem.rows %}<tr><td>{{ s.config }}</td>
<td class="num">{{ s.estimate_kib }}</td><td>{{ s.predicted_fit }}</td><td>{{ s.status }}</td>
<td>{{ s.error or "" }}</td></tr>{% endfor %}</table></body></html>"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true",
                        help="the CPU dry run: tiny shapes, pallas_gpu interpreted as the "
                             "tuned kernel")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="wall seconds for everything, compiles included (default 480)")
    parser.add_argument("--seqs", default=None, help="comma-separated sequence lengths "
                        "(default 2048,4096,8192; 128,256 with --interpret)")
    parser.add_argument("--modes", default="fwd,fwd_bwd")
    parser.add_argument("--fwd-bwd-causal", action="store_true",
                        help="fwd_bwd causal too (mosaic_gpu refuses it: no causal backward)")
    parser.add_argument("--trials", type=int, default=8, help="configs measured per problem")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--landscape-seq", type=int, default=None,
                        help="the fwd problem whose landscape and shared memory are checked "
                             "(default 4096; 256 with --interpret)")
    parser.add_argument("--smem-limit", type=int, default=16,
                        help="compile at most this many configs the estimate rejects")
    parser.add_argument("--out-dir", type=Path, default=Path("gpu_check"))
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


@dataclasses.dataclass
class Budget:
    """Wall seconds left of ``--budget-s``; a section runs only while some are left."""

    seconds: float
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def spent(self) -> str | None:
        """Why to skip the next step (None: go on)."""
        return None if self.left() > 0 else f"budget of {self.seconds:g} s spent"


def problems(args: argparse.Namespace) -> list[Any]:
    from kernel import Problem

    shape = INTERPRET_SHAPE if args.interpret else DEVICE_SHAPE
    seqs = args.seqs or ("128,256" if args.interpret else "2048,4096,8192")
    out = []
    for mode in args.modes.split(","):
        causal = mode == "fwd" or args.fwd_bwd_causal
        out += [Problem(**shape, q_len=int(seq), kv_len=int(seq), causal=causal, mode=mode)
                for seq in seqs.split(",")]
    return out


def tuned_kernel(args: argparse.Namespace) -> Any:
    from kernel import get_kernel

    return get_kernel(STAND_IN if args.interpret else TUNED).discover()


def target_of(kernel: Any) -> str:
    """The rules' target here: ``gpu`` on a GPU for a GPU kernel, else ``cpu``."""
    import jax

    on_gpu = jax.devices()[0].platform == "gpu"
    return "gpu" if on_gpu and "gpu" in kernel.targets else "cpu"


def why_not_here(kernel: Any, problem: Any) -> str | None:
    """None when ``kernel`` runs ``problem`` here (natively, or interpreted on a CPU)."""
    import jax

    platform = jax.devices()[0].platform
    if platform not in kernel.platforms and "cpu" not in kernel.targets:
        return f"runs on {', '.join(kernel.platforms)}, not {platform}"
    broken = kernel.problem_violations(problem)
    return "; ".join(map(str, broken)) or None


def tune(problem: Any, kernel: Any, args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """``kernel`` searched on ``problem`` for at most ``seconds``: the best config and
    figures."""
    import optuna

    from autotune.measure import Measurer
    from autotune.search import search
    from autotune.searchspace import Space

    target = target_of(kernel)
    default = kernel.default_config(problem, target)
    space = Space(kernel.space_params(problem),
                  lambda p: kernel.is_legal(problem, default.replace(**p), target))
    measurer = Measurer(problem, default, kernel)
    start = time.perf_counter()
    try:
        result = search(space, measurer, trials=args.trials, seed=args.seed,
                        timeout=max(seconds, 1.0), storage=optuna.storages.InMemoryStorage(),
                        seeds=[{name: getattr(default, name) for name in space.names}])
    finally:
        measurer.close()
    best = default.replace(**result.best.config) if result.best else default
    return {"config": best, "measured": result.measured, "space": space.size,
            "seconds": round(time.perf_counter() - start, 1), "stop": result.stop_reason,
            "failures": dict(Counter(t.measurement.status for t in result.trials
                                     if not t.measurement.ok))}


def confirm(problem: Any, contenders: dict[str, tuple[Any, Any]],
            args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    """Each contender compiled, checked and timed in interleaved rounds: rows, timing."""
    import jax

    from autotune.measure import Measurer, interleaved, relative_error
    from autotune.peaks import device_roofline
    from kernel.tolerance import MAX_RELATIVE_ERROR

    first_kernel, first_config = next(iter(contenders.values()))
    measurer = Measurer(problem, first_config, first_kernel)
    rows, programs = [], {}
    try:
        for name, (kernel, config) in contenders.items():
            try:
                program = measurer.compile(kernel.build(problem, config))
                error = relative_error(measurer.run(program), measurer.expected)
                if not error <= MAX_RELATIVE_ERROR[problem.dtype]:
                    raise ValueError(f"wrong result: relative error {error:.3g}")
            except Exception as failure:  # noqa: BLE001 - reported, the others still run
                rows.append({"name": name, "config": config.label(),
                             "error": str(failure).splitlines()[0][:200]})
                continue
            programs[name] = (program, config, error)
        timings = interleaved({name: (lambda p=p: measurer.time(p, runs=3))
                               for name, (p, _, _) in programs.items()}, args.rounds)
    finally:
        measurer.close()
    device = jax.devices()[0]
    for name, (_, config, error) in programs.items():
        roof = device_roofline(device, problem, timings[name].median_ms)
        rows.append({"name": name, "config": config.label(), "max_error": error,
                     "median_ms": timings[name].median_ms, "iqr_ms": timings[name].iqr_ms,
                     "achieved_tflops": roof and roof.tflops,
                     "roofline_fraction": roof and roof.fraction,
                     "roofline_bound": roof and roof.bound})
    return rows, measurer.timing


def check_problem(problem: Any, args: argparse.Namespace, budget: Budget,
                  search_s: float) -> dict[str, Any]:
    """Section 1 for one problem, its search given at most ``search_s``."""
    from kernel import get_kernel

    kernel = tuned_kernel(args)
    out: dict[str, Any] = {"problem": problem.label(), "key": problem.to_dict()}
    refused = why_not_here(kernel, problem)
    if refused or budget.spent():
        return {**out, "skipped": refused or budget.spent(), "contenders": []}
    tuned = tune(problem, kernel, args, min(search_s, budget.left()))
    default = kernel.default_config(problem, target_of(kernel))
    contenders = {f"{kernel.name} tuned": (kernel, tuned["config"]),
                  f"{kernel.name} default": (kernel, default)}
    missing = []
    for name in CANDIDATES:
        other = get_kernel(name).discover()
        if name == kernel.name:
            continue
        reason = why_not_here(other, problem)
        if reason:
            missing.append({"name": name, "config": None, "error": reason})
        else:
            contenders[name] = (other, other.default_config(problem, target_of(other)))
    rows, timing = confirm(problem, contenders, args)
    rows += missing
    times = {row["name"]: row["median_ms"] for row in rows if "median_ms" in row}
    tuned_ms, default_ms = (times.get(f"{kernel.name} {which}") for which in ("tuned", "default"))
    return {**out, "search": {k: v for k, v in tuned.items() if k != "config"},
            "tuned_config": tuned["config"].label(), "tuned": tuned["config"].to_dict(),
            "timing": timing, "contenders": rows,
            "default_over_tuned": default_ms / tuned_ms if tuned_ms and default_ms else None,
            "winner": min(times, key=times.__getitem__) if times else None}


def landscape(problem: Any, args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    """Section 2: every legal config of ``problem`` measured, written as a landscape file;
    also the statuses the shared-memory check reuses."""
    import optuna

    from autotune.measure import Measurer
    from autotune.search import search
    from autotune.searchspace import Space

    kernel = tuned_kernel(args)
    out: dict[str, Any] = {"problem": problem.label(), "statuses": {}}
    refused = why_not_here(kernel, problem) or budget.spent()
    if refused:
        return {**out, "note": f"skipped: {refused}"}
    target = target_of(kernel)
    default = kernel.default_config(problem, target)
    space = Space(kernel.space_params(problem),
                  lambda p: kernel.is_legal(problem, default.replace(**p), target))
    storage = optuna.storages.InMemoryStorage()
    measurer = Measurer(problem, default, kernel)
    try:
        result = search(space, measurer, trials=space.size + 1, sampler="grid",
                        timeout=max(budget.left(), 1.0), storage=storage,
                        study_name="gpu_check_landscape", seed=args.seed)
    finally:
        measurer.close()
    out["statuses"] = {default.replace(**t.config).label(): "smem" if SMEM_ERROR in str(
        t.measurement.attrs.get("error")) else t.measurement.status for t in result.trials}
    if result.stop_reason != "exhausted":
        return {**out, "note": f"{result.measured} of {space.size} configs measured, stopped "
                               f"({result.stop_reason}): no landscape file written"}
    path = write_landscape(args.out_dir, optuna.load_study(study_name="gpu_check_landscape",
                                                           storage=storage), problem, kernel.name)
    return {**out, "file": str(path), "configs": space.size,
            "note": f"{space.size} configs, {Counter(out['statuses'].values())} -> {path.name}"}


def write_landscape(folder: Path, study: Any, problem: Any, kernel: str) -> Path:
    """The grid ``study`` of ``problem`` as ``folder/<kernel>-<device>-<mode>.json.gz``."""
    import jax

    from autotune.landscape import save_landscape, study_document

    device = jax.devices()[0].device_kind
    for name, value in (("kernel", kernel), ("device_kind", device),
                        ("problem", problem.to_dict())):
        study.set_user_attr(name, value)
    document = study_document(study)
    document["name"] = "-".join([kernel, *device.split(), problem.mode])
    path = folder / f"{document['name']}.json.gz"
    folder.mkdir(parents=True, exist_ok=True)
    save_landscape(document, path)
    return path


def smem_check(problem: Any, statuses: dict[str, str], args: argparse.Namespace,
               budget: Budget) -> dict[str, Any]:
    """Section 3: ``mosaic_gpu``'s estimate per config against the compiler's verdict (the
    landscape's statuses for admitted configs, a compile here for up to ``--smem-limit``
    rejected ones; none on a CPU, where the rows are the estimate alone)."""
    from autotune.measure import Measurer
    from kernel import get_kernel
    from kernel.backends.mosaic_gpu import smem_bytes

    kernel = get_kernel(TUNED).discover()
    problem = dataclasses.replace(problem, dtype="bfloat16")  # its one dtype
    refused = why_not_here(kernel, problem) or budget.spent()
    default = kernel.default_config(problem, "gpu")
    measurer = None if refused else Measurer(problem, default, kernel)
    rows, compiled = [], 0
    try:
        op_names = None if measurer is None else sorted(
            op_names_of(measurer.compile(kernel.build(problem, default))))
        for config in kernel.search_space(problem, "gpu", ignore=frozenset({"smem"})):
            fit, status, error = kernel.is_legal(problem, config, "gpu"), "not compiled", None
            if fit:
                status = statuses.get(config.label(), status)
            elif measurer is not None and compiled < args.smem_limit and not budget.spent():
                status, error = _compiles(measurer, kernel, problem, config)
                compiled += 1
            rows.append({"config": config.label(), "predicted_fit": fit, "status": status,
                         "estimate_kib": round(max(smem_bytes(problem, config).values()) / 1024,
                                               1), "error": error})
    finally:
        if measurer is not None:
            measurer.close()
    return {"problem": problem.label(), "rows": rows, "op_names": op_names,
            "kernel_names": list(kernel.kernel_names), **_agreement(rows, refused)}


def _compiles(measurer: Any, kernel: Any, problem: Any, config: Any) -> tuple[str, str | None]:
    try:
        measurer.compile(kernel.build(problem, config))
    except Exception as error:  # noqa: BLE001 - the compiler's verdict is the data
        text = str(error)
        return ("smem" if SMEM_ERROR in text else "compile_error"), text.splitlines()[0][:200]
    return "ok", None


def op_names_of(program: Any) -> frozenset[str]:
    from autotune.timing import op_names

    return op_names(program.compiled)


def _agreement(rows: list[dict[str, Any]], skipped: str | None) -> dict[str, Any]:
    """False admits (admitted, refused for shared memory by the compiler) and recall (of the
    compiler's shared-memory refusals, the share the estimate rejected)."""
    refused = [r for r in rows if r["status"] == "smem"]
    caught = sum(not r["predicted_fit"] for r in refused)
    false_admits = sum(r["predicted_fit"] for r in refused)
    false_rejects = sum(not r["predicted_fit"] and r["status"] == "ok" for r in rows)
    recall = caught / len(refused) if refused else None
    return {"false_admits": false_admits, "false_rejects": false_rejects, "recall": recall,
            "note": f"not compiled ({skipped}); " * bool(skipped)
                    + f"{false_admits} false admits, {false_rejects} rejected configs compiled, "
                    f"recall {'n/a (no refusal seen)' if recall is None else f'{recall:.0%}'}"
                    f" over {len(rows)} configs"}


def environment(args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    import jax

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    device = jax.devices()[0]
    kernel = tuned_kernel(args)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": device.device_kind, "platform": device.platform, "driver": _driver(),
            "mode": "interpret (CPU dry run)" if args.interpret else "device",
            "tuned_kernel": kernel.name, "gpu_arch": getattr(kernel, "gpu_arch", None),
            "cuda_runtime": getattr(kernel, "cuda_runtime", None),
            "versions": {p: version(p) for p in ("jax", "jaxlib", "jax-cuda12-plugin",
                                                 "jax-cuda13-plugin")},
            "budget_s": budget.seconds}


def _driver() -> str | None:
    """The NVIDIA driver version, from nvidia-smi (None without it)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    budget = Budget(args.budget_s)
    report = environment(args, budget)
    todo = problems(args)
    # the searches get at most half the budget, shared equally; the rest confirms and checks
    report["problems"] = [check_problem(problem, args, budget, SEARCH_SHARE * budget.seconds
                                        / len(todo)) for problem in todo]
    seq = args.landscape_seq or (256 if args.interpret else 4096)
    first = next(p for p in todo if p.mode == "fwd")
    shape = dataclasses.replace(first, q_len=seq, kv_len=seq)
    found = landscape(shape, args, budget)
    report["smem"] = smem_check(shape, found.pop("statuses"), args, budget)
    report["landscape"] = found
    report["elapsed_s"] = round(time.perf_counter() - budget.start, 1)
    return report


def write_html(report: dict[str, Any], path: Path) -> None:
    import jinja2

    def fmt(value: float | None, spec: str = ".3f") -> str:
        return "–" if value is None or isinstance(value, jinja2.Undefined) else format(value,
                                                                                     spec)

    env = jinja2.Environment(autoescape=True)
    path.write_text(env.from_string(HTML).render(r=report, fmt=fmt))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.interpret:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if not args.interpret and jax.devices()[0].platform != "gpu":
        sys.exit(f"no GPU found (JAX sees {jax.devices()[0].device_kind}); pass --interpret "
                 "for the CPU dry run")
    report = run(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    write_html(report, args.out_dir / "gpu_check.html")
    for checked in report["problems"]:
        print(f"{checked['problem']}: " + (f"skipped ({checked['skipped']})"
                                           if checked.get("skipped") else "; ".join(
            f"{row['name']} " + (f"{row['median_ms']:.3f} ms" if "median_ms" in row
                                 else "n/a") for row in checked["contenders"])))
    print(f"smem: {report['smem']['note']}; landscape: {report['landscape']['note']}")
    print(f"{report['elapsed_s']} s; wrote {args.out_dir}/gpu_check.json and .html")
    return report


def run_choice(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """``bench/chip/choice.py`` (beside this script) as ``--choice`` says: which kernel wins each
    shape of its grid here; None when not run."""
    mode = args.choice or ("none" if args.interpret else "grid")
    if mode == "none":
        return None
    import choice

    return choice.main(["--full"] if mode == "full" else [])


if __name__ == "__main__":
    main()
