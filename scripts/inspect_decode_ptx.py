"""Compile kvcap's paged decode kernel for an NVIDIA target on any machine (no GPU needed) and
count the shared-memory, ldmatrix, MMA and conversion instructions in its PTX — the reading
behind docs/kernels.md's third to fifth changes (the 8B shape: group 4, D=128, BLOCK_N=128).

    python scripts/inspect_decode_ptx.py [--cache fp16|native|software] [--words] [--sm 90]
        [--head-dim 128] [--dump DIR]

Counts are per compiled kernel (the loop body appears once, plus the prologue). Use the GPU's
Triton version for numbers that match the GPU (docs/kernels.md used triton 3.6, installed with
`pip install --target DIR triton==3.6.0` and put first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvcap.kernels import decode  # noqa: E402
from kvcap.kernels.common import target_properties  # noqa: E402

PATTERNS = ["ld.shared.b8", "ld.shared", "st.shared", "ldmatrix", "mma.sync", "wgmma",
            "cp.async", "bar.sync", "cvt.rn.f16x2.e4m3x2", "prmt", "cvt.f32.f16",
            "cvt.rn.bf16.f16", "cvt.rn.bf16x2.f32", "griddepcontrol.wait",
            "griddepcontrol.launch_dependents", "prefetch.global.L2"]


def compile_kernel(fn, consts: dict, fp8: bool, sm: int, num_warps: int, num_stages: int,
                   maxnreg: int | None = None, qtype: str = "fp16", fp_fusion: bool = True):
    """triton.compile a kvcap attention kernel for `sm`, pointers typed as its launcher passes
    them (E4M3 caches as uint8, queries and outputs `qtype`) and marked 16-byte aligned as the
    JIT marks them; FP fusion as its launcher asks (common.FP_FUSION; off for the fused layer
    ops)."""
    params = list(inspect.signature(fn.fn).parameters)
    consts = {k: v for k, v in consts.items() if k in params}  # older kernels: fewer switches
    cache = "*u8" if fp8 else f"*{qtype}"
    ptrs = dict(q_ptr=f"*{qtype}", qkv_ptr=f"*{qtype}", cos_ptr=f"*{qtype}", sin_ptr=f"*{qtype}",
                k_ptr=f"*{qtype}", v_ptr=f"*{qtype}", slot_ptr="*i64", kc_ptr=cache,
                vc_ptr=cache, out_ptr=f"*{qtype}", po_ptr="*fp32",
                plse_ptr="*fp32", bt_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32",
                ks_ptr="*fp32", vs_ptr="*fp32", tok_ptr="*i32", seq_ptr="*i32", cnt_ptr="*i32",
                x_ptr=f"*{qtype}", w_ptr="*u8", s_ptr="*fp32", b_ptr="*fp32", y_ptr=f"*{qtype}",
                ws_ptr="*fp32")
    sig, attrs = {}, {}
    for i, p in enumerate(params):
        sig[p] = ("constexpr" if p in consts else ptrs.get(p)
                  or ("fp32" if p in ("sm_scale", "scale_factor") else "i32"))
        # k_split: split-K GEMMs' K range per program, whole BLOCK_K steps (>= 16 columns)
        if p in ptrs or p.startswith("stride") or p == "k_split":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", sm, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       maxnreg=maxnreg, enable_fp_fusion=fp_fusion))


def inspect_rope(args, fp8: bool) -> int:
    """The fused RoPE kernel writing one K/V head row into the paged cache (fused_ops, 8B shape:
    32 / 8 heads, one warp at D <= 128): whole-kernel SASS counts, the E4M3 encoder's form by
    --encoder (docs/kernels.md, nineteenth change)."""
    from kvcap.kernels import fused_ops

    hw = fp8 and args.encoder == "hardware"
    consts = dict(HQ=32, HKV=8, D=args.head_dim, STORE=True, FP8=fp8, BLOCK_SIZE=16,
                  HW_ENCODE=hw, GDC=0)  # GDC: an ordinary launch (a constexpr left out
    # would compile as a runtime argument, with its programmatic-launch branch)
    nw = 1 if args.head_dim <= 128 else 2
    k = compile_kernel(fused_ops._rope_split_kernel, consts, fp8, args.sm, nw, 1, None, args.dtype,
                       fp_fusion=False)
    print(f"triton {triton.__version__}, sm_{args.sm}, rope write, cache {args.cache}, "
          f"{args.dtype} rows, D={args.head_dim}, encoder "
          f"{('hardware' if hw else 'integer') if fp8 else 'none (16-bit copy)'}")
    lines = sass_instructions(k.asm["cubin"])
    print(f"  sass instructions      {len(lines)}")
    for op in ("F2FP", "FCHK", "LDG", "STG"):
        print(f"  sass {op:17s} {count_op([t for _, t in lines], op)}")
    return 0


def inspect_fp8_gemm(args) -> int:
    """The weight-only FP8 GEMM (kernels/fp8_gemm.py) at launch_config's launch for --sm, for
    --rows rows of an --n x --k weight whose scales change every --k-group columns (--k-group
    0: one scale a row), 132 SMs; --cache software: the packed decoder."""
    from kvcap.kernels import fp8_gemm

    k_group = args.k_group or args.k
    bm, bn, bk, nw, ns, swap, tile_scales = fp8_gemm.launch_config(
        args.rows, args.n, k_group, args.k, target_properties(args.sm), 132, args.swiglu)
    if args.gemm_tile:  # a sweep's launch instead of the default
        (bm, bn, bk, nw, ns), swap, tile_scales = args.gemm_tile, args.swap_ab, args.tile_scales
    grouped = k_group < args.k
    consts = dict(ROW_BLOCK=128 if grouped else 1, K_GROUP=k_group, GROUPED_K=grouped,
                  HAS_BIAS=False, SWIGLU=args.swiglu, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                  EVEN_K=args.k % bk == 0, SOFTWARE=args.cache == "software",
                  DOT_DTYPE=tl.bfloat16 if args.dtype == "bf16" else tl.float16,
                  SPLIT_K=args.split_k, GDC=args.gdc, SWAP_AB=swap, TILE_SCALES=tile_scales)
    k = compile_kernel(fp8_gemm._fp8_gemm_kernel, consts, True, args.sm, nw, ns, None,
                       args.dtype, fp_fusion=False)
    print(f"triton {triton.__version__}, sm_{args.sm}, fp8_gemm, {args.rows} rows of "
          f"{args.n} x {args.k}, K groups {k_group}, decoder {args.cache}, {args.dtype}, "
          f"BLOCK {bm} x {bn} x {bk}, {nw} warps, {ns} stages, K split {args.split_k}"
          f"{', operands swapped' if swap else ''}"
          f"{', scales on the decoded tiles' if tile_scales else ''}")
    ptx = k.asm["ptx"]
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        (args.dump / "fp8_gemm.ttgir").write_text(k.asm["ttgir"])
        (args.dump / "fp8_gemm.ptx").write_text(ptx)
    for pattern in ("cvt.rn.f16x2.e4m3x2", "prmt", "mma.sync", "wgmma", "griddepcontrol.wait",
                    "griddepcontrol.launch_dependents", "atom.global"):
        print(f"  {pattern:22s} {ptx.count(pattern)}")
    # warpgroup MMAs whose A operand is registers ("{acc}, {a regs}, b-descriptor"), not a
    # shared-memory descriptor: the swapped launch's decoded weight tile
    wgmma_reg_a = len(re.findall(r"wgmma\.mma_async[^;]*\}, \{", ptx))
    print(f"  {'wgmma register A':22s} {wgmma_reg_a}")
    print(f"  shared memory bytes    {k.metadata.shared}")
    for key, value in ptxas_usage(ptx, args.sm).items():
        print(f"  {key:22s} {value}")
    return 0


def inspect_other(args, fp8: bool) -> int:
    """The chunked-prefill or the QSA sparse kernel (group 4) at its launcher's tiles for --sm."""
    import torch

    from kvcap.kernels import prefill, qsa_attention

    cuda, mma, software = torch.device("cuda"), args.sm >= 80, args.cache == "software"
    if args.kernel == "prefill":
        # what prefill_config reads from the GPU: the target's compute capability
        prefill.capability = lambda device: (args.sm // 10, args.sm % 10)
        block_m, bn, nw, ns, maxnreg = prefill.prefill_config(args.head_dim, 4, cuda, fp8,
                                                              mma=mma)
        if args.block_m:  # a tile to inspect instead of the launcher's
            block_m, bn, nw, ns = args.block_m, args.block_n, args.num_warps, args.num_stages
        if args.block_m or args.maxnreg is not None:  # as paged_prefill's knobs
            maxnreg = args.maxnreg or None
        consts = dict(GROUP=4, BLOCK_G=4, BLOCK_Q=block_m // 4, HEAD_DIM=args.head_dim,
                      BLOCK_SIZE=16, BLOCK_N=bn, FP8=fp8, SOFTWARE=software,
                      DOT_DTYPE=tl.bfloat16 if args.dtype == "bf16" else tl.float16,
                      IEEE=False, SKIP_DECODE=True, USE_DOT=True, PREFETCH=False,
                      WINDOW=args.window)
        fn, tile = prefill._prefill_kernel, f"BLOCK_M={block_m}, BLOCK_N={bn}"
    else:
        maxnreg = args.maxnreg
        bn, nw, ns, _ = qsa_attention.sparse_config(cuda, fp8, args.head_dim, mma=mma)
        consts = dict(GROUP=4, BLOCK_H=16, HEAD_DIM=args.head_dim, BLOCK_SIZE=16, BLOCK_N=bn,
                      SPLIT=True, FP8=fp8, SOFTWARE=software, USE_DOT=True,
                      DOT_DTYPE=tl.bfloat16 if args.dtype == "bf16" else tl.float16,
                      IEEE=False, SHARED_SEL=True)
        fn, tile = qsa_attention._sparse_kernel, f"BLOCK_N={bn}"
    k = compile_kernel(fn, consts, fp8, args.sm, nw, ns, maxnreg, args.dtype)
    print(f"triton {triton.__version__}, sm_{args.sm}, {args.kernel}, cache {args.cache}, "
          f"{args.dtype} queries, register cap {maxnreg}, "
          f"D={args.head_dim}, {tile}, {nw} warps, {ns} stages")
    print(f"  mma.sync               {k.asm['ptx'].count('mma.sync')}")
    print(f"  shared memory bytes    {k.metadata.shared}")
    for key, value in ptxas_usage(k.asm["ptx"], args.sm).items():
        print(f"  {key:22s} {value}")
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        (args.dump / f"{args.kernel}.ttgir").write_text(k.asm["ttgir"])
        (args.dump / f"{args.kernel}.ptx").write_text(k.asm["ptx"])
    return 0


def ptxas_usage(ptx: str, sm: int) -> dict[str, int]:
    """Registers per thread and spilled bytes, from `ptxas -v` of the Triton wheel's ptxas."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    arch = f"sm_{sm}a" if sm >= 90 else f"sm_{sm}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run([get_ptxas(sm).path, f"-arch={arch}", "-v", str(src), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    info = run.stdout + run.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    return {"registers": int(regs[1]) if regs else -1,
            "spill store bytes": int(spills[1]) if spills else -1}


SASS_OPS = ("LOP3", "SHF", "PRMT", "IMAD", "F2FP", "HMMA", "LDS", "LDL", "STL", "BAR", "FMUL")


def sass_instructions(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction text) of every SASS instruction in `cubin`, from the Triton
    wheel's cuobjdump."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    tool = Path(get_ptxas(90).path).with_name("cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True,
                              check=True).stdout
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(\S.*?);", line)
        if m:
            ins.append((int(m[1], 16), m[2]))
    return ins


def count_op(instructions: list[str], op: str) -> int:
    """How many SASS instructions have opcode `op` (any modifiers)."""
    return sum(1 for t in instructions if re.search(rf"(^|\s){op}(\.|\s|$)", t))


def tile_loop_sass(cubin: bytes) -> dict[str, int]:
    """SASS instruction counts of the kernel's tile loop -- the span of its longest backward
    branch: the per-tile work the docs compare (e.g. the E4M3 software decoder's integer
    instructions against the hardware conversion's)."""
    ins = sass_instructions(cubin)
    loops = [(int(m[1], 16), a) for a, t in ins
             if (m := re.search(r"BRA (0x[0-9a-f]+)", t)) and int(m[1], 16) < a]
    if not loops:
        return {"loop instructions": 0}
    lo, hi = max(loops, key=lambda span: span[1] - span[0])
    body = [t for a, t in ins if lo <= a <= hi]
    counts = {"loop instructions": len(body)}
    for op in SASS_OPS:
        counts[op] = count_op(body, op)
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", choices=["fp16", "native", "software"], default="native")
    ap.add_argument("--words", action="store_true", help="the E4M3 word route")
    ap.add_argument("--mixed", action="store_true",
                    help="with --cache native: V through the software decoder (fp8_mode native-k)")
    ap.add_argument("--sm", type=int, default=90)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dump", type=Path, help="write the TTGIR and PTX here")
    ap.add_argument("--sass", action="store_true",
                    help="decode: also count the tile loop's SASS instructions (cuobjdump)")
    ap.add_argument("--json", type=Path,
                    help="decode: also write the counts, with triton version and commit, here")
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--num-stages", type=int, default=2)
    ap.add_argument("--pairs", action="store_true", help="word route: bytes permuted in pairs")
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16",
                    help="query dtype (bf16 over an E4M3 cache on sm_80+: FP16 dots)")
    ap.add_argument("--defaults", action="store_true",
                    help="tile, warps, stages, register cap and pairs from decode_config (CUDA)")
    ap.add_argument("--short", action="store_true",
                    help="with --defaults and without --words: the short-context byte route's "
                         "launch (decode.short_byte_route)")
    ap.add_argument("--maxnreg", type=int, help="register cap per thread (ptx .maxnreg)")
    ap.add_argument("--block-m", type=int,
                    help="prefill: dot rows of this tile (with --block-n/--num-warps/"
                         "--num-stages) instead of prefill_config's")
    ap.add_argument("--kernel", choices=["decode", "prefill", "qsa", "rope", "fp8_gemm"],
                    default="decode",
                    help="prefill: the chunked-prefill kernel, qsa: the sparse (QSA) attention "
                         "kernel, both group 4 at their launchers' tiles for --sm; rope: the "
                         "fused RoPE kernel writing the cache; fp8_gemm: the FP8-weight GEMM "
                         "(--rows, --n, --k, --k-group, --swiglu, --split-k)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--k-group", type=int, default=0)
    ap.add_argument("--swiglu", action="store_true")
    ap.add_argument("--split-k", type=int, default=1, help="fp8_gemm: SPLIT_K (grid axis 2)")
    ap.add_argument("--swap-ab", action="store_true",
                    help="fp8_gemm with --gemm-tile: weight rows as the MMA's M (SWAP_AB)")
    ap.add_argument("--tile-scales", action="store_true",
                    help="fp8_gemm with --gemm-tile --swap-ab and --k-group: scales along K on "
                         "the decoded tiles (TILE_SCALES)")
    ap.add_argument("--gemm-tile", type=int, nargs=5, metavar=("BM", "BN", "BK", "WARPS", "STAGES"),
                    help="fp8_gemm: this launch instead of launch_config's")
    ap.add_argument("--gdc", type=int, choices=[0, 1, 2], default=0,
                    help="decode: programmatic dependent launch form (common.pdl_mode: 0 an "
                         "ordinary launch, 1 release at the end, 2 release at once; sm_90+)")
    ap.add_argument("--prewait", action="store_true",
                    help="decode: the first tile's L2 prefetch ahead of the dependent-launch "
                         "wait (paged_decode's prewait; with --gdc 1 or 2)")
    ap.add_argument("--window", type=int, default=0,
                    help="decode / prefill: a sliding window of this many tokens (the "
                         "kernels' WINDOW; 0: none)")
    ap.add_argument("--encoder", choices=["hardware", "integer"], default="hardware",
                    help="rope with an E4M3 cache: the encoder form (store_kv.encode_e4m3)")
    args = ap.parse_args()
    fp8 = args.cache != "fp16"
    if args.kernel == "rope":
        return inspect_rope(args, fp8)
    if args.kernel == "fp8_gemm":
        return inspect_fp8_gemm(args)
    if args.kernel != "decode":
        return inspect_other(args, fp8)
    if args.defaults:
        import torch

        # what decode_config reads from the GPU: the target's compute capability (its shared
        # memory per SM then comes from common._SHARED_PER_SM)
        decode.device_properties = lambda device: target_properties(args.sm)
        cfg = decode.decode_config(args.head_dim, True, fp8, torch.device("cuda"), args.words,
                                   mma=args.sm >= 80, short_route=args.short)
        args.block_n, args.num_warps, args.num_stages = cfg.block_n, cfg.num_warps, cfg.num_stages
        args.pairs = args.words and cfg.pairs
        if args.maxnreg is None:  # an explicit --maxnreg overrides the default cap
            args.maxnreg = cfg.maxnreg
    if args.words and not fp8:
        ap.error("--words needs an E4M3 cache (--cache native|software)")
    # BF16 queries over E4M3: FP16 dots on MMA GPUs (paged_decode's fp16_dots default)
    f16_dots = fp8 and args.dtype == "bf16" and args.sm >= 80
    consts = dict(GROUP=4, HEADS=4, BLOCK_H=16, HEAD_DIM=args.head_dim, BLOCK_SIZE=16,
                  BLOCK_N=args.block_n, SPLIT=True, FP8=fp8, SOFTWARE=args.cache == "software",
                  SOFTWARE_V=args.cache == "software" or args.mixed,
                  USE_DOT=True, IEEE=False, PREFETCH=False,
                  DOT_DTYPE=tl.bfloat16 if args.dtype == "bf16" and not f16_dots else tl.float16,
                  WORDS=args.words, PAIRS=args.pairs, FOLD=True, BLOCK_S=8, F16_DOTS=f16_dots,
                  GDC=args.gdc, PREWAIT=args.prewait, WINDOW=args.window)
    k = compile_kernel(decode._decode_kernel, consts, fp8, args.sm, args.num_warps,
                       args.num_stages, args.maxnreg, args.dtype)
    ptx = k.asm["ptx"]
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        (args.dump / "decode.ttgir").write_text(k.asm["ttgir"])
        (args.dump / "decode.ptx").write_text(ptx)
    print(f"triton {triton.__version__}, sm_{args.sm}, cache {args.cache}, "
          f"{'words' if args.words else 'bytes'}, D={args.head_dim}, BLOCK_N={args.block_n}, "
          f"{args.num_warps} warps, {args.num_stages} stages")
    for pat in PATTERNS:
        n = len(re.findall(re.escape(pat) + (r"\b" if pat == "ld.shared.b8" else ""), ptx))
        print(f"  {pat:22s} {n}")
    print(f"  shared memory bytes    {k.metadata.shared}")
    usage = ptxas_usage(ptx, args.sm)
    for key, value in usage.items():
        print(f"  {key:22s} {value}")
    sass = tile_loop_sass(k.asm["cubin"]) if args.sass else {}
    for key, value in sass.items():
        print(f"  sass {key:17s} {value}")
    if args.json:
        import json

        from kvcap.bench.provenance import stamp
        from kvcap.scales.fsutil import atomic_write_text

        atomic_write_text(args.json, json.dumps({
            "triton": triton.__version__, "sm": args.sm, "cache": args.cache,
            "words": args.words, "pairs": args.pairs, "head_dim": args.head_dim,
            "dtype": args.dtype, "block_n": args.block_n, "num_warps": args.num_warps,
            "num_stages": args.num_stages, "maxnreg": args.maxnreg, **stamp(),
            **usage, "sass_tile_loop": sass}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
