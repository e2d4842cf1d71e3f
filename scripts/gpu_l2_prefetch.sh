#!/usr/bin/env bash
# One device call (nvidia-h200, ~1 minute): the L2 weight prefetch experiment.
#   bash scripts/gpu_l2_prefetch.sh     (results under $OUT, default /tmp/out)
# Tests first; then the probe: every 8B linear with / without a prefetch of its weight, and
# attention + o_proj with a side-stream or an inline prefetch. (The engine-step A/B over
# KVCAP_L2_PREFETCH sets ran at commit a29a877, where the model still had that switch:
# docs/kernels.md, "Sixteenth change".)
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
