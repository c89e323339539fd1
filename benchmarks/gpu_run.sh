#!/usr/bin/env bash
# On a GPU host, from the repository root: install the staged wheels (when .gpu/base/setup.sh is there), then run
# GPU test groups and/or benchmark suites through benchmarks/run.py, with logs and results under $OUT.
#
#   bash benchmarks/gpu_run.sh tests [GROUP ...]      # pytest -m gpu over test groups (none named: every group)
#   bash benchmarks/gpu_run.sh sanitize [GROUP ...]   # the same under compute-sanitizer memcheck
#   bash benchmarks/gpu_run.sh bench [SUITE ...]      # benchmark suites (none named: the default suites)
#   bash benchmarks/gpu_run.sh all                    # every test group, then the default suites
#
# Groups and suites: python -m benchmarks.run --list. TEST_TIMEOUT (seconds per group), PER_TEST_TIMEOUT (seconds
# per test: a hung test fails with its traceback), PARALLEL=1 (the groups side by side, sharing the cores) and
# WORKERS=N (pytest-xdist processes per group) shape the test runs; copy the files under $OUT into
# benchmarks/results/ and run python -m benchmarks.run --index to update benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/attnbackends-out}
mkdir -p "$OUT"
if [ -f .gpu/base/setup.sh ]; then
  bash .gpu/base/setup.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 3; }
fi
# The transformers the integration's hooks are tested on, where the host has an older one. Stage it on the
# development machine with: pip download --no-deps -d .gpu/tf transformers==5.24.0 (and ship .gpu/tf).
if ls .gpu/tf/transformers-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --disable-pip-version-check .gpu/tf/transformers-*.whl \
    >> "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 3; }
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
run() { python3 -m benchmarks.run --outdir "$OUT" "$@"; }
test_opts=(${TEST_TIMEOUT:+--timeout "$TEST_TIMEOUT"} ${PER_TEST_TIMEOUT:+--test-timeout "$PER_TEST_TIMEOUT"}
           ${PARALLEL:+--parallel} ${WORKERS:+--workers "$WORKERS"})
what=${1:-all}
shift || true
case "$what" in
  tests) run --gpu-tests "$@" "${test_opts[@]}" ;;
  sanitize) run --gpu-tests "$@" --sanitize "${test_opts[@]}" ;;
  bench) suites=(); for s in "$@"; do suites+=(--suite "$s"); done; run "${suites[@]}" ;;
  all) run --gpu-tests "${test_opts[@]}"; tests=$?; run; exit $(( tests | $? )) ;;
  *) echo "usage: bash benchmarks/gpu_run.sh tests|sanitize|bench|all [NAMES ...]" >&2; exit 2 ;;
esac
