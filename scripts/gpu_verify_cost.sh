#!/usr/bin/env bash
# Device call (one GPU, no model wheel needed: dummy weights): what verifying speculative drafts
# costs a decode step on the Llama-3.1-8B shape, graphed decode rows vs the eager chunk vs a
# plain step, B {1, 16} x context {1K, 4K, 16K} and the edge around the bound (B {16, 4} x
# {8K, 16K}), K = 4, BF16 then E4M3 KV; sets
# SPEC_ROWS_MAX_EXTRA_KV_VALUES (kvcap/engine/model_runner.py) from where rows stop beating the
# chunk. JSON under $OUT.            bash scripts/gpu_verify_cost.sh   (~3.5 min on an H200)
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for kv in fp16 fp8; do
  timeout ${KV_S:-270} python3 -m kvcap.bench.verify_cost --shape llama-3.1-8b --kv $kv \
    --batches 1 16 --contexts 1024 4096 16384 --k 4 --out "$OUT/verify-cost-8b-$kv.json" \
    2>&1 | grep -v "^INFO\|capturing" | tail -12
  echo "$kv: exit ${PIPESTATUS[0]}"
  timeout ${EDGE_S:-120} python3 -m kvcap.bench.verify_cost --shape llama-3.1-8b --kv $kv \
    --batches 16 4 --contexts 8192 16384 --k 4 --out "$OUT/verify-cost-8b-$kv-edge.json" \
    2>&1 | grep -v "^INFO\|capturing" | tail -5
  echo "$kv edge: exit ${PIPESTATUS[0]}"
done
