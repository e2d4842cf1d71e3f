#!/usr/bin/env bash
# One device call (nvidia-h200, ~6 minutes): check the E4M3 decoders compiled on the GPU, then
# time the decode kernels on issue 5's target cells and one end-to-end cell, both decoders.
#   bash scripts/gpu_decoder_check.sh        (results under $OUT, default /tmp/out)
# Correctness first: the timings only run when every decoder test passes.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -m "gpu or not gpu" tests/test_decoder_check.py \
  tests/test_kernels_gpu.py -k "decoder_check or conversion_exact or word_pairs or \
(word_route_long_context and 32-8-128)" 2>&1 | tail -4 | tee "$OUT/tests.txt"
grep -q " passed" "$OUT/tests.txt" && ! grep -qE "failed|error" "$OUT/tests.txt" || {
  echo "decoder tests did not pass: no timings"; exit 1; }
timeout 150 python3 -m kvcap.bench.kernels --skip-checks --dtype bfloat16 --shapes llama31-8b \
  --batches 8,16,64 --contexts 4096,16384,32768 --out "$OUT/kernels-8b-bf16.json" 2>&1 | tail -14
timeout 150 python3 -m kvcap.bench.throughput --dtype bfloat16 --concurrency 16 --context 16384 \
  --kv fp16 fp8 fp8-software --out-tokens 64 --repeats 1 --out "$OUT/e2e" 2>&1 | grep -E "^\|"
