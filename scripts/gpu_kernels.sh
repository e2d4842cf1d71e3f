#!/usr/bin/env bash
# Kernel session on one H200 (run from the repo root by the device tool): launch-config sweep
# (incl. the transposed decode loop) first, then the compiled correctness tests of the new
# route. Each step is time-capped and reported; logs and JSON go to $OUT.
set -u -o pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "${SWEEP_S:-330}" python3 -m kvcap.bench.kernels --sweep-only \
  --out "$OUT/kernels-sweep.json" 2>&1 | tee "$OUT/sweep.log" | grep -E "^sweep|check|ceil|FAIL|Error"
echo "sweep rc=$?"
timeout "${TEST_S:-200}" python3 -m pytest -q -m gpu -x tests/test_kernels_gpu.py -k transposed \
  2>&1 | tail -5 | tee "$OUT/test_transposed.log"
