#!/usr/bin/env bash
# One call on a multi-GPU H200 machine (device tool), independent jobs side by side, one GPU
# each (timings on different GPUs of one host do not share a GPU; 64 host cores are plenty).
#   bash scripts/gpu_parallel.sh JOB[@GPU] ...   e.g. sampler@0 kernels@1 qsa@2 throughput@3
# Every job has its own timeout and log; results are packed into $OUT/results.tgz at the end
# (the device tool returns at most 8 files), before the call's own limit (DEADLINE_S).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; RES=/tmp/res; rm -rf "$RES"; mkdir -p "$OUT" "$RES"
LIMIT=${DEADLINE_S:-540}
CFG8B=kvcap/bench/configs/llama-3.1-8b.json

job_sampler() {
  [ -n "${SAMPLER_SKIP_TESTS:-}" ] || timeout 120 python3 -m pytest -q -m gpu tests/test_sampler.py 2>&1 | tail -3
  timeout ${SAMPLER_S:-300} python3 -m kvcap.bench.sampler --out "$RES/sampler" --sweep
}
job_kerneltests() {  # compiled-kernel tests (issue 5's GPU acceptance)
  timeout ${KTEST_S:-240} python3 -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_e4m3.py \
    2>&1 | tail -15
}
job_sweep() {  # decode launch-configuration sweep (docs/kernels.md)
  timeout $((LIMIT - 30)) python3 -m kvcap.bench.kernels --sweep-only --out "$RES/kernels-sweep.json"
}
job_kernels() {
  timeout $((LIMIT - 30)) python3 -m kvcap.bench.kernels --out "$RES/kernels.json"
}
job_qsa() {
  OUT="$RES/qsa" QSA_DEADLINE_S=${QSA_DEADLINE_S:-235} bash scripts/gpu_qsa.sh
}
job_hf() {
  timeout 200 python3 -m kvcap.bench.throughput --hf-only --out "$RES/hf"
}
job_engine() {
  OUT="$RES/engine" timeout 200 python3 scripts/gpu_engine_check.py
}
job_overhead() {
  timeout 100 python3 -m kvcap.bench.step_overhead --device cuda --config "$CFG8B" \
    --out "$RES/step_overhead.json" ${OVERHEAD_ARGS:-}
}
job_overlap() {  # engine overlap on vs off: per-step host time hidden behind the GPU
  timeout 100 python3 -m kvcap.bench.step_overhead --device cuda --config "$CFG8B" \
    --out "$RES/step_overhead-overlap.json"
  KVCAP_DISABLE_OVERLAP=1 timeout 100 python3 -m kvcap.bench.step_overhead --device cuda \
    --config "$CFG8B" --out "$RES/step_overhead-serial.json"
}
job_demo() {  # the README's main job on the GPU (calibrate -> overlay -> gate -> E4M3 -> A/B)
  timeout 300 python3 -m kvcap.cli demo --out "$RES/demo" --device cuda
}
job_cmpqsa() {  # issue 9: compare --qsa at the issue's 8K context / 2,048-token budget
  local d=/tmp/cmpqsa; rm -rf $d; mkdir -p $d
  timeout 120 python3 -m kvcap.cli calibrate --model default --out $d/cal --max-tokens 65536 \
    --device cuda && timeout 60 python3 -m kvcap.cli overlay --model default \
    --report $d/cal --out $d/pack && timeout 240 python3 -m kvcap.cli compare --overlay $d/pack \
    --qsa all-but-3 --tasks qsa --qsa-context 8192 --baseline-kv fp16 --device cuda \
    --out "$RES/cmpqsa"
}
job_fusedtest() {
  timeout 120 python3 -m pytest -q tests/test_fused_ops.py 2>&1 | tail -3
}
job_throughput3() {  # the decode cells only (no 64 x 16K prefill), every KV mode
  timeout ${THROUGHPUT_S:-200} python3 -m kvcap.bench.throughput --shapes llama-3.1-8b \
    --concurrency 16 64 --context 1024 --kv fp16 fp8 fp8-software --out-tokens 64 \
    --repeats 1 --out "$RES/throughput"
  timeout ${THROUGHPUT16_S:-120} python3 -m kvcap.bench.throughput --shapes llama-3.1-8b \
    --concurrency 16 --context 16384 --kv fp16 fp8 fp8-software --out-tokens 64 \
    --repeats ${TPUT_REPEATS:-1} --out "$RES/throughput16k"
}
job_throughputhf() {  # issue 6's 10x check with the HF baseline in the same run
  timeout ${THROUGHPUT_S:-300} python3 -m kvcap.bench.throughput --shapes llama-3.1-8b \
    --concurrency 1 16 --context 1024 --kv fp16 --out-tokens 64 --repeats 1 --hf-baseline \
    --out "$RES/throughput-hf"
}
job_tp() {  # issue 11 on the GPUs this job is given (CUDA_VISIBLE_DEVICES)
  OUT="$RES/tp" bash scripts/gpu_tp.sh --budget-s ${TP_BUDGET_S:-470}
}
job_profile() {  # where an 8B decode step's time goes (kernel categories, GEMMs vs ceiling)
  timeout ${PROFILE_S:-300} python3 -m kvcap.bench.step_profile --out "$RES/step-profile.json" \
    ${PROFILE_ARGS:-}
}
job_decoders() {  # E4M3 decoder pairings (K/V native/software) on the sweep cells
  timeout ${DECODERS_S:-240} python3 -m kvcap.bench.kernels --skip-checks --compare-decoders \
    --out "$RES/decoders${DECODERS_ARGS:+-contig}.json" ${DECODERS_ARGS:-}
}
job_occupancy() {  # E4M3 decode: launch configs x register caps x split counts (8B cells)
  timeout ${OCCUPANCY_S:-420} python3 -m kvcap.bench.kernels --skip-checks --sweep-occupancy \
    --out "$RES/occupancy.json" ${OCCUPANCY_ARGS:-}
}
job_kernels8b() {  # the issue-5 target cells (8B shape) with SDPA, FP16 paged and both decoders
  timeout ${KERNELS8B_S:-200} python3 -m kvcap.bench.kernels --shapes llama31-8b \
    --batches 8,16,64 --contexts 4096,16384,32768 --out "$RES/kernels-8b.json"
}
job_tput32k() {  # the 16 x 32K decode cell, every KV mode, current defaults
  timeout ${THROUGHPUT32_S:-300} python3 -m kvcap.bench.throughput --shapes llama-3.1-8b \
    --concurrency 16 --context 32768 --kv ${TPUT_KV:-fp16 fp8 fp8-software} --out-tokens 64 \
    --repeats 1 --out "$RES/throughput32k"
}
job_tput16k() {  # the 16 x 16K decode cell, every KV mode, current defaults
  timeout ${THROUGHPUT16_S:-200} python3 -m kvcap.bench.throughput --shapes llama-3.1-8b \
    --concurrency 16 --context 16384 --kv ${TPUT_KV:-fp16 fp8 fp8-software} --out-tokens 64 \
    --repeats ${TPUT_REPEATS:-1} --out "$RES/throughput16k"
}
job_tputlong() {  # 16 x 16K and 16 x 32K in one run, every KV mode, current defaults
  timeout ${TPUTLONG_S:-480} python3 -m kvcap.bench.throughput --shapes llama-3.1-8b \
    --concurrency 16 --context 16384 32768 --kv fp16 fp8 fp8-software --out-tokens 64 \
    --repeats 1 --out "$RES/throughputlong"
}
job_gemm() {  # decode-size GEMMs: cuBLAS vs the weight-streaming Triton kernel (sweep)
  timeout ${GEMM_S:-300} python3 -m kvcap.bench.gemm --out "$RES/gemm.json"
}
job_gputests() {  # the whole GPU test suite (the server tests need openai/uvicorn: not there)
  # GPUTESTS_XDIST=N: N pytest-xdist workers (carried as a wheel; the tests are compile-bound)
  timeout ${GPUTESTS_S:-500} python3 -m pytest -q -m gpu ${GPUTESTS_XDIST:+-n $GPUTESTS_XDIST} \
    tests --ignore=tests/test_server.py \
    --ignore=tests/test_server_load.py --ignore=tests/test_serve_cli.py 2>&1 | tail -25
}
job_ncu() {  # Nsight Compute over the decode kernels (hardware counters; Firecracker kinds only)
  local rep="$RES/ncu-decode"
  timeout ${NCU_S:-300} ncu --clock-control none --profile-from-start off --set full \
    --import-source no -f -o "$rep" python3 scripts/ncu_decode.py ${NCU_ARGS:-} 2>&1 | tail -8
  ncu -i "$rep.ncu-rep" --page details > "$RES/ncu-details.txt" 2>&1
  ncu -i "$rep.ncu-rep" --page raw --csv > "$RES/ncu-raw.csv" 2>&1
  ncu -i "$rep.ncu-rep" --page source --print-source sass --csv > "$RES/ncu-sass.csv" 2>&1
  python3 scripts/ncu_summary.py "$RES/ncu-details.txt" "$RES/ncu-sass.csv" \
    --out "$RES/ncu-decode.json" --meta "{\"commit\": \"$KVCAP_COMMIT\"}"
  grep -E "Duration|DRAM Throughput|Issue Slots Busy|Registers Per" "$RES/ncu-details.txt" | head -40
}
job_throughput() {
  timeout $((LIMIT - 60)) python3 -m kvcap.bench.throughput --shapes llama-3.1-8b \
    --concurrency 16 64 --context 1024 16384 --kv fp16 fp8 fp8-software --out-tokens 64 \
    --repeats 1 --out "$RES/throughput"
}

nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
pids=()
for spec in "$@"; do
  gpu=${spec#*@}; [[ $spec == *@* ]] || gpu=0
  ( IFS=+ read -ra jobs <<< "${spec%@*}"
    for j in "${jobs[@]}"; do   # JOB1+JOB2@GPU runs them one after the other
      echo "=== $j on GPU $gpu"; CUDA_VISIBLE_DEVICES=$gpu "job_$j"; echo "=== $j rc=$?"
    done ) > "$RES/${spec%@*}.log" 2>&1 &
  pids+=($!)
done
( sleep "$LIMIT"; echo "deadline: killing jobs"; kill -- "${pids[@]}" 2>/dev/null
  pkill -f python3 ) &
killer=$!
wait "${pids[@]}"
kill "$killer" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$RES" .
for f in "$RES"/*.log; do echo "##### $f"; grep -E "=== |passed|failed|rc=|Error|error|x SDPA|tok/s|speedup|target|TB/s" "$f" | tail -25; done
