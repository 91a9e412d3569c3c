#!/usr/bin/env bash
# Everything this project measures on a GPU or TPU, in one run sized for a short lease:
#   1. the device and the software (env.txt);
#   2. the fused residual-rate kernel, compiled for the device: checked against the XLA reference
#      (forward and gradients over the CPU tests' shapes), then timed against XLA and the copy-bandwidth
#      roofline at d=4096 bf16 with and without the low-rank term, and at the embedded default's width;
#   3. `m2r2 bench` on a base and its M2R2 checkpoint, greedy batch 1, the fast stream's update on
#      XLA and, when the kernel checks passed, on the kernel (--kernel_implementation=pallas);
#   4. with MOE_BASE and MOE_M2R2 set: `m2r2 moe-bench` on that MoE base, its real offload engine
#      calibrated on the device (host -> device expert copies, per-layer compute) and its ladder.
# Each stage has its own time limit and log, so a failing stage does not cost the others; the last
# lines printed are the tables.
#
#   launch/accelerator_check.sh OUT BASE_DIR M2R2_DIR [PROMPTS]
#
# PROMPTS: a prompt set name or jsonl file for m2r2 bench (default mt_bench). PYTHON: the interpreter
# (default python3). BENCH_ARGS: extra flags for m2r2 bench. CHECK_CASES: which of kernels/bench.py's
# CHECK_CASES to compile and check (e.g. 11,12; default all). MOE_BASE, MOE_M2R2, MOE_ARGS: the MoE
# stage's checkpoints and extra flags; MOE_PROMPTS: its prompt file (default PROMPTS, which must then
# be a file). DRY_RUN=1: print the stages' commands.
set -uo pipefail

if [[ $# -lt 3 ]]; then
  echo "accelerator_check.sh: error: usage: launch/accelerator_check.sh OUT BASE_DIR M2R2_DIR [PROMPTS]" >&2
  exit 2
fi
OUT=$1 BASE=$2 M2R2=$3 PROMPTS=${4:-mt_bench}
PY=${PYTHON:-python3}
if [[ -n ${MOE_BASE:-} || -n ${MOE_M2R2:-} ]] && [[ -z ${MOE_BASE:-} || -z ${MOE_M2R2:-} ]]; then
  echo "accelerator_check.sh: error: set both MOE_BASE and MOE_M2R2, or neither" >&2
  exit 2
fi
for d in "$BASE" "$M2R2" ${MOE_BASE:+"$MOE_BASE" "$MOE_M2R2"}; do
  [[ -d $d ]] || { echo "accelerator_check.sh: error: no such directory: $d" >&2; exit 2; }
done
MOE_PROMPTS=${MOE_PROMPTS:-$PROMPTS}
if [[ -n ${MOE_BASE:-} && ! -f $MOE_PROMPTS ]]; then
  echo "accelerator_check.sh: error: the MoE stage needs a prompt file (PROMPTS or MOE_PROMPTS), got $MOE_PROMPTS" >&2
  exit 2
fi
[[ "${DRY_RUN:-0}" == 1 ]] || mkdir -p "$OUT"
START=$(date +%s)

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to OUT/NAME.log, report rc and time
  local name=$1 limit=$2 t0 rc
  shift 2
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%s: ' "$name"; printf '%q ' "$@"; echo
    return 0
  fi
  t0=$(date +%s)
  echo "== $name (limit ${limit}s, at +$((t0 - START))s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name: rc=$rc in $(($(date +%s) - t0))s"
  return $rc
}

[[ "${DRY_RUN:-0}" == 1 ]] || {
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null
  "$PY" - <<'EOF'
import importlib.metadata as md
import jax
print("jax devices:", jax.devices())
for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, "missing")
EOF
} >"$OUT/env.txt" 2>&1
[[ "${DRY_RUN:-0}" == 1 ]] || cat "$OUT/env.txt"

KB=("$PY" -m m2r2_jax.kernels.bench --iters 20 --calls 10)
stage kernels_d4096_r16 240 "${KB[@]}" ${CHECK_CASES:+--check-cases "$CHECK_CASES"} --d 4096 --rank 16 \
  --dtype bfloat16 --out "$OUT/kernels_d4096_r16.json"
KERNEL_RC=$?
stage kernels_d4096_r0 60 "${KB[@]}" --skip-checks --d 4096 --rank 0 --dtype bfloat16 \
  --out "$OUT/kernels_d4096_r0.json"
stage kernels_d192_r8 60 "${KB[@]}" --skip-checks --d 192 --rank 8 --dtype float32 --decode-rows 1,5 \
  --train-rows 4096 --out "$OUT/kernels_d192_r8.json"

BENCH=("$PY" -m m2r2_jax.cli.main bench "--checkpoint=$BASE" "--m2r2=$M2R2" "--prompts=$PROMPTS"
       --batch_sizes=1 ${BENCH_ARGS:-})
stage bench_xla 180 "${BENCH[@]}" --kernel_implementation=xla "--out=$OUT/bench_xla"
if [[ $KERNEL_RC -eq 0 ]]; then
  stage bench_pallas 180 "${BENCH[@]}" --kernel_implementation=pallas "--out=$OUT/bench_pallas"
else
  echo "== bench_pallas skipped: the kernel checks did not pass (rc=$KERNEL_RC)"
fi

if [[ -n ${MOE_BASE:-} ]]; then
  stage moe_bench 240 "$PY" -m m2r2_jax.cli.main moe-bench "--checkpoint=$MOE_BASE" "--m2r2=$MOE_M2R2" \
    "--prompts=$MOE_PROMPTS" "--out=$OUT/moe_bench" ${MOE_ARGS:-}
fi

[[ "${DRY_RUN:-0}" == 1 ]] && exit 0
echo
for f in "$OUT"/kernels_*.log; do
  echo "--- $(basename "$f")"
  grep -v "^check " "$f" | tail -n 14
done
grep -h "FAILED\|Error" "$OUT"/kernels_d4096_r16.log | head -n 12
for b in bench_xla bench_pallas; do
  [[ -f $OUT/$b.log ]] || continue
  echo "--- $b"
  grep -v "^\[bench\]\|it/s\]" "$OUT/$b.log" | tail -n 16
done
if [[ -f $OUT/moe_bench.log ]]; then
  echo "--- moe_bench"
  grep -v "it/s\]\|s/it\]" "$OUT/moe_bench.log" | tail -n 30
fi
echo "total: $(($(date +%s) - START))s"
