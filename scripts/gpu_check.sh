#!/usr/bin/env bash
# The device check of one NVIDIA GPU (issue #41): ≤ 7.6 minutes of time boxes on one H100/H200, writes
# $OUT/{env.txt,log.txt,toy_compare.json,bench.jsonl,verdict.txt} (results/gpu/README.md: what ran, what came out).
#
#   bash scripts/gpu_check.sh          on the GPU machine (the image's jax; no network)
#   bash scripts/gpu_check.sh --dry    CPU only, tiny: every phase's code path in ~1 minute (tests/test_gpu_check.py)
#
# Uses, when present: .whl/*.whl (missing pure-Python deps, installed into /tmp/site and put on PYTHONPATH; the
# project itself is used from this checkout through PYTHONPATH, not installed) and .whl/store (the `stdlib`
# corpus's byte token store, made on a machine with TensorFlow: the GPU image has none, so it cannot tokenize).
#
# Phases (each under `timeout`; a phase that fails or times out is named in the log and verdict.txt, the next runs):
#   setup 30 s · env 30 s · toy 200 s (GPU and CPU sides at once: DP, DiLoCo, Streaming, 120 steps, same corpus,
#   JAX_DEFAULT_MATMUL_PRECISION=highest on both; then Streaming on the GPU at default precision = TF32) ·
#   compare 20 s · bench 35M DP 80 s · bench 35M Streaming M=2 80 s · verdict 15 s  (455 s in all)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$OUT"
rm -f "$OUT"/{env.txt,toy_compare.json,bench.jsonl,verdict.txt}
RUNS=$(mktemp -d /tmp/gpu_check_runs.XXXXXX)
WHL=${GPU_CHECK_WHL:-$PWD/.whl}  # the wheels and the token store (another folder: when run from a copy of the tree)
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

. scripts/phase.sh  # phase NAME SECONDS CMD...

setup() {
  if [ "$DRY" = 0 ] && ls "$WHL"/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | head -3 || true
}

toy_run() {  # toy_run METHOD SIDE(gpu|cpu|gpu-tf32)
  local m=$1 side=$2 plat=cuda prec=highest
  [ "$DRY" = 1 ] && plat=cpu
  [ "$side" = cpu ] && plat=cpu
  [ "$side" = gpu-tf32 ] && prec=""  # the GPU's default: TF32 matmuls
  local args=(--config "experiments/toy.py:$m" --workdir "$RUNS/$m-$side" --no_progress
              "--config.data=$DATA" --config.steps=120 --config.eval_every=40)
  [ "$DRY" = 1 ] && args+=(--config.scale=tiny --config.steps=8 --config.H=4 --config.log_every=2
                           --config.eval_every=4 --config.eval_batches=1)
  env JAX_PLATFORMS=$plat ${prec:+JAX_DEFAULT_MATMUL_PRECISION=$prec} XLA_PYTHON_CLIENT_PREALLOCATE=false \
    $PY -m diloco.cli train "${args[@]}" > "$RUNS/$m-$side.log" 2>&1
  echo "toy $m $side ($plat, ${prec:-default}): exit $? — $(tail -1 "$RUNS/$m-$side.log" | cut -c1-300)"
}

toy_side() {  # the GPU side runs one run at a time (one device); the CPU side's three at once
  if [ "$1" = gpu ]; then
    for m in dp diloco streaming; do toy_run "$m" gpu; done
    [ "$DRY" = 1 ] || toy_run streaming gpu-tf32
  else
    for m in dp diloco streaming; do toy_run "$m" cpu & done
    wait
  fi
}

toy() {
  export -f toy_run toy_side
  export RUNS DATA DRY PY
  toy_side gpu & local g=$!
  toy_side cpu & local c=$!
  wait $g $c
}

main() {
  echo "gpu_check: OUT=$OUT dry=$DRY commit=$(cat .gpu_check_commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null) $(date -u +%Y-%m-%dT%H:%M:%SZ) $(hostname)"
  phase setup 30 bash -c "$(declare -f setup); DRY=$DRY PY=$PY WHL=$WHL setup"
  [ "$DRY" = 0 ] && [ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  DATA=stdlib
  [ -f "$WHL/store/manifest.json" ] && DATA="tokens:$WHL/store"
  local plat=""
  [ "$DRY" = 1 ] && plat=cpu
  phase env 30 env ${plat:+JAX_PLATFORMS=$plat} $PY scripts/gpu_check.py env "$OUT"
  nvidia-smi >> "$OUT/env.txt" 2>&1 || echo "nvidia-smi: not here" >> "$OUT/env.txt"
  echo "data $DATA" >> "$OUT/env.txt"
  phase toy 200 bash -c "$(declare -f toy_run toy_side toy); RUNS=$RUNS DATA=$DATA DRY=$DRY PY=$PY toy"
  phase compare 20 $PY scripts/gpu_check.py compare "$OUT" "$RUNS"
  local dry=() steps=30
  [ "$DRY" = 1 ] && dry=(--dry) && steps=4
  phase bench-dp 80 env ${plat:+JAX_PLATFORMS=$plat} $PY scripts/gpu_check.py bench "$OUT" experiments/c4_scaling.py:35M,dp \
    --steps $steps "${dry[@]}"
  phase bench-streaming 80 env ${plat:+JAX_PLATFORMS=$plat} $PY scripts/gpu_check.py bench "$OUT" \
    experiments/c4_scaling.py:35M,streaming_ovl_fp4_h30 --steps $steps "${dry[@]}"
  phase verdict 15 $PY scripts/gpu_check.py verdict "$OUT"
  for f in "$RUNS"/*.log; do echo "--- tail of $f"; tail -5 "$f"; done
  echo "gpu_check: done in $SECONDS s"
}

main 2>&1 | tee "$OUT/log.txt"
