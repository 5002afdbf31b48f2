#!/usr/bin/env bash
# Device check of gradient accumulation and the memory preflight on one NVIDIA GPU (issue #41): ≤ 5 minutes of time
# boxes on one H200, writes $OUT/{log.txt,accum.json,refuse.json} (scripts/gpu_check_accum.py: what each phase does).
#
#   bash scripts/gpu_check_accum.sh          on the GPU machine (the image's jax; no network)
#   bash scripts/gpu_check_accum.sh --dry    CPU only, tiny scales (tests/test_gpu_check.py)
#
# Uses .whl/*.whl when present, as scripts/gpu_check.sh does (missing pure-Python deps into /tmp/site).
# Phases: setup 20 s · accum 150 s (toy accum_steps 1/2/4 at highest precision; 35M DP bf16 accum 4 vs 1) ·
#   refuse 130 s (1B Streaming M=2 on the one GPU: refused; accum_steps=16: compiled, checked, one step run)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=()
[ "${1:-}" = "--dry" ] && DRY=(--dry)
OUT=${OUT:-$(mktemp -d /tmp/gpu_check_accum.XXXXXX)}
mkdir -p "$OUT"
WHL=${GPU_CHECK_WHL:-$PWD/.whl}
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}  # the pool `diloco train` gives a run
PY=${PYTHON:-python3}
PLAT=()
[ ${#DRY[@]} = 1 ] && PLAT=(JAX_PLATFORMS=cpu)

. scripts/phase.sh  # phase NAME SECONDS CMD...

main() {
  echo "gpu_check_accum: OUT=$OUT ${DRY[*]} commit=$(git rev-parse --short HEAD 2>/dev/null) $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  if [ ${#DRY[@]} = 0 ] && ls "$WHL"/*.whl >/dev/null 2>&1; then
    phase setup 20 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$WHL"/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -2 || true
  phase accum 150 env "${PLAT[@]}" JAX_DEFAULT_MATMUL_PRECISION=highest $PY scripts/gpu_check_accum.py accum "$OUT" "${DRY[@]}"
  phase refuse 130 env "${PLAT[@]}" $PY scripts/gpu_check_accum.py refuse "$OUT" "${DRY[@]}"
  echo "gpu_check_accum: done in $SECONDS s"
}

main 2>&1 | tee "$OUT/log.txt"
