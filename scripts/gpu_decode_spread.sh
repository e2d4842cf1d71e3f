#!/usr/bin/env bash
# One device call (nvidia-h200, ~2 minutes after start): why the paged decode kernels' timings
# spread 3-17% across rounds where SDPA's spread 0.3-5% (docs/kernels.md, "Seventeenth change").
# The 8B target cells in 5 alternating rounds per arm with random block tables (the benchmark's
# default), then with every sequence's blocks in order (--contiguous-tables: no page hopping),
# then random again (the machine's drift between the first and the last run); GPU clocks and
# throttle reasons before and after, and (since 2026-12-02's fifth session) each timing's SM
# clock read through NVML mid-timing (sm_mhz_rounds in the JSON).
# Results under $OUT (default /tmp/out).
#   bash scripts/gpu_decode_spread.sh
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. "$(dirname "$0")/gpu_clock_log.sh"
nvidia-smi --query-gpu=$CLOCK_QUERY --format=csv | tee "$OUT/clocks-before.csv"
# Clocks, power and throttle reasons every 100 ms for the whole run (the hypothesis: the SM
# clock drops under sustained load, which would hurt the instruction-heavy E4M3 kernels).
start_clock_log "$OUT/clocks-log.csv"
args="--skip-checks --dtype bfloat16 --shapes llama31-8b --batches 8,16,64 --contexts 16384,32768
      --rounds 5"
for run in random contiguous random-again; do
  extra=""; [ $run = contiguous ] && extra="--contiguous-tables"
  # shellcheck disable=SC2086
  timeout 150 python3 -m kvcap.bench.kernels $args $extra --out "$OUT/spread-$run.json" 2>&1 \
    | grep -A8 "sdpa_us" | sed "s/^/$run /"
done
stop_clock_log
nvidia-smi --query-gpu=$CLOCK_QUERY --format=csv | tee "$OUT/clocks-after.csv"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
print("run           arm             spread per cell (%)")
for run in ("random", "contiguous", "random-again"):
    try:
        cells = json.load(open(f"{out}/spread-{run}.json"))["cells"]
    except (OSError, ValueError):
        continue
    for arm in ("sdpa_fp16", "paged_fp16", "e4m3_native", "e4m3_software"):
        spreads = " ".join(f"{100 * c[arm]['spread']:5.1f}" for c in cells if arm in c)
        mhz = [m for c in cells if arm in c for m in c[arm].get("sm_mhz_rounds") or [] if m]
        clock = f"  SM {min(mhz)}-{max(mhz)} MHz" if mhz else ""
        print(f"{run:13s} {arm:15s} {spreads}{clock}")
rows = [line.split(", ") for line in open(f"{out}/clocks-log.csv") if line.count(",") >= 5]
sm = sorted(int(r[1].split()[0]) for r in rows if r[1].split()[0].isdigit())
power = [float(r[4].split()[0]) for r in rows if r[4].split()[0].replace(".", "").isdigit()]
reasons = sorted({r[5].strip() for r in rows})
if sm:
    print(f"log: {len(rows)} samples, SM clock min {sm[0]} median {sm[len(sm) // 2]} max {sm[-1]}"
          f" MHz, power max {max(power, default=0):.0f} W, throttle reasons {reasons}")
PY
