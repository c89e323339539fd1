#!/usr/bin/env bash
# One visit to the GPU host (../shared/gpu/README.md): install the staged wheels, run the gpu tests, then every
# benchmark suite. Logs and results land in $OUT.   bash benchmarks/gpu_visit.sh [all|tests|bench]
set -uo pipefail
OUT=${OUT:-/tmp/attnbackends-out}
mkdir -p "$OUT"
bash .gpu/base/setup.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 3; }
tail -4 "$OUT/setup.log"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
what=${1:-all}
# Fast suites first, so a time limit cuts the slow end-to-end ones.
TESTS=${TESTS:-"tests/triton_backend tests/mla tests/flashinfer_backend tests/test_compile.py tests/test_batch_invariance.py tests/test_cudagraph_all_backends.py tests/test_edge_cases.py tests/test_properties.py tests/test_context_parallel.py tests/test_engine_hf.py"}
if [ "$what" != bench ]; then
  timeout "${TEST_TIMEOUT:-560}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" $TESTS 2>&1 | tee "$OUT/gpu-tests.log" | tail -30
fi
if [ "$what" != tests ]; then
  timeout "${BENCH_TIMEOUT:-560}" python3 -m benchmarks.run --outdir "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
