#!/usr/bin/env bash
# Device calls: FP8 (E4M3) weights kept in FP8 (kvcap.models.fp8_linear, kvcap.kernels.fp8_gemm).
#   bash scripts/gpu_fp8_weights.sh tests   the FP8-weight tests compiled on the GPU (kernels at
#                                           8B shapes, kept vs dequantized models, graphs)
#   bash scripts/gpu_fp8_weights.sh gemm    the tests, then kvcap.bench.fp8_gemm's default launches
#                                           on the 8B linears at 1-2048 rows (~4 min)
#   bash scripts/gpu_fp8_weights.sh sweep   swapped-operand launches of the 8B linears at 64-256
#                                           rows, K split 1 / 2, hardware decoder, per-row
#                                           scales (what launch_config's _swapped_tile follows)
#   bash scripts/gpu_fp8_weights.sh sweep-block  the same with 128 x 128 block scales, each swapped
#                                           launch with scaled partials and scaled tiles (132
#                                           swapped launches against the per-row sweep's 54)
#   bash scripts/gpu_fp8_weights.sh swiglu  the FP8-weight tests, the gate/up default launches at
#                                           64-256 rows (fused and not), then 8B decode at
#                                           128 x 1K with the fused SwiGLU rule against
#                                           KVCAP_FP8_SWIGLU=unfused, alternating, two rounds
#   bash scripts/gpu_fp8_weights.sh e2e     8B decode end to end, BF16 weights against FP8
#                                           weights (per-row and 128 x 128 scales), E4M3 KV,
#                                           1 / 16 / 64 / 128 / 256 x 1K, 1 / 16 x 16K (~5 min)
# Results under $OUT (default /tmp/out).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
tests() {
  timeout 300 python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider \
    tests/test_fp8_linear.py tests/test_fp8_weights.py 2>&1 | tail -6 | tee "$OUT/tests-fp8.txt"
  grep -q " passed" "$OUT/tests-fp8.txt" && ! grep -qE "failed|error" "$OUT/tests-fp8.txt"
}
case "${1:-}" in
tests) tests ;;
gemm)
  tests || { echo "tests did not pass: no timings"; exit 1; }
  # what is left of a 600 s device call after the tests
  timeout $((570 - SECONDS)) python3 -m kvcap.bench.fp8_gemm --rows 1 16 64 128 256 2048 \
    --out "$OUT/fp8-gemm.json" 2>&1 | grep -vE "^[a-z_]+ m=" | tail -60 ;;
sweep)
  timeout 560 python3 -m kvcap.bench.fp8_gemm --rows 64 128 256 --modes native --sweep swap \
    --splits 1 2 --layouts row --out "$OUT/fp8-gemm-sweep.json" 2>&1 \
    | grep -vE "^[a-z_]+ m=" | tail -24 ;;
sweep-block)
  timeout 560 python3 -m kvcap.bench.fp8_gemm --rows 64 128 256 --modes native --sweep swap \
    --splits 1 2 --layouts block128 --out "$OUT/fp8-gemm-sweep-block.json" 2>&1 \
    | grep -vE "^[a-z_]+ m=" | tail -24 ;;
e2e)
  timeout 580 python3 -m kvcap.bench.throughput --shapes llama-3.1-8b llama-3.1-8b-fp8 \
    llama-3.1-8b-fp8-block --concurrency 1 16 64 128 256 --context 1024 16384 --kv fp8 \
    --dtype bfloat16 --out-tokens 128 --repeats 1 --out "$OUT/throughput-fp8-weights.json" \
    2>&1 | grep -vE "^\{" | tail -30 ;;
swiglu)
  tests || { echo "tests did not pass: no timings"; exit 1; }
  timeout 150 python3 -m kvcap.bench.fp8_gemm --rows 64 128 256 --modes native --splits 1 \
    --linears gate_up_proj --out "$OUT/fp8-gemm-swiglu.json" 2>&1 | grep -vE "^[a-z_]+ m=" \
    | tail -14
  for arm in unfused-1 rule-1 unfused-2 rule-2; do
    env $([ "${arm%-*}" = unfused ] && echo KVCAP_FP8_SWIGLU=unfused) timeout 160 \
      python3 -m kvcap.bench.throughput --shapes llama-3.1-8b-fp8 llama-3.1-8b-fp8-block \
      --concurrency 128 --context 1024 --kv fp8 --dtype bfloat16 --out-tokens 128 --repeats 1 \
      --out "$OUT/throughput-swiglu-$arm.json" 2>&1 | grep -E "^llama-3.1-8b-fp8\S* +fp8 "
    echo "$arm: exit ${PIPESTATUS[0]}"
    rm -f "$OUT"/throughput-swiglu-*.png  # a device call returns at most 8 files: keep the JSONs
  done ;;
*) echo "usage: $0 tests|gemm|sweep|sweep-block|swiglu|e2e"; exit 2 ;;
esac
