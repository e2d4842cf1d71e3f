#!/usr/bin/env bash
# Device calls: issue 6's end-to-end cells for the 8B shape (BF16 weights, BF16 / E4M3 /
# software-decoder E4M3 KV, 256 output tokens, two scored repeats), judged by
# kvcap.bench.throughput_targets.
#   bash scripts/gpu_throughput.sh short    concurrency 16 / 64 x context 1K / 4K (~6 min warm;
#                                           CONTEXTS="1024" for 1K only), and the HF transformers
#                                           baseline at B = 1 / 16 x 1K in the same run (HF= : none)
#   bash scripts/gpu_throughput.sh pdl64    64 x 1K, BF16 / E4M3 KV: the default (on GPUs other than the
#                                           SXM H100 cuBLAS GEMMs, ordinary launches at 64 rows)
#                                           against every linear on kvcap's skinny kernels as
#                                           programmatic dependents
#                                           (KVCAP_SKINNY_GEMM_MAX_ROWS=64 KVCAP_PDL_MAX_ROWS=64),
#                                           alternating, two rounds (~5 min)
#   bash scripts/gpu_throughput.sh profile  where the 16 / 64 x 1K steps' kernel time goes (BF16 / E4M3 KV,
#                                           kvcap.bench.step_profile, 50 graphed steps; ~1 min)
#   bash scripts/gpu_throughput.sh rule     32 / 64 x 1K (BF16 weights, BF16 / E4M3 KV; 8B FP8 weights, E4M3 KV):
#                                           the default against every linear on cuBLAS and
#                                           ordinary launches above 16 rows (KVCAP_SKINNY_GEMM_MAX_ROWS=16
#                                           KVCAP_PDL_MAX_ROWS=16), alternating, two rounds (~6 min;
#                                           RULE_SHAPES / RULE_CONCURRENCY narrow it)
#   bash scripts/gpu_throughput.sh pdl64 profile   modes run in the order given
#   bash scripts/gpu_throughput.sh auto     `short` on an H200 (where issue 6 is judged), else
#                                           bash ${ELSE:-scripts/gpu_matrix.sh tests} (ELSE=/dev/null: nothing)
# Results under $OUT (default /tmp/out); the benchmark saves after every cell.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
short() {
  timeout ${SHORT_S:-570} python3 -m kvcap.bench.throughput --shapes llama-3.1-8b \
    --concurrency 16 64 --context ${CONTEXTS:-1024 4096} --kv fp16 fp8 fp8-software --dtype bfloat16 \
    --out-tokens 256 --repeats 2 ${HF---hf-baseline} --out "$OUT/throughput-8b-short.json" 2>&1 \
    | grep -vE "^\{" | tail -24
  python3 -m kvcap.bench.throughput_targets "$OUT/throughput-8b-short.json"
}
# alternate NAME "VAR=VALUE ..." BENCH-ARGS...: the default against the switched arm NAME,
# alternating, two rounds; each arm one throughput run per shape of SHAPES (BF16 weights with
# BF16 and E4M3 KV, FP8 weights with E4M3 KV), to $OUT/throughput-NAME-SHAPE-ARM-ROUND.json
alternate() {
  local name=$1 switched=$2; shift 2
  for arm in default-1 "$name-1" default-2 "$name-2"; do
    for shape in $SHAPES; do
      env $([ "${arm%-*}" = "$name" ] && echo $switched) \
        timeout 140 python3 -m kvcap.bench.throughput --shapes $shape \
        --kv $([ $shape = llama-3.1-8b ] && echo fp16) fp8 --dtype bfloat16 "$@" \
        --out "$OUT/throughput-$name-$shape-$arm.json" 2>&1 \
        | grep -E "^llama-3.1-8b[-a-z0-9]* +fp"
      echo "$arm $shape: exit ${PIPESTATUS[0]}"
    done
    rm -f "$OUT"/throughput-"$name"-*.png  # a device call returns at most 8 files
  done
}
pdl64() {
  SHAPES=llama-3.1-8b alternate pdl64 "KVCAP_SKINNY_GEMM_MAX_ROWS=64 KVCAP_PDL_MAX_ROWS=64" \
    --concurrency 64 --context 1024 --out-tokens 256 --repeats 2
}
rule() {
  SHAPES="${RULE_SHAPES:-llama-3.1-8b llama-3.1-8b-fp8}" alternate rows16 \
    "KVCAP_SKINNY_GEMM_MAX_ROWS=16 KVCAP_PDL_MAX_ROWS=16" \
    --concurrency ${RULE_CONCURRENCY:-32 64} --context 1024 --out-tokens 128 --repeats 2
}
profile() {
  timeout 300 python3 -m kvcap.bench.step_profile --dtype bfloat16 \
    --steps 50 --cells fp16:16:1024 fp8:16:1024 fp16:64:1024 fp8:64:1024 \
    --out "$OUT/step-profile-8b-1k.json" 2>&1 | grep -vE "^\{" | tail -40
}
[ $# -gt 0 ] || set -- usage
for mode in "$@"; do
  case "$mode" in
  short) short ;;
  pdl64) pdl64 ;;
  profile) profile ;;
  rule) rule ;;
  auto)
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    echo "GPU: $gpu"
    if [[ "$gpu" == *H200* ]]; then short; else bash ${ELSE:-scripts/gpu_matrix.sh tests}; fi ;;
  *) echo "usage: $0 short|pdl64|rule|profile|auto ..."; exit 2 ;;
  esac
done
