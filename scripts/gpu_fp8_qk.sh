#!/usr/bin/env bash
# One device call (nvidia-h200, ~2 minutes after start): the fp8_qk experiment -- native E4M3
# decode with QK^T on E4M3 warpgroup MMAs over the raw K bytes (BF16 queries split into E4M3
# high and low parts) against the default word route. GPU tests first, then the 8B target
# cells in alternating rounds with the SM clock per round, clocks/power logged every 100 ms.
#   bash scripts/gpu_fp8_qk.sh
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py -k "fp8_qk or fp16_dots" \
  2>&1 | tail -3
q="timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active"
nvidia-smi --query-gpu=$q --format=csv,noheader -lms 100 > "$OUT/clocks-log.csv" &
logger=$!
timeout 400 python3 -m kvcap.bench.kernels --skip-checks --dtype bfloat16 --compare-fp8-qk \
  --rounds "${ROUNDS:-4}" --out "$OUT/fp8-qk.json" 2>&1 | grep -v Warning
kill $logger 2>/dev/null
