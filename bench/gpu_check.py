"""Tunes the ``pallas_gpu`` kernel (JAX's Pallas Triton attention) on one GPU and compares, in
the same run, the tuned config with the kernel's default config and with cuDNN attention
(the ``cudnn`` backend: ``jax.nn.dot_product_attention(..., implementation="cudnn")``).

Per mode (``fwd``, ``fwd_bwd``): a small Optuna search (``autotune.search``, our TPE sampler,
the default config measured first), then the default, the best configs and cuDNN re-measured
interleaved (A B C A B C ...) so drift hits all alike. Every config is checked against the XLA
reference before it is timed. Prints one line per mode and a JSON line with the figures.
All three run in our layout ``[batch, heads, seq, head_dim]`` (the transposes to the kernels'
``[batch, seq, heads, head_dim]`` are part of every measured function).

On a GPU machine with jax and CUDA; the project need not be installed, but what its search
imports must be: the ``tune`` extra's optuna, scikit-learn, SQLAlchemy, Alembic, pydantic and
pydantic-settings (with python-dotenv), and its xprof, which reads the profiler trace for
device timing (without it the run times with ``loop`` and says so). Without network access,
bring the missing ones as wheels: on a machine with network, from the repository root::

    pip download --only-binary=:all: --python-version 3.12 \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 --dest .whl \\
        optuna sqlalchemy alembic pydantic pydantic-settings python-dotenv xprof

(``.whl/`` is ignored by git; add ``--no-deps`` and name each missing dependency when the
machine already has most of them: xprof's own dependencies are large). Then on the GPU
machine::

    python -m pip install --no-index --find-links .whl --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python bench/gpu_check.py             # 4x16x4096x128 bf16 causal

On this CPU-only host the kernels run in interpret mode (a correctness run of the pipeline;
the times say nothing about a GPU)::

    python bench/gpu_check.py --interpret --shape 1,2,256,64 --trials 4

``--landscape DIR`` measures every legal config instead (``--sampler grid``) and writes each
mode's space as a landscape file, ``DIR/pallas_gpu-<device>-<mode>.json.gz``, that
``bench/search.py DIR`` and ``autotune replay`` replay: the searcher judged on our own kernel
family on a real chip. The forward space of the default shape is 200 configs, a few minutes::

    PYTHONPATH=. python bench/gpu_check.py --modes fwd --landscape "$OUT" --choice none

Then it runs ``bench/choice.py`` (``--choice grid|full|none``): every candidate kernel's
confirmed time and the chosen kernel over a grid of shapes (this part needs the project's
dependencies too: it tunes and stores through ``autotune`` and ``storage``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
STUDY = "gpu_check"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true",
                        help="run on CPU in interpret mode (tiny default shape)")
    parser.add_argument("--shape", default=None,
                        help="batch,heads,seq,head_dim (default 4,16,4096,128; "
                             "1,2,256,64 with --interpret)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--modes", default="fwd,fwd_bwd")
    parser.add_argument("--trials", type=int, default=16, help="configs measured per mode")
    parser.add_argument("--top", type=int, default=2, help="best configs re-measured")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--landscape", type=Path, default=None,
                        help="measure every legal config and write each mode's landscape file "
                             "to this folder (see above)")
    parser.add_argument("--choice", default=None, choices=["grid", "full", "none"],
                        help="then bench/choice.py (which kernel wins each shape): its default "
                             "grid, its full grid, or not (default: grid on the device, none "
                             "with --interpret)")
    return parser.parse_args()


def shape_of(args: argparse.Namespace) -> tuple[int, int, int, int]:
    text = args.shape or ("1,2,256,64" if args.interpret else "4,16,4096,128")
    try:
        batch, heads, seq, head_dim = (int(x) for x in text.split(","))
    except ValueError:
        sys.exit(f"--shape must be four integers batch,heads,seq,head_dim, got {text!r}")
    return batch, heads, seq, head_dim


def run_mode(problem: Any, args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import optuna

    from autotune.measure import Measurer, relative_error
    from autotune.search import search
    from autotune.searchspace import Space
    from kernel import device_target, get_kernel

    kernel = get_kernel("pallas_gpu")
    device = jax.devices()[0]
    target = device_target(device.platform, device.device_kind)
    default = kernel.default_config(problem, target)
    params = kernel.space_params(problem)
    space = Space(params, lambda p: kernel.is_legal(problem, default.replace(**p), target))
    measurer = Measurer(problem, default, kernel)
    storage = optuna.storages.InMemoryStorage()
    grid = args.landscape is not None  # one more trial than legal configs: ends "exhausted"
    start = time.perf_counter()
    try:
        result = search(space, measurer, trials=space.size + 1 if grid else args.trials,
                        sampler="grid" if grid else "tpe", seed=args.seed, storage=storage,
                        study_name=STUDY, seeds=[{name: getattr(default, name)
                                                  for name in space.names}])
        search_s = time.perf_counter() - start
        if grid:
            write_landscape(args.landscape, optuna.load_study(study_name=STUDY,
                                                              storage=storage), problem)
        ok = sorted((t for t in result.trials if t.measurement.ok), key=lambda t: t.value)
        best = list(dict.fromkeys(default.replace(**t.config) for t in ok))[:args.top]
        contenders = {"default": default}
        contenders.update((f"tuned{i}", c) for i, c in enumerate(c for c in best if c != default))
        executables = {name: measurer.compile(kernel.build(problem, config))[0]
                       for name, config in contenders.items()}
        baseline_error = None
        if device.platform == "gpu":
            try:
                cudnn = get_kernel("cudnn")
                program = measurer.compile(cudnn.build(problem,
                                                       cudnn.default_config(problem, target)))[0]
                baseline_error = relative_error(measurer.run(program), measurer.expected)
                executables["cudnn"] = program
            except Exception as error:  # noqa: BLE001 - cuDNN may not support the shape
                print(f"  cudnn unavailable: {str(error).splitlines()[0][:200]}")
        samples: dict[str, list[float]] = {name: [] for name in executables}
        for _ in range(args.rounds):
            for name, executable in executables.items():
                samples[name].append(measurer.time(executable, runs=3).median_ms)
    finally:
        measurer.close()
    median = {name: sorted(s)[len(s) // 2] for name, s in samples.items()}
    tuned = min(contenders, key=median.__getitem__)  # the default when nothing beat it
    return {
        "problem": problem.label(), "device": device.device_kind, "trials": result.measured,
        "failures": dict(Counter(t.measurement.status for t in result.trials
                                 if not t.measurement.ok)),
        "search_s": round(search_s, 1),
        "default_config": default.label(), "tuned_config": contenders[tuned].label(),
        "default_ms": median["default"], "tuned_ms": median[tuned],
        "cudnn_ms": median.get("cudnn"), "cudnn_max_error": baseline_error,
        "default_over_tuned": median["default"] / median[tuned],
        "cudnn_over_tuned": median["cudnn"] / median[tuned] if "cudnn" in median else None,
    }


def write_landscape(folder: Path, study: Any, problem: Any) -> None:
    """The grid ``study`` of ``problem`` as ``folder/pallas_gpu-<device>-<mode>.json.gz``."""
    import jax

    from autotune.landscape import save_landscape, study_document

    device = jax.devices()[0].device_kind
    for name, value in (("kernel", "pallas_gpu"), ("device_kind", device),
                        ("problem", problem.to_dict())):
        study.set_user_attr(name, value)
    document = study_document(study)
    document["name"] = "-".join(["pallas_gpu", *device.split(), problem.mode])
    path = folder / f"{document['name']}.json.gz"
    folder.mkdir(parents=True, exist_ok=True)
    save_landscape(document, path)
    print(f"  landscape: {len(document['records'])} configs -> {path}")


def main() -> None:
    args = parse_args()
    if args.interpret:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from kernel import Problem

    if not args.interpret and jax.devices()[0].platform != "gpu":
        sys.exit(f"no GPU found (JAX sees {jax.devices()[0].device_kind}); pass --interpret "
                 "to run on CPU")
    batch, heads, seq, head_dim = shape_of(args)
    for mode in args.modes.split(","):
        problem = Problem(batch, heads, heads, seq, seq, head_dim, dtype=args.dtype,
                          causal=args.causal, mode=mode)
        out = run_mode(problem, args)
        cudnn = (f"cudnn {out['cudnn_ms']:.3f} ms ({out['cudnn_over_tuned']:.2f}x tuned)"
                 if out["cudnn_ms"] else "cudnn n/a")
        print(f"{out['problem']}: tuned {out['tuned_ms']:.3f} ms [{out['tuned_config']}], "
              f"default {out['default_ms']:.3f} ms ({out['default_over_tuned']:.2f}x tuned), "
              f"{cudnn}; {out['trials']} trials in {out['search_s']} s, "
              f"failures {out['failures']}")
        print(json.dumps(out), flush=True)
    run_choice(args)


def run_choice(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """``bench/choice.py`` (beside this script) as ``--choice`` says: which kernel wins each
    shape of its grid here; None when not run."""
    mode = args.choice or ("none" if args.interpret else "grid")
    if mode == "none":
        return None
    import choice

    return choice.main(["--full"] if mode == "full" else [])


if __name__ == "__main__":
    main()
