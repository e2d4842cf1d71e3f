#!/usr/bin/env bash
# Three device calls (nvidia-h200, 1-6 minutes each):
#   bash scripts/gpu_rope_loads_splits.sh rope     correctness, then the 8B decode step profiled
#                                                  with the RoPE kernel's loads issued first
#                                                  and with the kernel before (OLD, a copy of
#                                                  the package before the change), twice
#                                                  in alternating order
#   bash scripts/gpu_rope_loads_splits.sh splits   E4M3 decode at every split count 1-16 on
#                                                  the 8B cells B 8/16/32/64 x 16K/32K
#   bash scripts/gpu_rope_loads_splits.sh wave     the split rule past one partial wave: B 25/32/40
#                                                  x 16K split counts, then 32 x 16K end to end
#                                                  with the rule and without it (OLD)
# OLD defaults to .ab/old, the package before the change (mkdir -p .ab/old && git archive fe724bd
# kvcap | tar -x -C .ab/old). Results under $OUT (default /tmp/out). Both changes measured no
# gain and were reverted (docs/kernels.md, "Seventeenth change"): at HEAD, "rope" and "wave"
# compare the same code with itself, and "splits" / the first part of "wave" time split counts.
set -uo pipefail
export PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NEW=$PWD; OLD=${OLD:-$PWD/.ab/old}
case "${1:-}" in
rope)
  PYTHONPATH=$NEW timeout 300 python3 -m pytest -q -m "gpu or not gpu" tests/test_fused_ops.py \
    tests/test_kernels_store.py 2>&1 | tail -4 | tee "$OUT/tests.txt"
  grep -q " passed" "$OUT/tests.txt" && ! grep -qE "failed|error" "$OUT/tests.txt" || {
    echo "tests did not pass: no timings"; exit 1; }
  cells="fp16:1:1024 fp8:1:1024 fp16:16:1024 fp8:16:1024"
  for run in 1 2; do
    for arm in old new; do
      [ $arm = old ] && pp=$OLD || pp=$NEW
      PYTHONPATH=$pp timeout 150 python3 -m kvcap.bench.step_profile --dtype bfloat16 \
        --cells $cells --steps 100 --rows 12 --out "$OUT/step-profile-$arm-$run.json" 2>&1 \
        | tail -5 | sed "s/^/$arm$run /"
    done
  done ;;
splits)
  PYTHONPATH=$NEW timeout 560 python3 -m kvcap.bench.kernels --skip-checks --dtype bfloat16 \
    --shapes llama31-8b --batches 8,16,32,64 --contexts 16384,32768 --sweep-occupancy \
    --occupancy-configs 128:4:5:128 --occupancy-splits 1,2,3,4,5,6,7,8,10,12,16 \
    --out "$OUT/splits.json" 2>&1 | grep -E "ceiling|occupancy" ;;
wave)
  # the split rule's other choices (eager batch sizes 25 / 40: 7 / 6 splits), then end to end
  # at 32 x 16K with the rule (NEW) and without it (OLD: one split at 32 sequences)
  PYTHONPATH=$NEW timeout 120 python3 -m kvcap.bench.kernels --skip-checks --dtype bfloat16 \
    --shapes llama31-8b --batches 25,32,40 --contexts 16384 --sweep-occupancy \
    --occupancy-configs 128:4:5:128 --occupancy-splits 1,2,3,4,5,6,7,8 \
    --out "$OUT/splits-eager.json" 2>&1 | grep -E "ceiling|occupancy" | grep -v software
  for arm in new old; do
    [ $arm = old ] && pp=$OLD || pp=$NEW
    PYTHONPATH=$pp timeout 230 python3 -m kvcap.bench.throughput --dtype bfloat16 \
      --concurrency 32 --context 16384 --kv fp8 fp8-software --out-tokens 128 --repeats 2 \
      --out "$OUT/e2e-$arm" 2>&1 | grep -E "^\|" | sed "s/^/$arm /"
  done ;;
*) echo "usage: $0 rope|splits|wave"; exit 2 ;;
esac
