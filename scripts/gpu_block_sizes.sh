#!/usr/bin/env bash
# One device call (nvidia-h200, ~4 minutes after start): the paged decode kernels on the 8B
# target cells with KV blocks of 16 (the engine's default), 64 and 128 tokens, BF16 queries,
# 3 alternating rounds per arm, run order 16, 128, 64, 16 (the machine's drift), clocks and
# power logged every 100 ms.
#   bash scripts/gpu_block_sizes.sh
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. "$(dirname "$0")/gpu_clock_log.sh"
start_clock_log "$OUT/clocks-log.csv"
i=0
for bs in 16 128 64 16; do
  i=$((i + 1))
  timeout 130 python3 -m kvcap.bench.kernels --skip-checks --dtype bfloat16 --shapes llama31-8b \
    --batches 8,16,64 --contexts 16384,32768 --rounds 3 --block-size $bs \
    --out "$OUT/blocks-$i-$bs.json" 2>&1 | grep -A8 "sdpa_us" | sed "s/^/bs=$bs /"
done
stop_clock_log
