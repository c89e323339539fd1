#!/usr/bin/env bash
# Runs the GPU test suite on the device host in parallel groups, each under its own time limit, writing one
# verbose log per group under $OUT (so a group that runs out of time still leaves its PASSED/FAILED lines).
#   bash benchmarks/gpu_tests.sh [SECONDS_PER_GROUP]
set -u
limit=${1:-480}
out=${OUT:-/tmp/gpu-tests}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
group() {  # name, pytest args...
  local name=$1; shift
  timeout "$limit" python3 -m pytest -m gpu -v -p no:cacheprovider -rfEs "$@" > "$out/gpu-$name.log" 2>&1
  echo "group $name rc=$? passed=$(grep -c ' PASSED' "$out/gpu-$name.log") failed=$(grep -c ' FAILED\| ERROR' "$out/gpu-$name.log") skipped=$(grep -c ' SKIPPED' "$out/gpu-$name.log")"
}
group catalogue tests/test_bad_input_catalogue.py &
group mla_fa tests/mla tests/flash_attn_backend tests/test_phased.py &
group rest tests --ignore=tests/test_bad_input_catalogue.py --ignore=tests/mla --ignore=tests/flash_attn_backend \
  --ignore=tests/test_phased.py &
wait
grep -h "FAILED\|ERROR" "$out"/gpu-*.log | grep -v "^#loc" | cut -c1-300 | sort -u | head -60
