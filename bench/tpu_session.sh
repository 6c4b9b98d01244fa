#!/usr/bin/env bash
# The chip runs of issue 54 on one TPU VM, in stages (each fits one 10-minute device command;
# the wheels of the `tune` extra ride along in .whl-tpu, see docs/chip-results.md):
#   bash bench/tpu_session.sh tier         # the hardware tier: $OUT/tier.json, tier.log
#   bash bench/tpu_session.sh tune KERNEL TRIALS [tune flags]  # $OUT/tune-KERNEL.jsonl, a fresh-
#                                            process check of its winner: verify-KERNEL.json
#   bash bench/tpu_session.sh kerneltests   # the CPU suite's kernel test files, on the chip:
#                                            $OUT/kerneltests.log (issue 54)
#   bash bench/tpu_session.sh backward     # dS in one MXU pass (ours) against two, splash:
#                                            $OUT/backward.json (issue 56, goal 2)
#   bash bench/tpu_session.sh handset PROBLEMS TRIALS [flags]  # tuned against every hand-set
#                                            config, grid problems PROBLEMS (e.g. 1,3; flags:
#                                            bench/chip/handset.py's): $OUT/handset-*.json
#   bash bench/tpu_session.sh cost TRIALS [flags]  # trials per minute before and now (flags:
#                                            bench/chip/trial_cost.py's): $OUT/trial-cost.json
#   bash bench/tpu_session.sh landscape KERNEL TRIALS SECONDS [DB]  # a random sample of the
#                                            space up to TRIALS in all (DB: a study to go on
#                                            with, e.g. one kept from an earlier run):
#                                            $OUT/landscape-KERNEL.json.gz and .db (goal 4)
#   bash bench/tpu_session.sh model MODEL SEQ TRIALS [flags]  # a training step tuned with
#                                            tune_model against each candidate tuned alone,
#                                            MaxText's splash and XLA, with the tune's figures
#                                            and each step's device time by op (flags:
#                                            bench/chip/model_step.py's, e.g. --kernels, --variants,
#                                            --db): $OUT/model-MODEL-SEQ.json (issue 63, item 2)
#   bash bench/tpu_session.sh long NAME KERNELS TRIALS PROBLEM-FLAGS  # as tune, a problem of
#                                            its own: $OUT/tune-NAME.jsonl, verify-NAME.json
#   bash bench/tpu_session.sh steptime [PROBLEMS]  # every kernel's tuner figure against the
#                                            wall time of 10 back-to-back calls, problems
#                                            PROBLEMS (1, 2 or 1,2, the default):
#                                            $OUT/step-time-PROBLEMS.json (issue 60, item 1)
#   bash bench/tpu_session.sh flash_ablation [flags]  # each .ablation/NAME.py, a copy of
#                                            kernel/backends/flash/pallas.py made before the run
#                                            (the chip's copy has no .git; carry .ablation):
#                                            git show REV:kernel/backends/flash/pallas.py \
#                                              > .ablation/NAME.py
#                                            against splash over the step: $OUT/flash-ablation.json
#                                            (issue 61; flags: bench/chip/flash_ablation.py's)
#   bash bench/tpu_session.sh peers PROBLEMS [flags]  # our published choice against tokamax's
#                                            autotune and tune-jax, grid problems PROBLEMS
#                                            (flags: bench/chip/peers.py's; wheels: bash
#                                            bench/chip_wheels.sh peers): $OUT/peers-*.json
#                                            (issue 72)
#   bash bench/tpu_session.sh kernelpeers [pytest flags]  # tests/test_kernel_peers.py on the chip,
#                                            e.g. -k large_logits (issue 74's float32 case):
#                                            $OUT/kernelpeers.log
#   bash bench/tpu_session.sh live KERNEL SEEDS TRIALS SECONDS [DB]  # our searcher against
#                                            plain TPE and random, each run for real per seed
#                                            until SECONDS (resume: DB, the .db a call returned):
#                                            $OUT/live-KERNEL.json and .db (issue 63, item 3)
#   bash bench/tpu_session.sh context_parallel [flags]  # the training step of
#                                            context_parallel_attention on a one-device
#                                            sequence axis against the plain call (goal: at
#                                            most 1.02x; flags: bench/chip/context_parallel.py's):
#                                            $OUT/context-parallel.json (issue 71, item 8)
#   bash bench/tpu_session.sh sharded_step TRIALS [flags]  # issue 71's Gemma-2-style step on
#                                            one device, MaxText's style (kernel.maxtext's
#                                            drop-in) and set_mesh's, tuned with tune_model, run
#                                            with no fallback, and the maxtext export of its
#                                            layer types (flags: bench/chip/sharded_step.py's):
#                                            $OUT/sharded-step.json (issue 71, items 4 and 5)
#   bash bench/tpu_session.sh serve_tune MODELS TRIALS [flags]  # the rpa serving keys of the
#                                            decode loop's MODELS (e.g. llama3-8b,qwen2-7b, or a
#                                            shapes file of serving problems; flags:
#                                            bench/chip/serve_step.py's key flags, e.g. --seqs
#                                            32,256 --tokens 2048) tuned over their batch
#                                            compositions, resuming the study of SERVE_DB (a
#                                            serve.db an earlier call returned): $OUT/serve.db,
#                                            serve-tune.jsonl (each key's baselines.jax: JAX's
#                                            own choice beside the winner), serve-table.json and
#                                            tuned_block_sizes_v5e.py/.json (issue 73, items 2-4);
#                                            SERVE_TUNE_S caps the tune's seconds (what finished
#                                            is exported)
#   bash bench/tpu_session.sh serve_step MODEL SEQS TABLE [flags]  # the decode loop's tokens/s
#                                            under TABLE (a serve-table.json an earlier call
#                                            returned), JAX's block sizes and the default, each
#                                            checked against the reference (flags:
#                                            bench/chip/serve_step.py's): $OUT/serve-step-MODEL-
#                                            SEQS.json (issue 73, item 5)
# KERNEL "choice" tunes the default kernel choice. Results land in $OUT (default ./chip-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-chip-out}; mkdir -p "$OUT"
SITE=/tmp/site
if [ ! -d "$SITE" ]; then
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
        --no-compile --no-cache-dir --target "$SITE" .whl-tpu/*.whl || exit 1
    from_index=(matplotlib scikit-learn)  # the peers' needs too, where their wheels came along
    ls .whl-tpu/tokamax-*.whl >/dev/null 2>&1 && from_index+=(flax optax jaxtyping)
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
        --index-url file:///opt/pypi/simple --target /tmp/site-index "${from_index[@]}" \
        || exit 1
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD:$SITE:/tmp/site-index PYTHONUNBUFFERED=1
PROBLEM=(--batch 4 --q-heads 16 --q-len 4096 --head-dim 128 --dtype bfloat16 --causal
         --mode fwd_bwd)
tune_and_verify() {  # NAME TUNE-FLAGS...: $OUT/tune-NAME.jsonl, then its winner checked in a
                     # fresh process: $OUT/verify-NAME.json
    local name=$1; shift
    python3 -m autotune tune "$@" --db "sqlite:////tmp/tune-$name.db" --json \
        > "$OUT/tune-$name.jsonl" 2> "$OUT/tune-$name.err"
    echo "tune exit $?"; tail -c 3000 "$OUT/tune-$name.jsonl"; tail -n 5 "$OUT/tune-$name.err"
    python3 bench/chip/verify_published.py "$OUT/tune-$name.jsonl" --out "$OUT/verify-$name.json" \
        2>&1 | tail -n 30
}
case "$1" in
verify)  # a tune output kept from an earlier run
    python3 bench/chip/verify_published.py "$2" --out "$OUT/verify-$(basename "$2" .jsonl).json" \
        2>&1 | tail -n 30 ;;
tier)
    AUTOTUNE_TIER_SUMMARY=$OUT/tier.json timeout 480 python3 -m pytest -o addopts= -m tpu -p no:cacheprovider \
        -q -rfE tests/test_tpu_tier.py 2>&1 | tee "$OUT/tier.log" | tail -n 40 ;;
tune)
    kernel=$2 trials=$3; shift 3
    flags=(--kernel "$kernel"); [ "$kernel" = choice ] && flags=()
    tune_and_verify "$kernel" "${PROBLEM[@]}" "${flags[@]}" --trials "$trials" "$@" ;;
long)  # NAME KERNELS TRIALS PROBLEM-FLAGS...: a problem of its own, kernels a,b (issue 60)
    name=$2 kernels=$3 trials=$4; shift 4
    tune_and_verify "$name" "$@" --kernels "$kernels" --trials "$trials" ;;
kerneltests)  # less the one test that needs a loopback server: the chip VM has no sockets
    timeout 540 python3 -m pytest -o addopts= -p no:cacheprovider -q -rfE \
        tests/test_kernel_numerics.py tests/test_flash_features.py tests/test_splash.py \
        tests/test_tokamax_splash.py \
        --deselect tests/test_splash.py::test_the_service_stores_and_answers_flags_enums_and_unused_blocks \
        > "$OUT/kerneltests.log" 2>&1
    echo "pytest exit $?"; tail -n 40 "$OUT/kerneltests.log" ;;
kernelpeers)
    shift
    timeout 540 python3 -m pytest -o addopts= -p no:cacheprovider -q -rfE \
        tests/test_kernel_peers.py "$@" > "$OUT/kernelpeers.log" 2>&1
    echo "pytest exit $?"; tail -n 40 "$OUT/kernelpeers.log" ;;
backward)
    python3 bench/chip/backward_passes.py --out "$OUT/backward.json" 2> "$OUT/backward.err" \
        | tail -n 60 ;;
flash_ablation)
    shift
    variants=(); for f in .ablation/*.py; do variants+=(--variant "$(basename "$f" .py)=$f"); done
    python3 bench/chip/flash_ablation.py "${variants[@]}" "$@" --out "$OUT/flash-ablation.json" \
        2> "$OUT/flash-ablation.err" | tail -n 80 ;;
handset)
    python3 bench/chip/handset.py --problems "$2" --trials "$3" "${@:4}" \
        --out "$OUT/handset-${2//,/-}.json" 2> "$OUT/handset-${2//,/-}.err" | tail -n 80 ;;
peers)
    python3 bench/chip/peers.py --problems "$2" "${@:3}" \
        --out "$OUT/peers-${2//,/-}.json" 2> "$OUT/peers-${2//,/-}.err" | tail -n 60 ;;
cost)
    python3 bench/chip/trial_cost.py --trials "$2" "${@:3}" --out "$OUT/trial-cost.json" \
        2> "$OUT/trial-cost.err" | tail -n 60 ;;
steptime)
    problems=${2:-1,2}
    python3 bench/chip/step_time.py --problems "$problems" --out "$OUT/step-time-${problems//,/-}.json" \
        2> "$OUT/step-time-${problems//,/-}.err" | tail -n 80 ;;
landscape)
    kernel=$2 trials=$3 seconds=$4 db=sqlite:////tmp/landscape-$2.db
    [ -n "${5:-}" ] && cp "$5" "/tmp/landscape-$kernel.db"
    python3 -m autotune tune "${PROBLEM[@]}" --kernel "$kernel" --trials "$trials" \
        --sampler random --timeout "$seconds" --db "$db" --json \
        > "$OUT/landscape-$kernel.jsonl" 2> "$OUT/landscape-$kernel.err"
    echo "tune exit $?"; tail -n 3 "$OUT/landscape-$kernel.err"
    study=$(python3 -c 'import json, sys
print([json.loads(l) for l in open(sys.argv[1]) if "best_config" in l][-1]["study"])' \
        "$OUT/landscape-$kernel.jsonl")
    python3 -m autotune landscape "$study" --partial --db "$db" \
        -o "$OUT/landscape-$kernel.json.gz"
    cp "/tmp/landscape-$kernel.db" "$OUT/" ;;
live)  # KERNEL SEEDS TRIALS SECONDS [DB]: ours, plain TPE and random run for real, one study
        # each per seed (bench/search/live_search.py), resumed from DB (one kept from an earlier call)
    kernel=$2 db=/tmp/live-$2.db
    [ -n "${6:-}" ] && cp "$6" "$db"
    python3 bench/search/live_search.py run --db "sqlite:///$db" --kernel "$kernel" --seeds "$3" \
        --trials "$4" --time-limit "$5" -- "${PROBLEM[@]}" 2>&1 | tail -n 20
    python3 bench/search/live_search.py score --db "sqlite:///$db" --kernel "$kernel" --seeds "$3" \
        --budgets "10,$4" --out "$OUT/live-$kernel.json" 2>&1 | tail -n 40
    cp "$db" "$OUT/" ;;
model)
    name=model-$2-$3
    python3 bench/chip/model_step.py --model "$2" --seq "$3" --trials "$4" "${@:5}" \
        --out "$OUT/$name.json" 2> "$OUT/$name.err" > /dev/null
    echo "model_step exit $?"; tail -n 5 "$OUT/$name.err"
    # The figures in the output too: a call's files can stay behind (at most 8 come back).
    python3 -c 'import json, sys
report = json.load(open(sys.argv[1]))
for problem, tune in report["tune"].items():
    print(problem, json.dumps(tune)[:400])
for name, row in report["variants"].items():
    time = row.get("device_time") or {}
    print(name, row.get("error") or {key: row.get(key) for key in ("median_ms", "over_tuned")}
          | {key: time.get(key) for key in ("kernels_ms", "outside_kernels_ms")})' \
        "$OUT/$name.json" ;;
context_parallel)
    shift
    python3 bench/chip/context_parallel.py "$@" --out "$OUT/context-parallel.json" \
        2> "$OUT/context-parallel.err" | tail -n 40 ;;
sharded_step)
    python3 bench/chip/sharded_step.py --trials "$2" "${@:3}" --out "$OUT/sharded-step.json" \
        2> "$OUT/sharded-step.err" > /dev/null
    echo "sharded_step exit $?"; tail -n 5 "$OUT/sharded-step.err"
    python3 -c 'import json, sys
report = json.load(open(sys.argv[1]))
for style, row in report["styles"].items():
    print(style, {key: row.get(key) for key in ("median_ms", "loss", "fallbacks")})
    for key, why in row["ran"].items():
        print("  ", key, "<-", why)
print("export", json.dumps(report["export"], indent=1))' "$OUT/sharded-step.json" ;;
serve_tune)  # MODELS TRIALS [serve_step.py key flags]
    db=/tmp/serve.db; [ -n "${SERVE_DB:-}" ] && cp "$SERVE_DB" "$db"
    if [ -f "$2" ]; then cp "$2" "$OUT/serve-shapes.yaml"  # a shapes file of its own keys
    else python3 bench/chip/serve_step.py --write-shapes "$OUT/serve-shapes.yaml" --models "$2" \
        "${@:4}" || exit 1; fi
    timeout "${SERVE_TUNE_S:-0}" python3 -m autotune tune --kernel rpa \
        --shapes "$OUT/serve-shapes.yaml" --trials "$3" --db "sqlite:///$db" --json > "$OUT/serve-tune.jsonl" 2> "$OUT/serve-tune.err"
    echo "tune exit $?"; tail -n 5 "$OUT/serve-tune.err"
    python3 -m autotune export --kernel rpa --db "sqlite:///$db" -o "$OUT/serve-table.json"
    python3 -m autotune export --kernel rpa --format jax-rpa --jax-device-key \
        --db "sqlite:///$db" -o "$OUT/tuned_block_sizes_v5e.py"
    cp "$db" "$OUT/"
    python3 -c 'import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    if row.get("summary"):
        print(row["problem"], row["best_config"], row["best_time_ms"], row["speedup"],
              json.dumps(row["baselines"]))' "$OUT/serve-tune.jsonl" ;;
serve_step)  # MODEL SEQS TABLE [flags]
    name=serve-step-$2-$3
    python3 bench/chip/serve_step.py --model "$2" --seqs "$3" --table "$4" "${@:5}" \
        --out "$OUT/$name.json" 2> "$OUT/$name.err" | tail -n 60
    tail -n 5 "$OUT/$name.err" ;;
esac
