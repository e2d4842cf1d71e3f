#!/usr/bin/env bash
# Device calls (nvidia-h200): the decode-size GEMM rule (kvcap.models.decode_gemm: o_proj,
# down_proj, the fused gate/up + SiLU, the LM head on kvcap.kernels.skinny_gemm) against cuBLAS.
#   bash scripts/gpu_skinny.sh gemm      the GEMM tests compiled on the GPU, then the kernel sweep
#                                        (kvcap.bench.gemm) at 16 and 64 rows (~7 min)
#   bash scripts/gpu_skinny.sh wide      at 64 rows (where the model keeps cuBLAS for QKV, down_proj
#                                        and gate/up): 128- / 256-column tiles, unsplit and split
#                                        2 / 4, against cuBLAS (~4 min)
#   bash scripts/gpu_skinny.sh profile   the 8B decode step profiled with the rule off and on
#                                        (~4 min)
#   bash scripts/gpu_skinny.sh e2e       1K decode end to end, rule off / on / off / on (~8 min)
# Results under $OUT (default /tmp/out).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "${1:-}" in
gemm)
  timeout 200 python3 -m pytest -q -m "gpu or not gpu" tests/test_decode_gemm.py \
    tests/test_skinny_gemm.py tests/test_fused_ops.py 2>&1 | tail -4 | tee "$OUT/tests.txt"
  grep -q " passed" "$OUT/tests.txt" && ! grep -qE "failed|error" "$OUT/tests.txt" || {
    echo "tests did not pass: no timings"; exit 1; }
  timeout 420 python3 -m kvcap.bench.gemm --linears swiglu o_proj down_proj lm_head \
    --rows 16 64 --stages 3 5 8 --warps 4 --splits 1 2 4 --out "$OUT/gemm-skinny.json" 2>&1 \
    | grep -vE "^[a-z_]+ m=" | tail -16 ;;
wide)
  timeout 150 python3 -m pytest -q -m "gpu or not gpu" tests/test_skinny_gemm.py 2>&1 | tail -2
  timeout 420 python3 -m kvcap.bench.gemm --linears qkv_proj down_proj o_proj swiglu --rows 64 \
    --block-ns 128 256 --stages 3 4 --warps 4 8 --splits 1 2 4 --out "$OUT/gemm-wide-64.json" \
    2>&1 | grep -vE "^[a-z_]+ m=" | tail -8 ;;
profile)
  cells="fp8:1:1024 fp16:16:1024 fp8:16:1024 fp8:64:1024"
  for arm in off on; do
    [ $arm = off ] && flag=1 || flag=0
    KVCAP_DISABLE_SKINNY_GEMM=$flag timeout 120 python3 -m kvcap.bench.step_profile \
      --dtype bfloat16 --cells $cells --steps 100 --rows 12 \
      --out "$OUT/step-profile-skinny-$arm.json" 2>&1 | grep -E "wall|gemm" | sed "s/^/$arm /"
  done ;;
e2e)
  for run in 1 2; do
    for arm in off on; do
      [ $arm = off ] && flag=1 || flag=0
      KVCAP_DISABLE_SKINNY_GEMM=$flag timeout 140 python3 -m kvcap.bench.throughput \
        --dtype bfloat16 --concurrency 1 16 64 --context 1024 --kv fp16 fp8 --out-tokens 128 \
        --repeats 2 --out "$OUT/e2e-$arm-$run" 2>&1 | grep -E "^\|" | sed "s/^/$arm$run /"
    done
  done ;;
*) echo "usage: $0 gemm|wide|profile|e2e"; exit 2 ;;
esac
