#!/usr/bin/env bash
# vt's GPU tests under compute-sanitizer: memcheck, initcheck, racecheck and synccheck.
# Usage: tools/sanitize.sh [memcheck|initcheck|racecheck|synccheck|all] [pytest targets...]
#   (default: all; targets default per tool, below). Prints each run's pytest summary and
#   the sanitizer's summary line; exits non-zero if any run reports an error, fails a test, or
#   prints no summary at all.
#
# Every run passes --error-exitcode 1: compute-sanitizer's default exit code for reported
# errors is 0, so without it a run with errors would pass.
#
# memcheck (--leak-check full) and initcheck run over `tests` (or the targets) in pool debug
# mode (VT_POOL_DEBUG=1: one cudaMalloc of the exact requested size per buffer, so an overrun
# past a buffer, or a read of bytes nobody wrote, is seen per buffer), in two runs each,
# because the sanitizer counts every failing CUDA API call, deliberate ones included:
#   1. tests marked gpu and not api_errors, with the default API error reporting;
#   2. tests marked gpu and api_errors (they provoke CUDA errors on purpose) with
#      --report-api-errors no, so that only memory errors and leaks count.
# Tests marked torch_allocator (the PyTorch peer of vt bench, vt.torch) are excluded too:
# PyTorch's caching allocator keeps its blocks until the process exits, which --leak-check
# reports; memcheck runs them in a third run without the leak check.
# Tests marked needs_overlap are excluded from both runs: they assert that the host ran ahead
# of the device (unguarded + POISON mismatches, the host-overwrite hazard), and
# compute-sanitizer serializes kernel launches, which removes that overlap, so under it they
# fail for a reason that is not a memory error. They run in the normal suite (GPU and sim).
#
# initcheck does not see cuBLAS's writes (measured: every GEMM output reads as uninitialised),
# so its runs set VT_INITCHECK=1: vt/bundled/kernels/gemm.py then zero-fills each GEMM output
# with a CuPy kernel before cuBLAS writes it, and the vt kernels that read GEMM outputs are
# checked on what they really read.
#
# racecheck (shared-memory hazards) and synccheck (barrier misuse) run over vt's own kernels
# only: tests/bundled/test_kernels.py (or the targets) with -k "not gemm", because cuBLAS's
# kernels give false reports under both. Targets given for them must not reach cuBLAS either.
#
# Host backtraces are off (--show-backtrace no) by default: with them on, compute-sanitizer
# 2025.3 keeps the Python frames that were on the stack at each cudaMalloc alive (for its
# report), and with them every local of those frames — a pool DeviceBuffer held by a finished
# `be.empty` frame never returns to the pool, and the tests that check that it does fail under
# the sanitizer only (measured on the H200). Set SANITIZER_OPTS to override
# (e.g. SANITIZER_OPTS="--show-backtrace yes" to locate a reported error).
# Logs: SANITIZE_LOGS (default: a new /tmp/vt-sanitize.XXXXXX), one per run.
set -uo pipefail
cd "$(dirname "$0")/.."

tools=(memcheck initcheck racecheck synccheck)
case "${1:-all}" in
  all) [ $# -gt 0 ] && shift ;;
  memcheck|initcheck|racecheck|synccheck) tools=("$1"); shift ;;
  -h|--help) sed -n '2,4p' "$0"; exit 0 ;;
  *) echo "sanitize: unknown tool '$1' (expected memcheck, initcheck, racecheck, synccheck or all)" >&2
     exit 2 ;;
esac
targets=("$@")
sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [ ! -x "$sanitizer" ]; then
  echo "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER=/path/to/compute-sanitizer)" >&2
  exit 2
fi
sanitizer_opts=${SANITIZER_OPTS---show-backtrace no}
export VT_POOL_DEBUG=1
export PYTHONUNBUFFERED=1
logs=${SANITIZE_LOGS:-$(mktemp -d /tmp/vt-sanitize.XXXXXX)}
mkdir -p "$logs"
status=0

run() {  # run TOOL NAME MARKER -- PYTEST_ARGS... [--- EXTRA_SANITIZER_OPTS...]
  local tool=$1 name=$2 marker=$3
  shift 4
  local pytest_args=() extra=()
  while [ $# -gt 0 ] && [ "$1" != "---" ]; do pytest_args+=("$1"); shift; done
  [ $# -gt 0 ] && shift && extra=("$@")
  local log="$logs/$tool-$name.log"
  echo "=== $tool $name: pytest -m \"$marker\" ${pytest_args[*]}  (sanitizer options: $sanitizer_opts ${extra[*]})"
  # shellcheck disable=SC2086  # sanitizer_opts is a list of options
  VT_INITCHECK=$([ "$tool" = initcheck ] && echo 1 || echo 0) \
    "$sanitizer" --tool "$tool" --error-exitcode 1 --target-processes all $sanitizer_opts "${extra[@]}" \
    python3 -m pytest -q -rs -p no:cacheprovider -m "$marker" "${pytest_args[@]}" >"$log" 2>&1
  local rc=$?
  # pytest's own summary (last lines not written by the sanitizer), then the sanitizer's.
  grep -v '^=========' "$log" | tail -n 8
  local summary
  summary=$(grep -E '^========= (ERROR|RACECHECK) SUMMARY' "$log" | grep -v 'not printed' | tail -n 1)
  if [ -z "$summary" ]; then
    echo "$tool $name: no summary line (did the sanitizer run?); full log: $log"
    status=1
  else
    echo "$summary"
    if ! grep -qE 'SUMMARY: 0 errors|\(0 errors' <<<"$summary"; then
      grep -E '^=========' "$log" | head -n 60
      status=1
    fi
  fi
  if [ "$rc" -eq 5 ]; then
    echo "$tool $name: no tests selected by -m \"$marker\" in ${pytest_args[*]}"
  elif [ "$rc" -ne 0 ]; then
    echo "$tool $name: exit status $rc; full log: $log"
    status=1
  fi
}

for tool in "${tools[@]}"; do
  case $tool in
    memcheck|initcheck)
      t=("${targets[@]}"); [ ${#t[@]} -gt 0 ] || t=(tests)
      leak=(); [ "$tool" = memcheck ] && leak=(--leak-check full)
      run "$tool" default-api-errors "gpu and not api_errors and not needs_overlap and not torch_allocator" -- "${t[@]}" --- "${leak[@]}"
      run "$tool" api-errors-not-reported "gpu and api_errors and not needs_overlap and not torch_allocator" -- "${t[@]}" \
        --- "${leak[@]}" --report-api-errors no
      # torch_allocator tests: memory errors only. No leak check (torch's cache keeps its
      # blocks to the end) and no API errors (torch probes the driver, failing on purpose).
      [ "$tool" = memcheck ] && run "$tool" torch-allocator "gpu and torch_allocator and not needs_overlap" \
        -- "${t[@]}" --- --report-api-errors no ;;
    racecheck|synccheck)
      t=("${targets[@]}"); [ ${#t[@]} -gt 0 ] || t=(tests/bundled/test_kernels.py)
      run "$tool" vt-kernels "gpu" -- "${t[@]}" -k "not gemm" ;;
  esac
done
echo "sanitize logs: $logs"
[ "$status" -eq 0 ] && echo "sanitize: PASS (${tools[*]}: 0 errors)" || echo "sanitize: FAIL"
exit "$status"
