#!/usr/bin/env bash
# One device call (nvidia-h200): a paged_decode knob off vs on in alternating rounds with the
# SM clock per round (kvcap.bench.kernels --compare-KNOB --rounds N), and nvidia-smi clocks,
# power and throttle reasons every 100 ms alongside (the H200's power cap moves E4M3 decode
# timings by up to ~11%: docs/kernels.md, "Eighteenth change").
#   bash scripts/gpu_compare_knob.sh fold|prewait|words|pairs|bf16 [ROUNDS]
set -uo pipefail
knob=${1:?usage: gpu_compare_knob.sh fold|prewait|words|pairs|bf16 [ROUNDS]}
rounds=${2:-4}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. "$(dirname "$0")/gpu_clock_log.sh"
start_clock_log "$OUT/clocks-log-$knob.csv"
timeout 500 python3 -m kvcap.bench.kernels --skip-checks --dtype "${DTYPE:-bfloat16}" \
  "--compare-$knob" --rounds "$rounds" --out "$OUT/compare-$knob.json" 2>&1 | grep -v Warning
stop_clock_log
