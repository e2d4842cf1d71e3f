#!/usr/bin/env bash
# Device calls (nvidia-h200): programmatic dependent launch of a decode step's kernels
# (kvcap.kernels.common.pdl_launch) against ordinary launches.
#   bash scripts/gpu_pdl.sh tests         the dependent-launch chain test and the step kernels'
#                                         tests compiled on the GPU (~3 min)
#   bash scripts/gpu_pdl.sh e2e ROUND     1 and 16 x 1K decode end to end (8B shape, BF16), arms
#                                         off / auto (the release rule) / end (every kernel
#                                         releases its successor at its end); ARMS, CONC, CTX
#                                         override (~3 min per round; alternate the order)
#   bash scripts/gpu_pdl.sh profile       the step profile of each arm (~4 min)
#   bash scripts/gpu_pdl.sh kernels       the kernel benchmark's issue-5 cells (8B, B 8 / 16 x
#                                         16K / 32K, BF16 queries), arms off / auto / auto / off
#                                         (~2 min)
# Results under $OUT (default /tmp/out).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
arm_env() {  # the environment of one arm (the QKV GEMM on the skinny kernel at <= 16 rows in all)
  case $1 in
  off) echo "KVCAP_DISABLE_PDL=1" ;;
  auto) echo "KVCAP_DISABLE_PDL=0" ;;
  end) echo "KVCAP_DISABLE_PDL=0 KVCAP_PDL_RELEASE=end" ;;
  start) echo "KVCAP_DISABLE_PDL=0 KVCAP_PDL_RELEASE=start" ;;
  esac
}
case "${1:-}" in
tests)
  timeout 300 python3 -m pytest -q -m "gpu or not gpu" tests/test_pdl.py tests/test_decode_gemm.py \
    tests/test_skinny_gemm.py tests/test_fused_ops.py 2>&1 | tail -4 | tee "$OUT/tests.txt" ;;
e2e)
  round=${2:-1}
  arms=${ARMS:-off auto end}; [ $((round % 2)) = 0 ] && arms=$(echo $arms | tr ' ' '\n' | tac)
  for arm in $arms; do
    env $(arm_env $arm) timeout 150 python3 -m kvcap.bench.throughput --dtype bfloat16 \
      --concurrency ${CONC:-1 16} --context ${CTX:-1024} --kv fp16 fp8 --out-tokens 128 \
      --repeats 2 \
      --out "/tmp/e2e-$arm-$round" 2>&1 | grep -E "^\|" | grep -v -- "---\|concurrency" \
      | sed "s/^/$arm$round /"
    cp /tmp/e2e-$arm-$round/*.json "$OUT/e2e-$arm-$round.json"
  done ;;
profile)
  for arm in ${ARMS:-off auto end}; do
    env $(arm_env $arm) timeout 120 python3 -m kvcap.bench.step_profile --dtype bfloat16 \
      --cells fp8:1:1024 fp16:16:1024 fp8:16:1024 --steps 100 --rows 12 \
      --out "$OUT/step-profile-pdl-$arm.json" 2>&1 | grep -E "wall|gemm" | sed "s/^/$arm /"
  done ;;
kernels)
  i=0
  for arm in off auto auto off; do
    i=$((i + 1))
    env $(arm_env $arm) timeout 120 python3 -m kvcap.bench.kernels --skip-checks \
      --dtype bfloat16 --shapes llama31-8b --batches 8,16 --contexts 16384,32768 \
      --out "$OUT/kernels-pdl-$i-$arm.json" 2>&1 | grep -E "^llama" | sed "s/^/$arm$i /"
  done ;;
*) echo "usage: $0 tests|e2e ROUND|profile|kernels"; exit 2 ;;
esac
