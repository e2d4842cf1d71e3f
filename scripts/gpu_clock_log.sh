# Sourced by the GPU scripts: nvidia-smi's SM/memory clocks, temperature, power and throttle
# reasons every 100 ms into a CSV while the script runs (the H200's power cap moves E4M3
# decode timings by up to ~11%: docs/kernels.md, "Eighteenth change").
#   . scripts/gpu_clock_log.sh; start_clock_log FILE; ...; stop_clock_log
CLOCK_QUERY="clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active"
start_clock_log() {
  nvidia-smi --query-gpu="timestamp,$CLOCK_QUERY" --format=csv,noheader -lms 100 > "$1" &
  CLOCK_LOGGER=$!
}
stop_clock_log() { kill "$CLOCK_LOGGER" 2>/dev/null; }
