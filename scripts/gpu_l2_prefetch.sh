#!/usr/bin/env bash
# One device call (nvidia-h200, ~5 minutes): the o_proj L2 prefetch (KVCAP_L2_PREFETCH=1).
#   bash scripts/gpu_l2_prefetch.sh [--e2e]     (results under $OUT, default /tmp/out)
# Tests first; then the kernel-level probe (attention + o_proj with and without the prefetch),
# the 8B decode step profiled with and without it, and with --e2e the 1K end-to-end matrix.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -m "gpu or not gpu" tests/test_fused_ops.py 2>&1 | tail -3 \
  | tee "$OUT/tests.txt"
grep -q " passed" "$OUT/tests.txt" && ! grep -qE "failed|error" "$OUT/tests.txt" || {
  echo "tests did not pass: no timings"; exit 1; }
timeout 240 python3 scripts/l2_prefetch_probe.py --out "$OUT/l2-prefetch-probe.json" 2>&1 \
  | tail -12
cells="fp16:1:1024 fp8:1:1024 fp16:16:1024 fp8:16:1024 fp8:64:1024 fp8:16:4096"
for flag in 1 0; do
  KVCAP_L2_PREFETCH=$flag timeout 150 python3 -m kvcap.bench.step_profile --dtype bfloat16 \
    --cells $cells --steps 100 --rows 1 --out "$OUT/step-profile-prefetch-$flag.json" 2>&1 \
    | grep -E "wall"
done
if [ "${1:-}" = "--e2e" ]; then
  KVCAP_L2_PREFETCH=1 timeout 330 python3 -m kvcap.bench.throughput --dtype bfloat16 \
    --concurrency 1 4 8 16 64 --context 1024 --kv fp16 fp8 fp8-software --out-tokens 128 \
    --repeats 2 --passes 2 --out "$OUT/e2e" 2>&1 | grep -E "^\|"
fi
