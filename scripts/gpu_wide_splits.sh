#!/usr/bin/env bash
# Device calls (nvidia-h200): the split caps for wide decode calls (decode.py: the 16-bit
# kernel's `resident` cap, the E4M3 word route's three-stage launch up to
# WIDE_WORD_ROUTE_TOKENS) against the launch of an older tree.
#   OLD=DIR bash scripts/gpu_wide_splits.sh kernels     the kernel benchmark's cells at 32 and
#                                                      64 sequences, this tree (~2 min)
#   bash scripts/gpu_wide_splits.sh sweep              what the rule has not measured: 8B at 24 /
#                                                      40 / 48 / 128 sequences, GQA-6 / D = 256 at 32
#                                                      and 64 (explicit split counts; ~4 min)
#   bash scripts/gpu_wide_splits.sh d256               the 16-bit kernel's split cap at D = 256
#                                                      (sixteen_bit_resident): its compile test
#                                                      under this Triton, then GQA-6 at 4 / 8 / 16
#                                                      sequences, where the cap lowers the split
#                                                      count (~2 min)
#   bash scripts/gpu_wide_splits.sh d64                the D = 64 16-bit kernel (the embedded model's
#                                                      shape, 9 / 3 heads): its shared memory and
#                                                      registers under this Triton, then 80 / 132 /
#                                                      150 sequences, where the one-wave cap of 5
#                                                      resident programs splits less (~2 min)
#   OLD=DIR bash scripts/gpu_wide_splits.sh kernels-ab  the kernel benchmark, old / new / new / old
#                                                      trees, SHAPE (gqa6-d256), BATCHES (16,64),
#                                                      CONTEXTS (32768) (~1 min)
#   OLD=DIR bash scripts/gpu_wide_splits.sh e2e ROUND   end to end, 8B shape, BF16 weights, arms
#                                                      old (PYTHONPATH=$OLD) / new, alternating
#                                                      order by ROUND; CONC, CTX, KV, MAXLEN
#                                                      (--max-model-len), TAG override
# OLD: a directory holding an older `kvcap` package (e.g. `git archive REV kvcap | tar -x -C DIR`).
# Results under $OUT (default /tmp/out).
set -uo pipefail
export PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "${1:-}" in
kernels)
  PYTHONPATH=$PWD timeout 300 python3 -m kvcap.bench.kernels --skip-checks --dtype bfloat16 \
    --shapes llama31-8b --batches 32,64 --contexts 1024,2048,4096,16384 \
    --out "$OUT/kernels-wide.json" 2>&1 | grep -E "^\|" ;;
sweep)
  PYTHONPATH=$PWD timeout 280 python3 scripts/short_context_sweep.py --dtype bfloat16 \
    --batches 24,40,48,128 --contexts 2048,16384 --splits 1,2,3,4,6 --tiles 128 --stages 3,5 \
    --out "$OUT/splits-8b-between.json" 2>&1 | grep -E "^B=|MISMATCH"
  PYTHONPATH=$PWD timeout 280 python3 scripts/short_context_sweep.py --dtype bfloat16 \
    --shape 24,4,256 --batches 32,64 --contexts 2048,16384 --splits 1,2,3,4,6,8 --tiles 64 \
    --out "$OUT/splits-gqa6-wide.json" 2>&1 | grep -E "^B=|MISMATCH" ;;
d256)
  PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider \
    tests/test_kernels_compile.py -k "residency" 2>&1 | tail -3
  PYTHONPATH=$PWD timeout 280 python3 scripts/short_context_sweep.py --dtype bfloat16 \
    --shape 24,4,256 --batches 4,8,16 --contexts 4096,16384,32768 \
    --splits 3,6,8,12,17,24,33,64 --tiles 64 --out "$OUT/splits-gqa6-narrow.json" 2>&1 \
    | grep -E "^B=|MISMATCH" ;;
d64)
  for sm in 80 86 90; do
    echo "sm_$sm: $(PYTHONPATH=$PWD python3 scripts/inspect_decode_ptx.py --cache fp16 --sm $sm \
      --head-dim 64 --defaults --dtype bf16 2>&1 | grep -E "shared memory|registers|spill" \
      | tr -s ' ' | tr '\n' ';')"
  done
  PYTHONPATH=$PWD timeout 280 python3 scripts/short_context_sweep.py --dtype bfloat16 \
    --shape 9,3,64 --batches 80,132,150 --contexts 2048,16384 --splits 1,2,3 --tiles 64 \
    --out "$OUT/splits-d64-wide.json" 2>&1 | grep -E "^B=|MISMATCH" ;;
kernels-ab)
  i=0
  for arm in old new new old; do
    # python -m puts the working directory first on sys.path: run each arm from its own tree
    i=$((i + 1)); path=$PWD; [ $arm = old ] && path=${OLD:?set OLD to the older tree}
    (cd "$path" && PYTHONPATH=$path timeout 120 python3 -m kvcap.bench.kernels --skip-checks \
      --dtype bfloat16 --shapes ${SHAPE:-gqa6-d256} --batches ${BATCHES:-16,64} \
      --contexts ${CONTEXTS:-32768} --out "$OUT/ab-$i-$arm.json" > /dev/null 2>&1)
  done
  python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/ab-*.json")):
    cells = json.load(open(f))["cells"]
    print(f.rsplit("/", 1)[1], [(c["batch"], c["context"], *(round(c[a]["ms"] * 1e3, 1) for a in
          ("sdpa_fp16", "paged_fp16", "e4m3_native", "e4m3_software"))) for c in cells])
PY
  ;;
e2e)
  round=${2:-1}; arms="old new"; [ $((round % 2)) = 0 ] && arms="new old"
  for arm in $arms; do
    # python -m puts the working directory first on sys.path: run each arm from its own tree
    path=$PWD; [ $arm = old ] && path=${OLD:?set OLD to the older tree}
    (cd "$path" && PYTHONPATH=$path timeout 280 python3 -m kvcap.bench.throughput --dtype bfloat16 \
      --concurrency ${CONC:-64} --context ${CTX:-1024} --kv ${KV:-fp16 fp8} --out-tokens 128 \
      --repeats 2 ${MAXLEN:+--max-model-len $MAXLEN} --out "/tmp/e2e-${TAG:-}$arm-$round" 2>&1) \
      | grep -E "^\|" \
      | grep -v -- "---\|concurrency" | sed "s/^/$arm$round /"
    cp /tmp/e2e-${TAG:-}$arm-$round/*.json "$OUT/e2e-${TAG:-}$arm-$round.json"
  done ;;
*) echo "usage: $0 kernels|sweep|d256|d64|kernels-ab|e2e ROUND"; exit 2 ;;
esac
