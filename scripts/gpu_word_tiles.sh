#!/usr/bin/env bash
# One device call (an H200: 64 x 128K needs ~113 GiB): the E4M3 word route's 64- against
# 128-token tiles on issue 5's nine 8B cells (docs/kernels.md, "Thirty-ninth change": on the H100
# 64-token tiles took 0.93-0.99x the time at 8-64 x 16K / 32K; the H200 keeps 128 until this runs
# there), then the short-call split counts at 8 / 16 x 2K / 4K (one split took 0.84-0.93x the
# default's time at 16 x 2K / 4K on the H100), then, with what time is left, the nine-cell matrix
# with 64-token tiles forced (KVCAP_WORD_ROUTE_TILE=64) for --summary's verdicts.
#   bash scripts/gpu_word_tiles.sh      T (per batch of the sweep, s), T3, BUDGET (s, whole call)
# Each sweep row is timed beside the default launch of the same cell (default_ms). Results under $OUT.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
t0=$SECONDS
# best time per launch and cell: (batch, context, decoder) default, then each tile's best split
best() { python3 - "$1" <<'PY'
import collections, json, sys
rows = json.load(open(sys.argv[1]))["info"]["sweep_occupancy"]
best = collections.defaultdict(dict)
for r in rows:
    key, launch = (r["batch"], r["context"], r["arm"][5:]), f'{r["block_n"]}:{r["num_stages"]}'
    if launch not in best[key] or r["ms"] < best[key][launch][0]:
        best[key][launch] = (r["ms"], r["num_splits"], r["default_ms"])
for key, launches in best.items():
    d = next(iter(launches.values()))[2]
    print(*key, f"default {1e3 * d:.1f}", " ".join(f"{c} {1e3 * m:.1f} s{s} ({m / d:.3f})"
                                                   for c, (m, s, _) in sorted(launches.items())))
PY
}
for b in 8 16 64; do
  ctxs=16384,32768,131072; [ $b = 64 ] && [ "$mem" -lt 100000 ] && ctxs=16384,32768
  timeout "${T:-100}" python3 -m kvcap.bench.kernels --dtype bfloat16 --sweep-occupancy --grid \
    --occupancy-configs 128:4:5:128,64:4:5:128 --occupancy-splits 1,2,3,6 --shapes llama31-8b \
    --batches $b --contexts $ctxs --skip-checks --out "$OUT/word-tiles-$b.json" 2>&1 \
    | grep -v Warning | grep -i -E "error|fail|Traceback|Killed" | tail -3
  best "$OUT/word-tiles-$b.json"
done
timeout "${T3:-60}" python3 -m kvcap.bench.kernels --dtype bfloat16 --sweep-occupancy --grid \
  --occupancy-configs 128:4:5:128,128:4:3:128 --occupancy-splits 1,2,3,4,6,8 \
  --shapes llama31-8b --batches 8,16 --contexts 2048,4096 --skip-checks \
  --out "$OUT/word-short-splits.json" 2>&1 | grep -v Warning | grep -i -E "error|fail|Traceback" | tail -3
best "$OUT/word-short-splits.json"
left=$(( ${BUDGET:-570} - (SECONDS - t0) ))
if [ $left -gt 90 ]; then
  KVCAP_WORD_ROUTE_TILE=64 timeout $left python3 -m kvcap.bench.kernels --dtype bfloat16 \
    --shapes llama31-8b --batches 8,16,64 --contexts 16384,32768,131072 --rounds 2 --skip-checks \
    --out "$OUT/kernels-8b-tile64.json" 2>&1 | grep -v Warning | grep -v "^  " | tail -12
  python3 -m kvcap.bench.kernels --summary "$OUT/kernels-8b-tile64.json" 2>&1 | tail -14
fi
