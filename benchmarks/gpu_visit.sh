#!/usr/bin/env bash
# One visit to the GPU host (../shared/gpu/README.md): install the staged wheels, then run
#   tests  the gpu test suite in three parallel groups, each under its own time limit (one verbose log per group,
#          so a group that runs out of time still leaves its PASSED/FAILED lines)
#   bench  every benchmark suite (python -m benchmarks.run)
#   focus-tests  the GPU tests written since the last full run (the Triton prefill kernel, speculative MLA /
#          draft steps / CUDA-graph verify, encoders, page containment), then the speculative engine benchmark
#   focus-bench  the prefill kernel's tile sweep, the Triton API suite (prefill with the kernel on), the Gluon
#          prefill candidate, the MLA decode exploration
#          (each focus mode fits one 10-minute device call)
#   fix-check  steps built ahead of the GPU on every backend, the Triton tests, phase selection, the prefill sweep
#   remaining  the GPU tests no visit has reached yet
#   first-run  warmup, tune, explain and demo timed as a new user runs them on a fresh host
#   final  first-run with shorter limits, then the GPU tests changed since, or not run since, the last move
#   prefill-sweep  the prefill kernel's tiles (GQA-packed ones too) on the prefill shapes and the mixed step
#   mla-gluon  the Gluon MLA decode candidate (F) with time to compile, next to the best plain-Triton one (A)
#   next-bench  the Triton API suite with the current defaults, then speculative decoding end to end
#   s4-bench  the Triton API suite, the prefill tiles, the MLA decode kernel against candidate A and FlashInfer
#          MLA, speculative decoding on Triton (one 10-minute call on a host whose FlashInfer kernels are built)
#   sanitize-new  compute-sanitizer memcheck over the prefill kernel's and the MLA backends' GPU tests
#   check  remaining, the tree-verification GPU tests and sanitize-new (Triton kernels only), side by side
#   hopper-check  the Gluon Hopper MLA kernel's GPU tests, the step-kind / spec-engine / hybrid fixes, and memcheck
#          over the MLA GPU tests (no CUDA-graph capture under memcheck: it runs without the caching allocator)
#   mla-launch  the Hopper MLA kernel's tests (multi-token too) and memcheck, then the split-KV sweep
#   prefill-ws  speculative MLA GPU tests, then the warp-specialised Gluon prefill candidate's sweep
#   fp8-check  fp8 pages on the Gluon MLA kernel: smoke, tests, memcheck, then the fp8 and multi-token rows
#   prefill-hopper  the Gluon prefill in the Triton backend: tests, prefill regression, the Triton API suite
#   prefill-write  the Gluon prefill's tests (with the cache checked bitwise) and the prefill regression, then
#          memcheck over its tests (no CUDA graph under memcheck)
#   triton-api  the Triton API suite alone
#   write-beside  the cache write's tests (alone and beside the Gluon prefill), its sweeps (tokens per program, SMs
#          left to it), then the Triton API suite
#   write-sweep  the cache write's tests, then its sweep alone
#   kernel-write  the Gluon prefill writing the cache itself: a smoke test, its tests and the write kernel's,
#          then the Triton API suite
#   final-write  the Gluon prefill's and the write kernel's tests, the Triton API suite, then memcheck over the Gluon
#          prefill's and the write kernel's tests
#   final-check  the Gluon prefill's, the write kernel's, the page guard's and the Triton kernels' GPU tests, then
#          the Triton API suite
#   final-api  the Triton API suite, then memcheck over the Gluon prefill's and the write kernel's tests
#   hopper-bench  the MLA decode rows (today's default kernel, candidates A and W, FlashInfer MLA), then the MLA suite
#   all    tests then bench
# Logs and results land in $OUT.   bash benchmarks/gpu_visit.sh [all|tests|bench|focus-tests|focus-bench]
set -uo pipefail
OUT=${OUT:-/tmp/attnbackends-out}
mkdir -p "$OUT"
bash .gpu/base/setup.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 3; }
tail -4 "$OUT/setup.log"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
what=${1:-all}
limit=${GROUP_TIMEOUT:-480}

summary() {  # log file
  echo "$1: passed=$(grep -c ' PASSED' "$1") failed=$(grep -c ' FAILED\| ERROR' "$1") skipped=$(grep -c ' SKIPPED' "$1")"
  grep -E "^(FAILED|ERROR) " "$1" | grep -v "#loc" | cut -c1-240 | head -20
}
group() {  # name, pytest args...
  local name=$1; shift
  timeout "$limit" python3 -m pytest -m gpu -v -p no:cacheprovider -rfE "$@" > "$OUT/gpu-$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "gpu-$name: TIMED OUT after ${limit}s (the tests after the last PASSED line did not run)"
  summary "$OUT/gpu-$name.log"
}
step() {  # name, seconds, command...
  local name=$1 seconds=$2; shift 2
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$?"; tail -5 "$OUT/$name.log" | cut -c1-240
}

if [ "$what" = tests ] || [ "$what" = all ]; then
  group catalogue tests/test_bad_input_catalogue.py &
  group mla_fa tests/mla tests/flash_attn_backend tests/test_phased.py &
  group rest tests --ignore=tests/test_bad_input_catalogue.py --ignore=tests/mla --ignore=tests/flash_attn_backend \
    --ignore=tests/test_phased.py &
  wait
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout "${BENCH_TIMEOUT:-560}" python3 -m benchmarks.run --outdir "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
if [ "$what" = focus-tests ]; then  # ~9 min: one device call
  limit=330
  group triton tests/triton_backend tests/test_phased.py tests/test_page_guard.py tests/test_layer_groups_gpu.py \
    tests/mla/test_mla_page_containment.py tests/flashinfer_backend/test_flashinfer_page_containment.py \
    tests/test_bad_input_catalogue.py -k "not test_bad_input_gpu or slot_past_cache or kv_cache_dtype or negative_page_id" &
  group spec-enc tests/mla/test_mla_speculative_gpu.py tests/test_draft_steps_gpu.py tests/test_cudagraph_verify_gpu.py \
    tests/test_hf_encoders_gpu.py tests/test_engine_hf.py &
  group fa-explore tests/flash_attn_backend tests/test_mla_explore_gpu.py tests/test_prefill_explore_gluon.py &
  wait
  step spec-engine 200 python3 -m benchmarks.spec_engine --out "$OUT/spec-engine" --backends triton
fi
if [ "$what" = fix-check ]; then  # ~9 min: steps built ahead of the GPU, the prefill kernel on by default
  limit=180
  group run-ahead tests/test_run_ahead.py tests/triton_backend tests/test_cudagraph_all_backends.py \
    tests/test_batch_invariance.py
  step phase-selection 150 python3 benchmarks/phase_selection.py --out "$OUT/phase-selection.json"
  step prefill-sweep 180 python3 benchmarks/triton_api.py --prefill-sweep --out "$OUT/prefill-sweep.json"
fi
if [ "$what" = remaining ]; then  # the GPU tests no visit has run yet (the last one's device time ran out)
  limit=540
  group hopper-multi tests/mla/test_mla_gpu.py -k "nan_slots" &
  group step-kinds tests/test_step_kinds_one_builder.py tests/flashinfer_backend/test_flashinfer_speculative_gpu.py &
  wait
fi
if [ "$what" = check ]; then  # one device call: the unrun GPU tests, tree verification on GPU, memcheck
  limit=540
  group spec-e2e tests/test_engine_speculative_mla.py tests/test_bench_spec_engine.py tests/test_hf_hybrid.py &
  group cp-tree tests/test_context_parallel.py tests/flashinfer_backend/test_flashinfer_plan_inputs.py \
    tests/triton_backend/test_speculative_triton.py tests/mla/test_mla_speculative_gpu.py \
    tests/test_cudagraph_verify_gpu.py &
  SANITIZE_TESTS="tests/triton_backend/test_prefill_kernel.py tests/mla/test_mla_gpu.py" \
    SANITIZE_K="not flashinfer and not flash_attn and not sdpa" timeout 540 bash benchmarks/sanitize.sh \
    > "$OUT/sanitize.log" 2>&1 &
  wait
  echo "sanitize:"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize.log" | tail -3
fi
if [ "$what" = hopper-check ]; then
  limit=520
  group mla-hopper tests/mla/test_mla_gpu.py tests/mla/test_mla_speculative_gpu.py tests/test_step_kinds_one_builder.py &
  group e2e-fix tests/test_bench_spec_engine.py tests/test_hf_hybrid.py &
  SANITIZE_TESTS="tests/mla/test_mla_gpu.py tests/triton_backend/test_prefill_kernel.py" \
    SANITIZE_K="not flashinfer and not flash_attn and not sdpa and not overlapped" timeout 520 \
    bash benchmarks/sanitize.sh > "$OUT/sanitize.log" 2>&1 &
  wait
  echo "sanitize:"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize.log" | tail -3
fi
if [ "$what" = hopper-bench ]; then
  step mla-explore 330 python3 -m benchmarks.mla_explore --families ${FAMILIES:-A,W} --out "$OUT/mla-explore" \
    --budget-s 300 --config-timeout-s 120
  step mla-suite 200 python3 benchmarks/mla.py --out "$OUT/mla.json"
fi
if [ "$what" = mla-launch ]; then  # the MLA decode grid / split policy: Hopper kernel tests and memcheck, then the split sweep
  limit=240
  group hopper-multi tests/mla/test_mla_gpu.py -k "nan_slots" -o faulthandler_timeout=200 &
  group mla-hopper tests/mla/test_mla_gpu.py -k "not nan_slots and not flashinfer" &
  SANITIZE_TESTS="tests/mla/test_mla_gpu.py" SANITIZE_K="(hopper or 128_heads or v3_dims) and not flashinfer" \
    timeout 240 bash benchmarks/sanitize.sh > "$OUT/sanitize.log" 2>&1 &
  wait
  echo "sanitize:"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize.log" | tail -3
  step mla-splits 220 python3 -m benchmarks.mla_splits --out "$OUT/mla-splits.json"
fi
if [ "$what" = prefill-ws ]; then  # speculative MLA on the Gluon kernel, then the warp-specialised prefill candidate
  limit=170
  group spec-mla tests/mla/test_mla_speculative_gpu.py tests/test_engine_speculative_mla.py
  step prefill-ws 400 python3 -m benchmarks.prefill_explore_gluon_ws --out "$OUT/prefill-ws.json" --budget-s 390 \
    --probe-budget-s 200 --flashinfer-wait-s 120
fi
if [ "$what" = fp8-check ]; then  # fp8 pages on the Gluon MLA kernel: a smoke run, tests and memcheck, then the rows
  step fp8-smoke 150 python3 -m pytest -m gpu -x -v -p no:cacheprovider -o faulthandler_timeout=120 \
    "tests/mla/test_mla_hopper_fp8.py::test_hopper_fp8_against_oracle[1-1-bf16]"
  if grep -q " PASSED" "$OUT/fp8-smoke.log"; then
    limit=200
    group fp8 tests/mla/test_mla_hopper_fp8.py &
    group mla-16bit tests/mla/test_mla_gpu.py -k "(hopper or v3_dims or 128_heads) and not flashinfer" &
    group spec-mla-rest tests/test_engine_speculative_mla.py \
      tests/mla/test_mla_speculative_gpu.py -k "not test_uniform_1_plus_3_decode" &
    SANITIZE_TESTS="tests/mla/test_mla_hopper_fp8.py" SANITIZE_K="oracle and not 33" timeout 200 \
      bash benchmarks/sanitize.sh > "$OUT/sanitize.log" 2>&1 &
    wait
    echo "sanitize:"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize.log" | tail -3
    step mla-splits-fp8 200 python3 -m benchmarks.mla_splits --fp8 --splits 1 \
      --shapes 64x4096,128x8192,1x32768,4x32768,8x32768,64x4096x2,64x4096x4 --out "$OUT/mla-splits-fp8.json"
  fi
fi
if [ "$what" = prefill-hopper ]; then  # the Gluon prefill in the Triton backend: its tests, the prefill regression, the API suite
  limit=230
  group prefill-hopper tests/triton_backend/test_prefill_hopper.py -o faulthandler_timeout=200 &
  group prefill-kernel tests/triton_backend/test_prefill_kernel.py -k "not flashinfer" &
  wait
  step triton-api 260 python3 benchmarks/triton_api.py --out "$OUT/triton-api.json"
fi
if [ "$what" = prefill-write ]; then  # the Gluon prefill: tests, regression, memcheck
  limit=200
  group prefill-hopper tests/triton_backend/test_prefill_hopper.py -o faulthandler_timeout=150 &
  group prefill-kernel tests/triton_backend/test_prefill_kernel.py -k "not flashinfer" &
  wait
  SANITIZE_TESTS=tests/triton_backend/test_prefill_hopper.py SANITIZE_K="not graph" \
    timeout 330 bash benchmarks/sanitize.sh > "$OUT/sanitize-prefill-hopper.log" 2>&1
  echo "sanitize: rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize-prefill-hopper.log" | tail -3
fi
if [ "$what" = triton-api ]; then
  step triton-api 300 python3 benchmarks/triton_api.py --out "$OUT/triton-api.json"
fi
if [ "$what" = write-beside ]; then
  limit=150
  group write-beside tests/triton_backend/test_prefill_hopper.py tests/triton_backend/test_kv_cache_write.py \
    tests/test_page_guard.py -o faulthandler_timeout=120
  step write-sweep 200 python3 benchmarks/triton_api.py --write-sweep --out "$OUT/write-sweep.json"
  step triton-api 220 python3 benchmarks/triton_api.py --out "$OUT/triton-api.json"
fi
if [ "$what" = write-sweep ]; then
  limit=150
  group write-beside tests/triton_backend/test_prefill_hopper.py tests/triton_backend/test_kv_cache_write.py \
    -o faulthandler_timeout=120
  step write-sweep 300 python3 benchmarks/triton_api.py --write-sweep --out "$OUT/write-sweep.json"
fi
if [ "$what" = kernel-write ]; then
  step kernel-write-smoke 120 python3 -m pytest -m gpu -x -v -p no:cacheprovider -o faulthandler_timeout=100 \
    tests/triton_backend/test_prefill_hopper.py -k "stores_whole_pages or kernel_writes_the_cache"
  limit=160
  group kernel-write tests/triton_backend/test_prefill_hopper.py tests/triton_backend/test_kv_cache_write.py \
    -o faulthandler_timeout=120
  step triton-api 240 python3 benchmarks/triton_api.py --out "$OUT/triton-api.json"
fi
if [ "$what" = final-write ]; then
  limit=150
  group kernel-write tests/triton_backend/test_prefill_hopper.py tests/triton_backend/test_kv_cache_write.py \
    tests/test_page_guard.py -o faulthandler_timeout=120
  step triton-api 230 python3 benchmarks/triton_api.py --out "$OUT/triton-api.json"
  SANITIZE_TESTS="tests/triton_backend/test_prefill_hopper.py tests/triton_backend/test_kv_cache_write.py" \
    SANITIZE_K="not graph" timeout 170 bash benchmarks/sanitize.sh > "$OUT/sanitize-kernel-write.log" 2>&1
  echo "sanitize: rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize-kernel-write.log" | tail -3
fi
if [ "$what" = final-check ]; then
  limit=220
  group final-check tests/triton_backend/test_prefill_hopper.py tests/triton_backend/test_kv_cache_write.py \
    tests/test_page_guard.py tests/triton_backend/test_kernels.py -o faulthandler_timeout=150
  step triton-api 230 python3 benchmarks/triton_api.py --out "$OUT/triton-api.json"
fi
if [ "$what" = final-api ]; then
  step triton-api 300 python3 benchmarks/triton_api.py --out "$OUT/triton-api.json"
  SANITIZE_TESTS="tests/triton_backend/test_prefill_hopper.py tests/triton_backend/test_kv_cache_write.py" \
    SANITIZE_K="not graph" timeout 200 bash benchmarks/sanitize.sh > "$OUT/sanitize-write-beside.log" 2>&1
  echo "sanitize: rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize-write-beside.log" | tail -3
fi
if [ "$what" = next-bench ]; then  # the Triton suite with this session's defaults, then speculation end to end
  step triton-api 170 python3 benchmarks/triton_api.py --out "$OUT/triton-api.json"
  step spec-engine 400 python3 -m benchmarks.spec_engine --out "$OUT/spec-engine"
fi
if [ "$what" = sanitize-new ]; then  # compute-sanitizer memcheck on the kernels written since the last sanitizer log
  SANITIZE_TESTS="tests/triton_backend/test_prefill_kernel.py tests/mla/test_mla_gpu.py" \
    timeout 540 bash benchmarks/sanitize.sh > "$OUT/sanitize.log" 2>&1
  echo "sanitize: rc=$?"; tail -5 "$OUT/sanitize.log" | cut -c1-240
fi
if [ "$what" = s4-bench ]; then
  step triton-api 160 python3 benchmarks/triton_api.py --out "$OUT/triton-api.json"
  step prefill-sweep 200 python3 benchmarks/triton_api.py --prefill-sweep --out "$OUT/prefill-sweep.json"
  step mla-explore 100 python3 -m benchmarks.mla_explore --families A --out "$OUT/mla-explore" --budget-s 90
  step spec-engine 110 python3 -m benchmarks.spec_engine --out "$OUT/spec-engine" --backends triton
fi
if [ "$what" = prefill-sweep ]; then  # prefill kernel tiles incl. GQA-packed ones, on prefills and the mixed step
  step prefill-sweep 400 python3 benchmarks/triton_api.py --prefill-sweep --out "$OUT/prefill-sweep.json"
fi
if [ "$what" = mla-gluon ]; then  # the Gluon MLA decode candidate alone, with time to compile (10 s was too little)
  step mla-gluon 560 python3 -m benchmarks.mla_explore --families F,A --out "$OUT/mla-gluon" --budget-s 520 \
    --config-timeout-s 150
fi
if [ "$what" = final ]; then  # first-run with shorter limits, then the GPU tests changed or not run since the move
  fr_limits=(150 140 20 80)
fi
if [ "$what" = first-run ] || [ "$what" = final ]; then  # a new user's first GPU session, on a fresh host: timed
  read -r fr_warmup fr_tune fr_explain fr_demo <<< "${fr_limits[*]:-200 230 30 120}"
  first_run() {  # name, seconds, arguments of attnbackends...
    local name=$1 seconds=$2; shift 2
    local start; start=$(date +%s%N)
    timeout "$seconds" python3 -m attnbackends.cli "$@" > "$OUT/first-run-$name.log" 2>&1
    echo "attnbackends $*: rc=$? $(( ($(date +%s%N) - start) / 1000000 )) ms"
    tail -4 "$OUT/first-run-$name.log" | cut -c1-200
  }
  first_run warmup "$fr_warmup" -v warmup --head-size 128 --num-kv-heads 8
  first_run tune "$fr_tune" -v tune
  first_run explain "$fr_explain" explain --selection measured
  first_run demo "$fr_demo" demo
fi
if [ "$what" = final ]; then
  limit=130
  group recheck tests/flashinfer_backend/test_flashinfer_page_containment.py tests/mla/test_mla_page_containment.py \
    tests/test_run_ahead.py tests/flashinfer_backend/test_flashinfer_plan_inputs.py tests/test_batch_invariance.py \
    tests/test_compile.py tests/test_context_parallel.py tests/test_direct_launch.py
fi
if [ "$what" = focus-bench ]; then  # ~9 min: one device call
  step prefill-sweep 110 python3 benchmarks/triton_api.py --prefill-sweep --out "$OUT/prefill-sweep.json"
  step triton-api 150 python3 benchmarks/triton_api.py --out "$OUT/triton-api.json"
  step phase-selection 130 python3 benchmarks/phase_selection.py --out "$OUT/phase-selection.json"
  step mla-explore 130 python3 -m benchmarks.mla_explore --out "$OUT/mla-explore" --budget-s 115
  step prefill-gluon 50 python3 -m benchmarks.prefill_explore_gluon
fi
