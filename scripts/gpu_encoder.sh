#!/usr/bin/env bash
# Two device calls (nvidia-h200): the cache write's hardware E4M3 encoder (store_kv.encode_e4m3,
# SM89+) against the integer encoder (KVCAP_SOFTWARE_E4M3_ENCODE=1).
#   bash scripts/gpu_encoder.sh profile   correctness (the store, fused-op and check tests
#                                         compiled on the GPU, incl. all 2^32 FP32 values
#                                         through the hardware encoder), then the 8B decode step
#                                         profiled with each encoder, twice, alternating (~6 min)
#   bash scripts/gpu_encoder.sh e2e       the 1K end-to-end matrix, every arm twice (~6 min)
# Results under $OUT (default /tmp/out).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "${1:-}" in
profile)
  timeout 240 python3 -m pytest -q -m "gpu or not gpu" tests/test_kernels_store.py \
    tests/test_fused_ops.py tests/test_decoder_check.py 2>&1 | tail -4 | tee "$OUT/tests.txt"
  grep -q " passed" "$OUT/tests.txt" && ! grep -qE "failed|error" "$OUT/tests.txt" || {
    echo "tests did not pass: no timings"; exit 1; }
  cells="fp16:1:1024 fp8:1:1024 fp16:16:1024 fp8:16:1024"
  for run in 1 2; do
    for arm in integer hardware; do
      [ $arm = integer ] && flag=1 || flag=0
      KVCAP_SOFTWARE_E4M3_ENCODE=$flag timeout 100 python3 -m kvcap.bench.step_profile \
        --dtype bfloat16 --cells $cells --steps 100 --rows 12 \
        --out "$OUT/step-profile-encoder-$arm-$run.json" 2>&1 | grep -E "wall" \
        | sed "s/^/$arm$run /"
    done
  done ;;
e2e)
  timeout 560 python3 -m kvcap.bench.throughput --dtype bfloat16 --concurrency 1 4 16 64 \
    --context 1024 --kv fp16 fp8 fp8-software --out-tokens 128 --repeats 2 --passes 2 \
    --out "$OUT/e2e" 2>&1 | grep -E "^\|" ;;
*) echo "usage: $0 profile|e2e"; exit 2 ;;
esac
