#!/usr/bin/env bash
# Issue 11's whole multi-GPU run (2 or 4 GPUs, <= 8 minutes): see scripts/gpu_tp.py.
#   OUT=/some/dir bash scripts/gpu_tp.sh [gpu_tp.py options]   # JSON + tp.log in $OUT
#   bash scripts/gpu_tp.sh --cpu-smoke                         # the CPU check of the script
# Without 2 CUDA GPUs (and without --cpu-smoke / --dry-run) it says so and exits 3.
set -uo pipefail

# NVLink multicast stays off for this process and every child (NCCL, symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
REPO=$PWD
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || { echo "gpu_tp.sh: $PY not found (set PYTHON)"; exit 2; }
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ -d /tmp/site ]; then
  case ":$PYTHONPATH:" in *:/tmp/site:*) ;; *) export PYTHONPATH="$PYTHONPATH:/tmp/site" ;; esac
fi
OUT=${OUT:-/tmp/gpu_tp_out}
mkdir -p "$OUT" || { echo "gpu_tp.sh: cannot create $OUT"; exit 2; }
export OUT

echo "gpu_tp.sh: $(date -u +%FT%TZ) repo $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')), out $OUT, $PY" | tee "$OUT/tp.log"
"$PY" -u scripts/gpu_tp.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/tp.log"
rc=${PIPESTATUS[0]}
echo "gpu_tp.sh: exit $rc; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')" | tee -a "$OUT/tp.log"
exit "$rc"
