#!/usr/bin/env bash
# One device call (nvidia-h200, ~5 minutes): the L2 weight prefetch before decode GEMMs.
#   bash scripts/gpu_l2_prefetch.sh [SETS...]     (results under $OUT, default /tmp/out)
# Tests first; then the probe (every 8B linear with / without its prefetch; attention + o_proj
# with a side-stream or an inline prefetch), then the 8B decode step profiled for each
# KVCAP_L2_PREFETCH set (default: 0 o o,qkv o,qkv,down o,qkv,down,gate_up).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -m "gpu or not gpu" tests/test_fused_ops.py 2>&1 | tail -3 \
  | tee "$OUT/tests.txt"
grep -q " passed" "$OUT/tests.txt" && ! grep -qE "failed|error" "$OUT/tests.txt" || {
  echo "tests did not pass: no timings"; exit 1; }
timeout 240 python3 scripts/l2_prefetch_probe.py --cells 1:1024,16:1024,8:16384 \
  --out "$OUT/l2-prefetch-probe.json" 2>&1 | grep -vE '^\{'
sets=("$@"); [ ${#sets[@]} -gt 0 ] || sets=(0 o o,qkv o,qkv,down o,qkv,down,gate_up)
for set in "${sets[@]}"; do
  echo "== KVCAP_L2_PREFETCH=$set"
  KVCAP_L2_PREFETCH=$set timeout 120 python3 -m kvcap.bench.step_profile --dtype bfloat16 \
    --cells fp16:1:1024 fp8:1:1024 fp16:16:1024 fp8:16:1024 --steps 100 --rows 1 \
    --out "$OUT/step-profile-prefetch-${set//,/-}.json" 2>&1 | grep -E "wall"
done
