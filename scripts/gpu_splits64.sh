#!/usr/bin/env bash
# One device call: the E4M3 decode's split count at 64 sequences of the 8B shape (issue 5's
# cells 64 x 16K / 32K / 128K miss 1.8x SDPA at 1.75-1.77x, 86.5-86.7% of the read ceiling).
# choose_num_splits takes the fewest splits whose last wave is >= 85% full (WAVE_FILL): 512
# (sequence, KV head) programs, 3 resident per SM on 132 SMs (396 slots), get 2 splits = 2.59
# waves (86% of the third wave used); 3 splits fill 3.88 waves (97%). This times 2 / 3 / 4
# splits of the default Hopper launch (BLOCK_N 64, 4 warps, 5 stages, 128 registers), native
# and software, against the default (kvcap.bench.kernels --sweep-occupancy
# --occupancy-splits; every output compared with the default launch's). 128K only where the
# GPU holds it (~113 GiB: an H200). Results under $OUT (default /tmp/out).
#   bash scripts/gpu_splits64.sh          T=280 (seconds for the sweep)
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
ctxs=16384,32768; [ "$mem" -gt 100000 ] && ctxs=16384,32768,131072
timeout "${T:-280}" python3 -m kvcap.bench.kernels --dtype bfloat16 --sweep-occupancy \
  --occupancy-configs 64:4:5:128 --occupancy-splits 2,3,4 --shapes llama31-8b --batches 64 \
  --contexts "$ctxs" --skip-checks --out "$OUT/splits-64.json" 2>&1 | grep -v Warning | tail -30
