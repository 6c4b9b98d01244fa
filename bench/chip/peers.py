"""Issue 72: our published choice against the tuners users reach for, on the same chip, the
same problems and the same clock. Per problem of ``bench/chip/handset.py``'s grid:

- **ours**: the kernel choice ``autotune tune`` publishes (``--kernels``, ``--trials`` per
  kernel; every config timed over the whole step and checked against the reference);
- **tokamax**: ``tokamax.autotune`` over the ops that ``tokamax.dot_product_attention(...,
  implementation="mosaic")`` lowers to under the problem's mode (its own space: blocks,
  layouts and scheduler of the forward, the VJP's dK/dV blocks; its own timing of each op
  alone), then the call built under its result;
- **tune-jax**: ``tune_jax.tune`` over upstream splash's block sizes as MaxText exposes them
  (``sa_block_q`` ... ``sa_use_fused_bwd_kernel``), a grid a MaxText user would write
  (:data:`TUNE_JAX_GRID`), ``--tune-jax-samples`` of its combinations (its random sample);

then every winner, MaxText's default blocks and every other hand-set config timed over the
whole step in interleaved rounds (``bench.chip.tpu_check.interleaved``), each output checked
against the float32 reference first (a winner over the bound is reported as failed, not
timed as a win). Each tuner's wall time (compiles included) is reported beside its result.
A peer that is not installed (``pip install 'flash-autotune[peers]'``) is reported as
missing; the rest still runs::

    python bench/chip/peers.py --problems 1 --kernels flash,splash --out peers-1.json
    python bench/chip/peers.py --interpret   # a CPU check with tiny shapes, no device figures

The peers' layout is [batch, seq, heads, head_dim]; ours is [batch, heads, seq, head_dim]:
tokamax's call is timed as ours is, from our layout, and the transposes around it cancel its
own (XLA removes a transpose of a transpose).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from bench.chip import handset  # noqa: E402

PEERS = ("tokamax", "tune_jax")
# MaxText's splash settings, as a user writes a tune-jax grid for them. Compute blocks stay at
# or under the smallest key block, so every combination is legal; tune-jax samples them.
TUNE_JAX_GRID = {
    "sa_block_q": [256, 512, 1024, 2048],
    "sa_block_kv": [512, 1024, 2048],
    "sa_block_kv_compute": [128, 256, 512],
    "sa_block_q_dkv": [256, 512, 1024, 2048],
    "sa_block_kv_dkv": [512, 1024, 2048],
    "sa_block_kv_dkv_compute": [128, 256, 512],
    "sa_block_q_dq": [256, 512, 1024, 2048],
    "sa_block_kv_dq": [512, 1024, 2048],
    "sa_use_fused_bwd_kernel": [False, True],
}
FORWARD_SETTINGS = ("sa_block_q", "sa_block_kv", "sa_block_kv_compute")
INTERPRET_GRID = {"sa_block_q": [128, 256], "sa_block_kv": [128, 256],
                  "sa_block_kv_compute": [128], "sa_use_fused_bwd_kernel": [False, True]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    handset.add_problem_arguments(parser)
    parser.add_argument("--trials", type=int, default=30,
                        help="our configs measured per kernel (the tune's default)")
    parser.add_argument("--kernels", default=None,
                        help="our tune's candidates, a,b (default: every kernel that runs here)")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"the peer tuners to run, of {', '.join(PEERS)}")
    parser.add_argument("--tune-jax-samples", type=int, default=64,
                        help="combinations of the grid tune-jax compiles and times")
    parser.add_argument("--tokamax-part", type=part, default=(1, 1), metavar="K/N",
                        help="measure part K of N of tokamax's configs (every N-th), merged "
                             "into --results; the comparison waits for all N (default 1/1)")
    parser.add_argument("--tokamax-sample", type=int, default=None, metavar="N",
                        help="at most N of each tokamax op's configs, evenly spaced over its "
                             "own sorted space (its budget; default: every config)")
    parser.add_argument("--results", type=Path, default=None,
                        help="where each tuner's result is kept per problem and read back by "
                             "a rerun: our study (SQLite), tune-jax's and tokamax's JSON "
                             "(default: a temporary folder)")
    parser.add_argument("--no-ours", dest="ours", action="store_false",
                        help="leave our tune out (e.g. a call that measures a tokamax part)")
    parser.add_argument("--no-compare", action="store_true",
                        help="tune only: time no winner (their results stay in --results)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    unknown = set(args.peers.split(",")) - set(PEERS)
    if unknown:
        parser.error(f"--peers: unknown {', '.join(sorted(unknown))}; of {', '.join(PEERS)}")
    return args


def part(text: str) -> tuple[int, int]:
    """``K/N`` as (K, N), 1 <= K <= N."""
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise argparse.ArgumentTypeError(f"{text!r} is not K/N with 1 <= K <= N, e.g. 2/4")
    return int(k), int(n)


def missing(peer: str) -> str | None:
    """Why ``peer`` cannot run here (not installed), else None."""
    if importlib.util.find_spec(peer) is None:
        return f"{peer} is not installed (pip install 'flash-autotune[peers]')"
    return None


@dataclass(frozen=True)
class PeerConfig:
    """A peer's winner as a contender's config: what ``interleaved`` labels a row with."""

    text: str

    def label(self) -> str:
        return self.text


@dataclass(frozen=True)
class TokamaxCall:
    """tokamax's attention under its autotuning result, as a contender (``build`` and
    ``profile_names``, what ``interleaved`` asks of a kernel)."""

    result: Any
    profile_names: tuple[str, ...] = ()

    def build(self, problem: Any, _config: PeerConfig) -> Any:
        measured = tokamax_step(problem)

        def traced(*args: Any) -> Any:  # the result chooses the configs while it traces
            with self.result:
                return measured(*args)

        return traced


def tokamax_step(problem: Any) -> Any:
    """What is tuned and timed: tokamax's attention in ``problem``'s mode (the gradients in
    fwd_bwd), as ours is (:func:`kernel.contract.measured_fn`)."""
    from kernel.contract import measured_fn

    return measured_fn(problem, tokamax_attend(problem))


def tokamax_attend(problem: Any) -> Any:
    """tokamax's Mosaic attention of ``problem`` as a function in our layout."""
    import jax.numpy as jnp
    import tokamax

    from kernel.contract import default_scale

    def attend(q: Any, k: Any, v: Any) -> Any:
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
        out = tokamax.dot_product_attention(
            q, k, v, scale=default_scale(problem), is_causal=problem.causal,
            local_window_size=problem.window, logits_soft_cap=problem.softcap,
            implementation="mosaic")
        return jnp.swapaxes(out, 1, 2)

    return attend


def give_locations_predicates() -> None:
    """tokamax 0.0.12 reads the MLIR locations of a lowered program with ``is_a_name()``,
    ``is_a_file()`` and the like, which jaxlib 0.10.2's typed locations (``NameLoc``, ...) do
    not have: without them its autotune fails on the chip's JAX ("'NameLoc' object has no
    attribute 'is_a_name'"), and tokamax's releases after 0.0.12 need Python 3.12, which the
    chip VM lacks. This gives every location those four predicates, by type; nothing else of
    tokamax changes."""
    from jax._src.lib.mlir import ir

    kinds = {"name": ir.NameLoc, "callsite": ir.CallSiteLoc, "fused": ir.FusedLoc,
             "file": ir.FileLineColLoc}
    for kind, loc_type in kinds.items():
        if not hasattr(ir.Location, f"is_a_{kind}"):
            setattr(ir.Location, f"is_a_{kind}",
                    lambda loc, loc_type=loc_type: isinstance(loc, loc_type))


def sampled(configs: list[Any], most: int | None) -> list[Any]:
    """At most ``most`` of ``configs``, evenly spaced (every ``ceil(len / most)``-th)."""
    if most is None or len(configs) <= most:
        return configs
    return configs[::-(-len(configs) // most)]


def tokamax_part(ops: Any, part: tuple[int, int], most: int | None) -> tuple[Any, list[str]]:
    """tokamax's autotuning data of part ``k`` of ``n`` (every ``n``-th, in a fixed order) of
    each op's own configs, or of ``most`` of them (:func:`sampled`), measured as
    ``tokamax.autotune`` measures them; and why each config that failed did (a config that
    cannot compile here, e.g. over the VMEM, is tokamax's to skip, as its autotune does)."""
    import tokamax

    from kernel.contract import default_device

    k, n = part
    data, failures = [], []
    for bound in ops:
        configs = sampled(sorted(bound.autotuning_configs, key=repr), most)[k - 1::n]
        measured = bound.autotune(set(configs))
        failures += [f"{config}: {str(error).splitlines()[0][:200]}"
                     for config, error in measured.items() if isinstance(error, Exception)]
        data.append((bound, type(measured)({config: timing for config, timing in measured.items()
                                            if not isinstance(timing, Exception)})))
    return tokamax.AutotuningResult(default_device().device_kind, tuple(data)), failures


def run_tokamax(problem: Any, inputs: list[Any], args: argparse.Namespace,
                saved: Path) -> tuple[dict, dict]:
    """tokamax's autotune of ``problem`` over its own configs, in ``--tokamax-part``s (each
    part's data merged into ``saved``, tokamax's own JSON): its contender once every part is
    measured, and its row of the report."""
    import tokamax
    from absl import flags, logging

    if not flags.FLAGS.is_parsed():  # tokamax's options are absl flags; ours are not
        flags.FLAGS.mark_as_parsed()
    logging.set_verbosity(logging.DEBUG)  # its per-config times on stderr: a long part's progress
    give_locations_predicates()
    row = json.loads(saved.read_text()) if saved.exists() else {
        "wall_s": 0.0, "parts": [], "sample": args.tokamax_sample, "failed": []}
    if row["sample"] != args.tokamax_sample:
        raise SystemExit(f"{saved} holds parts of --tokamax-sample {row['sample']}, not "
                         f"{args.tokamax_sample}: pass the same, or another --results")
    k, n = args.tokamax_part
    if [k, n] not in row["parts"]:
        start = time.perf_counter()
        ops = tokamax.autotuning.get_bound_args(tokamax_step(problem), *inputs)
        result, failed = tokamax_part(ops, (k, n), args.tokamax_sample)
        if "result" in row:
            result = tokamax.AutotuningResult.loads(row["result"]) | result
        row.update(wall_s=row["wall_s"] + time.perf_counter() - start,
                   parts=row["parts"] + [[k, n]], failed=row["failed"] + failed,
                   result=result.dumps())
        saved.write_text(json.dumps(row))
    result = tokamax.AutotuningResult.loads(row["result"])
    ops = [{"op": type(bound.op).__name__, "configs": len(data),
            "fastest": str(data.fastest_config) if data else "none measured"}
           for bound, data in result.data]
    summary = {"wall_s": row["wall_s"], "parts": row["parts"], "sample": row["sample"],
               "failed": row["failed"], "ops": ops}
    if len(row["parts"]) < n:
        return {}, {**summary, "error": f"tokamax: {len(row['parts'])} of {n} parts measured"}
    label = "; ".join(f"{op['op']}: {op['fastest']}" for op in ops)
    return {"tokamax autotune": (TokamaxCall(result), PeerConfig(label))}, summary


def splash_config(base: Any, settings: dict[str, Any]) -> Any:
    """Our splash config of MaxText's ``sa_*`` settings (the fused backward has no dQ
    blocks)."""
    from kernel.backends.splash import fused

    config = base.replace(**{name.removeprefix("sa_"): value for name, value in settings.items()})
    return fused(config) if config.use_fused_bwd_kernel else config


def tune_jax_grid(problem: Any, interpret: bool) -> dict[str, list[Any]]:
    """The grid tune-jax searches for ``problem``, as a user writes it for that sequence: no
    block longer than the sequence (at s512 every sample of the full grid failed to compile);
    the forward's settings alone in fwd mode."""
    grid = INTERPRET_GRID if interpret else TUNE_JAX_GRID
    names = FORWARD_SETTINGS if problem.mode == "fwd" else grid
    return {name: fitting(grid[name], min(problem.q_len, problem.kv_len))
            for name in names if name in grid}


def fitting(values: list[Any], seq: int) -> list[Any]:
    """``values`` no longer than ``seq`` (flags kept), the smallest kept if none is."""
    if isinstance(values[0], bool):
        return values
    return [v for v in values if v <= seq] or [min(values)]


def run_tune_jax(problem: Any, inputs: list[Any], args: argparse.Namespace,
                 saved: Path) -> tuple[dict, dict]:
    """tune-jax over splash's MaxText settings (its row kept in ``saved``, read back by a
    rerun): its winner as a contender, and its row."""
    from bench.chip.tpu_check import target_here
    from kernel import get_kernel

    splash = get_kernel("splash").discover()
    base = splash.default_config(problem, target_here(splash))
    if not saved.exists():
        saved.write_text(json.dumps(tune_jax_row(problem, inputs, args, splash, base)))
    row = json.loads(saved.read_text())
    return {"tune-jax (splash)": (splash, splash_config(base, row["settings"]))}, row


def tune_jax_row(problem: Any, inputs: list[Any], args: argparse.Namespace, splash: Any,
                 base: Any) -> dict[str, Any]:
    """tune-jax's run: its wall time, configs timed and failed, and its winning settings."""
    import random

    import jax
    import tune_jax

    grid = tune_jax_grid(problem, args.interpret)

    def step(q: Any, k: Any, v: Any, **settings: Any) -> Any:
        return splash.build(problem, splash_config(base, settings))(q, k, v)

    random.seed(0)  # tune-jax samples the grid with Python's random
    tuned = tune_jax.tune(jax.jit(step, static_argnames=tuple(grid)), hyperparams=grid,
                          sample_num=args.tune_jax_samples)
    start = time.perf_counter()
    jax.block_until_ready(tuned(*inputs))
    wall = time.perf_counter() - start
    timed = [r for r in tuned.timing_results.values() if math.isfinite(r.t_mean)]
    return {"wall_s": wall, "configs": len(tuned.timing_results),
            "failed": len(tuned.timing_results) - len(timed),
            "settings": dict(tuned.optimal_hyperparams),
            "config": splash_config(base, tuned.optimal_hyperparams).label()}


def run_ours(problem: Any, args: argparse.Namespace) -> tuple[dict, list, dict]:
    """Our default tune (the kernel choice; its study kept in ``--results``, where a rerun
    resumes it): contenders, failure rows, and its row."""
    start = time.perf_counter()
    chosen, failed, choice = handset.tuned(problem, args, str(args.results))
    ours = {"wall_s": time.perf_counter() - start, "chosen_kernel": choice.get("chosen_kernel"),
            "kernels": choice.get("kernels")}
    print(f"{problem.label()}: ours {ours}", file=sys.stderr, flush=True)
    return chosen, failed, ours


def run_peers(problem: Any, args: argparse.Namespace) -> tuple[dict, list, dict]:
    """Each peer asked for: contenders, rows of those that could not run, and their rows."""
    import jax

    from kernel.contract import example_inputs

    inputs = [jax.device_put(x, jax.devices()[0]) for x in example_inputs(problem)]
    runners = {"tokamax": lambda saved: run_tokamax(problem, inputs, args, saved),
               "tune_jax": lambda saved: run_tune_jax(problem, inputs, args, saved)}
    contenders, failed, tuners = {}, [], {}
    for peer in args.peers.split(","):
        why = missing(peer)
        try:
            saved = args.results / f"{slug(problem)}-{peer}.json"
            found, tuners[peer] = ({}, {"error": why}) if why else runners[peer](saved)
        except Exception as error:  # noqa: BLE001 - reported; the other tuners still run
            found, tuners[peer] = {}, {"error": str(error).splitlines()[0][:300]}
        print(f"{problem.label()}: {peer} {tuners[peer]}", file=sys.stderr, flush=True)
        if not found:
            failed.append({"name": peer, "config": None, "error": tuners[peer]["error"]})
        contenders.update(found)
    return contenders, failed, tuners


def slug(problem: Any) -> str:
    """``problem``'s label as a file name."""
    return problem.label().replace(" ", "_").replace("/", "-")


def passed(row: dict[str, Any], bound: float) -> bool:
    return row.get("median_ms") is not None and row["max_error"] <= bound


def peer_ratios(rows: list[dict[str, Any]], bound: float) -> dict[str, Any]:
    """Ours over each peer's winner (a peer's time over ours: above 1 we are faster), and over
    the best peer; a row over the error bound counts as failed, not as a time."""
    ok = {row["name"]: row["median_ms"] for row in rows if passed(row, bound)}
    ours = next((v for k, v in ok.items() if k.startswith("tuned: ")), None)
    peers = {k: v for k, v in ok.items() if k in ("tokamax autotune", "tune-jax (splash)")}
    best = min(peers, key=peers.get, default=None)
    return {"over_peer": {k: v / ours for k, v in peers.items()} if ours else {},
            "best_peer": best, "over_best_peer": ours and best and peers[best] / ours,
            "over_maxtext": ours and ok.get(handset.MAXTEXT) and ok[handset.MAXTEXT] / ours,
            "failed_check": [row["name"] for row in rows
                             if row.get("median_ms") is not None and not passed(row, bound)]}


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def compare(problem: Any, tuned: dict[str, tuple[Any, Any]], failed: list[dict[str, Any]],
            args: argparse.Namespace) -> dict[str, Any]:
    """Every tuner's winner and every hand-set config timed over the step in interleaved
    rounds, each checked against the reference first; and the ratios."""
    import jax

    from bench.chip.tpu_check import interleaved
    from kernel.tolerance import max_relative_error

    contenders, refused = handset.handset(problem, args.interpret)
    timed = interleaved(problem, {**tuned, **contenders}, failed + refused, args)
    bound = max_relative_error(problem.dtype, jax.devices()[0].platform)
    ratios = peer_ratios(timed["contenders"], bound)
    print(problem.label(), ratios, flush=True)
    return {"timing": timed["timing"], "contenders": timed["contenders"], "error_bound": bound,
            "ratios": ratios}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from bench.chip import write_report

    out = []
    with tempfile.TemporaryDirectory() as folder:
        args.results = args.results or Path(folder)
        args.results.mkdir(parents=True, exist_ok=True)
        for problem in handset.problems(args):
            chosen, failed, ours = run_ours(problem, args) if args.ours else ({}, [], {})
            peers, peers_failed, tuners = run_peers(problem, args)
            row = {"problem": problem.label(), "tuners": {"ours": ours, **tuners}}
            if not args.no_compare:
                row.update(compare(problem, {**chosen, **peers}, failed + peers_failed, args))
            out.append(row)
    report = {"trials": args.trials, "kernels": args.kernels, "rounds": args.rounds,
              "tune_jax_samples": args.tune_jax_samples, "interpret": args.interpret,
              "tune_jax_grid": TUNE_JAX_GRID, "problems": out,
              "over_best_peer_geomean": geomean([p["ratios"]["over_best_peer"] for p in out
                                                 if p.get("ratios", {}).get("over_best_peer")])}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
