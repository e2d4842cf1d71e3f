#!/usr/bin/env bash
# Device call (one GPU): speculative decoding by prompt lookup on the embedded model, the default
# verify choice (KVCAP_SPEC_VERIFY=auto: graphed decode rows under the re-read bound) and the
# chunk route (ROUTES="auto rows chunk" adds forced rows), K in {0, 2, 4, 8} x concurrency
# {1, 4, 16} in the engine's dtype (rows record how many requests equal K=0's: a 16-bit verify
# chunk rounds its GEMMs differently from one-token decode), then the exactness check in float32
# (--exact: any changed token fails). JSON under $OUT.
#   bash scripts/gpu_speculative.sh            (~5-7 min on an H100/H200)
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for route in ${ROUTES:-auto chunk}; do
  KVCAP_SPEC_VERIFY=$route timeout ${ROUTE_S:-200} python3 -m kvcap.bench.speculative \
    --device cuda --k 0,2,4,8 --concurrency 1,4,16 --repeats 3 \
    --out "$OUT/speculative-$route.json" 2>&1 | grep -v "^INFO" | tail -40
  echo "$route: exit ${PIPESTATUS[0]}"
done
for route in ${ROUTES:-auto chunk}; do
  KVCAP_SPEC_VERIFY=$route timeout ${EXACT_S:-90} python3 -m kvcap.bench.speculative \
    --device cuda --dtype float32 --exact --k 0,4 --concurrency 1,4,16 \
    --out "$OUT/speculative-$route-fp32.json" 2>&1 | grep -v "^INFO" | tail -3
  echo "$route float32 exact: exit ${PIPESTATUS[0]}"
done
