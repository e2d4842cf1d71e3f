#!/usr/bin/env bash
# Device call (one GPU): speculative decoding by prompt lookup on the embedded model, both verify
# routes (KVCAP_SPEC_VERIFY=chunk, the default, and rows), K in {0, 2, 4, 8} x concurrency
# {1, 4, 16}; each run checks every K's tokens against K = 0 first. JSON under $OUT.
#   bash scripts/gpu_speculative.sh            (~3-5 min on an H100/H200)
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for route in chunk rows; do
  KVCAP_SPEC_VERIFY=$route timeout ${ROUTE_S:-240} python3 -m kvcap.bench.speculative \
    --device cuda --k 0,2,4,8 --concurrency 1,4,16 --repeats 3 \
    --out "$OUT/speculative-$route.json" 2>&1 | grep -v "^INFO" | tail -40
  echo "$route: exit ${PIPESTATUS[0]}"
done
