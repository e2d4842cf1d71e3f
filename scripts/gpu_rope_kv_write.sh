#!/usr/bin/env bash
# One device call (nvidia-h200, ~8 minutes): the K/V cache write fused into the RoPE kernel.
#   bash scripts/gpu_rope_kv_write.sh        (results under $OUT, default /tmp/out)
# Correctness first (fused ops, store and decoder tests compiled on the GPU); then the 8B decode
# step profiled with the write in the RoPE kernel and with KVCAP_DISABLE_ROPE_KV_WRITE=1 (the
# backend's own store_kv launch), then the 1K end-to-end matrix with the default.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 300 python3 -m pytest -q -m "gpu or not gpu" tests/test_fused_ops.py \
  tests/test_kernels_store.py tests/test_decoder_check.py 2>&1 | tail -4 | tee "$OUT/tests.txt"
grep -q " passed" "$OUT/tests.txt" && ! grep -qE "failed|error" "$OUT/tests.txt" || {
  echo "tests did not pass: no timings"; exit 1; }
cells="fp16:1:1024 fp8:1:1024 fp16:16:1024 fp8:16:1024"
timeout 120 python3 -m kvcap.bench.step_profile --dtype bfloat16 --cells $cells --steps 100 \
  --rows 12 --out "$OUT/step-profile-rope-write.json" 2>&1 | tail -12
KVCAP_DISABLE_ROPE_KV_WRITE=1 timeout 120 python3 -m kvcap.bench.step_profile --dtype bfloat16 \
  --cells $cells --steps 100 --rows 12 --out "$OUT/step-profile-store-kv.json" 2>&1 | tail -12
timeout 330 python3 -m kvcap.bench.throughput --dtype bfloat16 --concurrency 1 4 8 16 64 \
  --context 1024 --kv fp16 fp8 fp8-software --out-tokens 128 --repeats 2 --passes 2 \
  --out "$OUT/e2e" 2>&1 | grep -E "^\|"
