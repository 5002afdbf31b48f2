# Sourced by the device checks (scripts/gpu_check.sh, scripts/gpu_check_accum.sh).
# phase NAME SECONDS CMD...: CMD time-boxed, its outcome one line; always returns 0 so the next phase runs.
phase() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== phase $name (limit ${limit} s) $(date -u +%H:%M:%S)"
  timeout --kill-after=5 "$limit" "$@"
  rc=$?
  case $rc in
    0) echo "== phase $name: ok in $((SECONDS - t0)) s" ;;
    124|137) echo "== phase $name: TIMED OUT at ${limit} s" ;;
    *) echo "== phase $name: FAILED (exit $rc) in $((SECONDS - t0)) s" ;;
  esac
  return 0
}
