#!/usr/bin/env bash
# compute-sanitizer memcheck over vt's GPU tests: tools/sanitize.sh memcheck (see its header).
# Usage: tools/memcheck.sh [pytest targets...]   (default: tests)
# MEMCHECK_SANITIZER_OPTS and MEMCHECK_LOGS, kept for older command lines, set sanitize.sh's
# SANITIZER_OPTS and SANITIZE_LOGS.
[ -n "${MEMCHECK_SANITIZER_OPTS+x}" ] && export SANITIZER_OPTS=$MEMCHECK_SANITIZER_OPTS
[ -n "${MEMCHECK_LOGS:-}" ] && export SANITIZE_LOGS=$MEMCHECK_LOGS
exec bash "$(dirname "$0")/sanitize.sh" memcheck "$@"
