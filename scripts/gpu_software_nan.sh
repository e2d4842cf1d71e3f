#!/usr/bin/env bash
# One device call: what the software E4M3 decoder's NaN codes cost (2026-12-07). Before, its
# three integer instructions per byte pair decoded 0x7F/0xFF to +-480; SYSTEM.md §1 asks NaN.
# Three forms of common._packed_pair_ptx, written from the checkout's own common.py:
#   old  the three instructions (NaN codes +-480)
#   fma  + mul.rn.f16x2 / fma.rn.f16x2 on the FMA pipe (the shipped form)
#   alu  + add.u32 / lop3.b32 on the integer pipe
# First the GPU decoder tests on the fma and alu forms (all 256 codes, every route), then
# `kvcap.bench.kernels --compare-decoders` (every K/V decoder pairing on the word cells; each
# output must equal the native one) per form, in the order of VARIANTS, and a table of the
# software-software times against `old`. Results under $OUT (default /tmp/out).
#   bash scripts/gpu_software_nan.sh            VARIANTS="old fma alu fma old alu"
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVCAP_COMMIT=${KVCAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
src=kvcap/kernels/common.py
cp "$src" /tmp/common_fma.py
python3 - <<'EOF' || exit 1
s = open("/tmp/common_fma.py").read()
tail = ('            f"and.b32 t, t, {_SOFTWARE_MASK}; mul.rn.f16x2 n, t, k; "\n'
        '            f"fma.rn.f16x2 {dst}, n, z, t; ")')
assert tail in s, "common._packed_pair_ptx changed: update this script"
forms = {"old": '            f"and.b32 {dst}, t, {_SOFTWARE_MASK}; ")',
         "alu": ('            f"and.b32 t, t, {_SOFTWARE_MASK}; add.u32 n, t, 0x00800080; "\n'
                 '            f"lop3.b32 {dst}, t, n, 0x40004000, 0xF8; ")')}
for name, text in forms.items():
    open(f"/tmp/common_{name}.py", "w").write(s.replace(tail, text))
EOF
for v in fma alu; do
  cp /tmp/common_$v.py "$src"
  echo "== GPU decoder tests, $v"
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_decoder_check.py \
    tests/test_kernels_gpu.py::test_conversion_exact_all_codes 2>&1 | tail -2
done
i=0
for v in ${VARIANTS:-old fma alu fma old alu}; do
  i=$((i + 1))
  cp /tmp/common_$v.py "$src"
  timeout 150 python3 -m kvcap.bench.kernels --skip-checks --dtype "${DTYPE:-bfloat16}" \
    --compare-decoders --out "$OUT/software-nan-$i-$v.json" 2>&1 | grep -E "^decoders"
done
cp /tmp/common_fma.py "$src"
python3 - "$OUT" <<'EOF'
import glob, json, statistics, sys
runs = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/software-nan-*.json")):
    form = f.rsplit("-", 1)[1].removesuffix(".json")
    for r in json.load(open(f))["info"]["compare_decoders"]:
        key = (r["shape"], r["batch"], r["context"], r["fp8_mode"])
        runs.setdefault(key, {}).setdefault(form, []).append(r["ms"])
        assert r["max_abs_diff_vs_native"] == 0.0 or r["fp8_mode"] == "native", (f, r)
print("cell                          mode        old us   fma/old  alu/old")
for (shape, b, ctx, mode), forms in runs.items():
    old = statistics.median(forms["old"])
    ratio = {k: statistics.median(v) / old for k, v in forms.items()}
    print(f"{shape:13s} B={b:<3d} ctx={ctx:<6d} {mode:10s} {old * 1e3:8.1f} "
          f"{ratio.get('fma', float('nan')):8.3f} {ratio.get('alu', float('nan')):8.3f}")
EOF
