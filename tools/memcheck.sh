#!/usr/bin/env bash
# compute-sanitizer memcheck (leak check full) over vt's GPU tests, in pool debug mode
# (VT_POOL_DEBUG=1: one cudaMalloc of the exact requested size per buffer, so an overrun
# past a buffer is an error).
#
# Two runs, because memcheck counts every failing CUDA API call, deliberate ones included:
#   1. tests marked gpu and not api_errors, with the default API error reporting;
#   2. tests marked gpu and api_errors (they provoke CUDA errors on purpose) with
#      --report-api-errors no, so that only memory errors and leaks count.
# Tests marked needs_overlap are excluded from both runs: they assert that the host ran ahead
# of the device (NO_DBUF + POISON mismatches, the unguarded hazard-C overwrite), and
# compute-sanitizer serializes kernel launches, which removes that overlap, so under it they
# fail for a reason that is not a memory error. They run in the normal suite (GPU and sim).
# Host backtraces are off (--show-backtrace no) by default: with them on, compute-sanitizer
# 2025.3 keeps the Python frames that were on the stack at each cudaMalloc alive (for its
# report), and with them every local of those frames — a pool DeviceBuffer held by a finished
# `be.empty` frame never returns to the pool, and the tests that check that it does fail under
# the sanitizer only (measured: docs/benchmarks.md, run 7). Set MEMCHECK_SANITIZER_OPTS to
# override (e.g. MEMCHECK_SANITIZER_OPTS="--show-backtrace yes" to locate a reported error).
# Usage: tools/memcheck.sh [pytest targets...]   (default: tests)
# Prints each run's pytest summary and ERROR SUMMARY line; exits non-zero if either run
# reports sanitizer errors, fails a test, or prints no ERROR SUMMARY at all.
set -uo pipefail
cd "$(dirname "$0")/.."

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(tests)
sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [ ! -x "$sanitizer" ]; then
  echo "memcheck: compute-sanitizer not found (set COMPUTE_SANITIZER=/path/to/compute-sanitizer)" >&2
  exit 2
fi
sanitizer_opts=${MEMCHECK_SANITIZER_OPTS---show-backtrace no}
export VT_POOL_DEBUG=1
export PYTHONUNBUFFERED=1
logs=${MEMCHECK_LOGS:-$(mktemp -d /tmp/vt-memcheck.XXXXXX)}
mkdir -p "$logs"
status=0

run() {  # run NAME MARKER [extra sanitizer options...]
  local name=$1 marker=$2
  shift 2
  local log="$logs/$name.log"
  echo "=== memcheck $name: pytest -m \"$marker\" ${targets[*]}  (sanitizer options: $sanitizer_opts $*)"
  "$sanitizer" --tool memcheck --leak-check full --error-exitcode 1 --target-processes all \
    $sanitizer_opts "$@" \
    python3 -m pytest -q -rs -p no:cacheprovider -m "$marker" "${targets[@]}" >"$log" 2>&1
  local rc=$?
  # pytest's own summary (last lines not written by the sanitizer), then the sanitizer's.
  grep -v '^=========' "$log" | tail -n 8
  local summary
  summary=$(grep -E '^========= ERROR SUMMARY' "$log" | tail -n 1)
  if [ -z "$summary" ]; then
    echo "memcheck $name: no ERROR SUMMARY line (did the sanitizer run?); full log: $log"
    status=1
  else
    echo "$summary"
    if ! grep -qE 'ERROR SUMMARY: 0 errors' <<<"$summary"; then
      grep -E '^=========' "$log" | head -n 60
      status=1
    fi
  fi
  if [ "$rc" -eq 5 ]; then
    echo "memcheck $name: no tests selected by -m \"$marker\" in ${targets[*]}"
  elif [ "$rc" -ne 0 ]; then
    echo "memcheck $name: exit status $rc; full log: $log"
    status=1
  fi
}

run default-api-errors "gpu and not api_errors and not needs_overlap"
run api-errors-not-reported "gpu and api_errors and not needs_overlap" --report-api-errors no
echo "memcheck logs: $logs"
[ "$status" -eq 0 ] && echo "memcheck: PASS (0 errors in both runs)" || echo "memcheck: FAIL"
exit "$status"
