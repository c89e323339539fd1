#!/usr/bin/env bash
# compute-sanitizer memcheck over the Triton backend's GPU tests (issue #7): every out-of-bounds or misaligned
# access of the Triton kernels on the GPU test shapes is reported. Run on the GPU host from the repository root:
#
#     bash benchmarks/sanitize.sh            # log: ${OUT:-benchmarks/results}/sanitize-<date>.log
#
# PYTORCH_NO_CUDA_MEMORY_CACHING=1 makes every tensor its own cudaMalloc, so an access past a tensor's end lands
# outside any allocation and memcheck sees it (with the caching allocator it would hit a neighbour's memory).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v compute-sanitizer >/dev/null || { echo "compute-sanitizer not found (CUDA toolkit bin/ not on PATH)" >&2; exit 2; }
outdir=${OUT:-benchmarks/results}
mkdir -p "$outdir"
log="$outdir/sanitize-$(date +%Y-%m-%d).log"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
set +e
# SANITIZE_TESTS / SANITIZE_K narrow the run (memcheck slows kernels by 10-100x).
compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 50 \
    python3 -m pytest -m gpu ${SANITIZE_TESTS:-tests/triton_backend} ${SANITIZE_K:+-k "$SANITIZE_K"} -q -x -p no:cacheprovider 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
echo "---- summary ----"
grep -E "ERROR SUMMARY|passed|failed|error" "$log" | tail -n 5
exit "$rc"
