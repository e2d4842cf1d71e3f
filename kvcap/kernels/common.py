"""Shared pieces of the attention kernels: E4M3 tile decoders, paged addressing, routing
switches and launch heuristics. Imports nothing else of kvcap (kernels take tensors and ints).

E4M3 decode on read, two exact routes, both on the raw [N, D] byte tile:
  * native: `cvt.rn.f16x2.e4m3x2`, the hardware conversion (SM89+), two bytes per instruction;
  * software ("packed"): per pair of bytes, one byte permute (which also replicates each
    byte's sign into the byte above it), one shift and one AND put each byte's `eeeemmm` in
    FP16 exponent/mantissa positions and its sign in FP16's sign bit: the E4M3 value times
    2^-8 exactly (subnormals included). The 2^8 is folded into the hoisted scales, so the
    decoder costs no float multiply at all.
Both are inline PTX in compiled kernels; the CPU interpreter runs Triton-op twins of them.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

# Environment rollback switches (read at every launch so tests can flip them).
ENV_FORCE_SOFTWARE_FP8 = "KVCAP_FORCE_SOFTWARE_FP8"
ENV_DISABLE_GROUPED = "KVCAP_DISABLE_GROUPED_DECODE"
ENV_DISABLE_SPLIT_K = "KVCAP_DISABLE_SPLIT_K"
ENV_DISABLE_WORDS = "KVCAP_DISABLE_WORD_DECODE"
ENV_MIXED = "KVCAP_MIXED_DECODERS"
ENV_DISABLE_FP16_DOTS = "KVCAP_DISABLE_FP16_DOTS"
ENV_DISABLE_ROPE_KV_WRITE = "KVCAP_DISABLE_ROPE_KV_WRITE"
ENV_SOFTWARE_ENCODE = "KVCAP_SOFTWARE_E4M3_ENCODE"
ENV_DISABLE_PDL = "KVCAP_DISABLE_PDL"
ENV_PDL_RELEASE = "KVCAP_PDL_RELEASE"
ENV_PDL_MAX_ROWS = "KVCAP_PDL_MAX_ROWS"

SOFTWARE_FP8_FACTOR = 256.0  # the packed decoder yields value * 2^-8
LOG2E = 1.4426950408889634


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_PROPERTIES: dict[int, object] = {}


def device_properties(device: torch.device):
    """torch.cuda.get_device_properties of a CUDA device, cached: launchers ask for the SM
    count, the compute capability and the SM's resources at every kernel launch."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PROPERTIES:
        _PROPERTIES[idx] = torch.cuda.get_device_properties(idx)
    return _PROPERTIES[idx]


def capability(device: torch.device) -> tuple[int, int]:
    props = device_properties(device)
    return props.major, props.minor


def has_native_fp8(device: torch.device) -> bool:
    """SM89+ converts E4M3 in hardware; the CPU interpreter emulates the conversion."""
    if device.type != "cuda":
        return True
    return capability(device) >= (8, 9)


def has_mma(device: torch.device) -> bool:
    """Whether Triton's tl.dot uses tensor-core MMA on `device` (sm_80+); below it (Volta,
    Turing) dots run as FMA loops with very different register needs. The CPU interpreter
    counts as MMA so that CPU tests run the defaults modern GPUs run."""
    if device.type != "cuda":
        return True
    return capability(device) >= (8, 0)


def use_software_fp8(device: torch.device, fp8_mode: str = "auto") -> bool:
    """fp8_mode: "auto" (native where the GPU has it, unless KVCAP_FORCE_SOFTWARE_FP8=1),
    "native" or "software"."""
    if fp8_mode == "software":
        return True
    if fp8_mode == "native":
        if not has_native_fp8(device):
            raise ValueError("native E4M3 conversion needs SM89+; use fp8_mode='software'")
        return False
    if fp8_mode != "auto":
        raise ValueError(f"fp8_mode must be auto|native|software, got {fp8_mode!r}")
    return _flag(ENV_FORCE_SOFTWARE_FP8) or not has_native_fp8(device)


# decode.fp8_decoders' modes that decode one of K / V in hardware and the other in software
MIXED_FP8_MODES = ("native-k", "native-v")


def one_decoder_software_fp8(device: torch.device, fp8_mode: str = "auto") -> bool:
    """use_software_fp8 for the kernels with one E4M3 decoder for both K and V (prefill, QSA
    attention), which the attention backend hands its fp8_mode too: a mixed mode
    (MIXED_FP8_MODES, the SM89+ conversion for one of them) reads both in hardware there."""
    return use_software_fp8(device, "native" if fp8_mode in MIXED_FP8_MODES else fp8_mode)


def hardware_e4m3_encode(device: torch.device, fp8_mode: str = "auto") -> bool:
    """Whether the cache write quantizes with the hardware conversion (cvt.rn.satfinite, SM89+)
    instead of the integer encoder: wherever the cache's reader decodes in hardware
    (use_software_fp8's rule for fp8_mode; the mixed modes need the conversion), so the
    software decoder's path (fp8_mode "software", KVCAP_FORCE_SOFTWARE_FP8=1 under "auto")
    writes and reads as an SM80 GPU would; never with KVCAP_SOFTWARE_E4M3_ENCODE=1. Both give
    the same bytes (store_kv.encode_e4m3); the CPU interpreter runs the integer encoder."""
    if device.type != "cuda" or interpreting() or _flag(ENV_SOFTWARE_ENCODE):
        return False
    if fp8_mode in MIXED_FP8_MODES:
        return has_native_fp8(device)
    return not use_software_fp8(device, fp8_mode)


def grouped_enabled() -> bool:
    return not _flag(ENV_DISABLE_GROUPED)


def split_k_enabled() -> bool:
    return not _flag(ENV_DISABLE_SPLIT_K)


def words_enabled() -> bool:
    return not _flag(ENV_DISABLE_WORDS)


def mixed_decoders_enabled() -> bool:
    return _flag(ENV_MIXED)


def fp16_dots_enabled() -> bool:
    """BF16 queries over an E4M3 cache take FP16 dots in decode (decode.fp16_scale)."""
    return not _flag(ENV_DISABLE_FP16_DOTS)


@functools.cache
def _triton_has_pdl() -> bool:
    """Whether this Triton launches programmatic dependents (the `launch_pdl` launch option and
    tl.extra.cuda.gdc_wait, Triton >= 3.3 or so): older ones launch the ordinary way."""
    try:
        import dataclasses

        from triton.backends.nvidia.compiler import CUDAOptions

        fields = {f.name for f in dataclasses.fields(CUDAOptions)}
        return "launch_pdl" in fields and hasattr(tl.extra.cuda, "gdc_wait")
    except (ImportError, AttributeError, TypeError):
        return False


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol): sm_90+ CUDA, compiled kernels, a Triton
    that has it."""
    return (device.type == "cuda" and not interpreting() and capability(device) >= (9, 0)
            and _triton_has_pdl())


# Launch option of every kernel that relies on FMA contraction (Triton's FP fusion): on by
# default up to Triton 3.9, off from 3.10. kvcap's kernels were measured and tested with it on,
# so they ask for it; the layer ops and GEMM epilogues that round as torch rounds pass
# enable_fp_fusion=False themselves (fused_ops, skinny_gemm.skinny_swiglu).
FP_FUSION = {"enable_fp_fusion": True}


# Token rows up to which a step's kernels launch as programmatic dependents: on the H200 the
# 8B shape's decode steps gained 1.4-2.0% at 1 and 16 rows (every kernel of a layer is then
# kvcap's: the skinny GEMMs) and lost 0.9% at 64 rows, where the GEMMs are cuBLAS's. On the
# H100, with every linear of a 64-row step on the skinny kernels too (models.decode_gemm), the
# 64 x 1K steps gained 3.0% / 3.4% (BF16 / E4M3 KV; docs/kernels.md, "Thirty-sixth change"):
# on the H200 the same pair of switches gained 3.4% / 3.6% ("Thirty-seventh change"). GPUs
# whose name holds a key of PDL_MAX_ROWS_BY_GPU take its value.
PDL_MAX_ROWS = 16
PDL_MAX_ROWS_BY_GPU = {"H100 80GB HBM3": 64, "H200": 64}  # where it was measured


def for_gpu(table: dict, gpu_name: str, default):
    """The value of `table` (launch settings measured per GPU, keyed by part of the GPU's name,
    e.g. "H100 80GB HBM3" for the SXM H100, not the PCIe one) whose key `gpu_name` holds, else
    `default`: one matching rule for the kernels' tables (models.decode_gemm.row_limits keeps
    its own copy: it must not import triton)."""
    return next((v for k, v in table.items() if k in gpu_name), default)


def pdl_max_rows(device: torch.device | None = None) -> int:
    """PDL_MAX_ROWS (PDL_MAX_ROWS_BY_GPU's on the GPUs it names), or KVCAP_PDL_MAX_ROWS=N
    (for measurements: e.g. 64 with KVCAP_SKINNY_GEMM_MAX_ROWS=64, every kernel of a 64-row
    step kvcap's and dependent)."""
    raw = os.environ.get(ENV_PDL_MAX_ROWS, "").strip()
    if not raw:
        if device is not None and device.type == "cuda":
            return for_gpu(PDL_MAX_ROWS_BY_GPU, device_properties(device).name, PDL_MAX_ROWS)
        return PDL_MAX_ROWS
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(f"{ENV_PDL_MAX_ROWS}={raw!r} is not an integer row count (unset it "
                         f"for the default, {PDL_MAX_ROWS})") from None


def pdl_launch(device: torch.device, rows: int) -> dict:
    """Launch options of a kernel of a step of `rows` token rows: {"launch_pdl": True} where
    programmatic dependent launch is supported, rows <= pdl_max_rows(device) and KVCAP_DISABLE_PDL
    is unset, else {}. Such a kernel may start while the one before it in the stream still runs;
    it calls `pdl_wait` (with GDC = pdl_mode(...)) before it touches anything its predecessors
    write, and `pdl_release` last."""
    if not pdl_supported(device) or _flag(ENV_DISABLE_PDL) or rows > pdl_max_rows(device):
        return {}
    return {"launch_pdl": True}


def pdl_mode(launch: dict, grid: tuple[int, ...], device: torch.device) -> int:
    """GDC of a kernel of launch grid `grid` launched with `launch` (pdl_launch's): 0 an
    ordinary launch; 1 wait first, let the next kernel launch when this one's programs end;
    2 wait first and let it launch at once. 2 only for grids that fit one program per SM: the
    next kernel's programs are then placed while this one runs, and where this grid covers
    the SMs they crowd onto the few with room left (on the H200 releasing every kernel at
    once lost 3-6% at 16 x 1K, docs/kernels.md). KVCAP_PDL_RELEASE=end|start forces 1|2."""
    if not launch:
        return 0
    forced = os.environ.get(ENV_PDL_RELEASE, "").strip()
    if forced:  # (another value was ignored: a typo measured the rule, not the forced mode)
        if forced not in ("end", "start"):
            raise ValueError(f"{ENV_PDL_RELEASE}={forced!r}: use end or start, or unset it")
        return 1 if forced == "end" else 2
    return 2 if math.prod(grid) <= sm_count(device) else 1


@triton.jit
def pdl_wait(GDC: tl.constexpr):
    """First thing in a kernel launched with pdl_launch's options: wait until the kernels
    before it have finished and their writes are visible. Every program calls it, so a
    kernel's completion implies its predecessors' and ordering stays transitive along the
    stream. A no-op with GDC=0."""
    if GDC > 0:
        tl.extra.cuda.gdc_wait()
    if GDC == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_release(GDC: tl.constexpr):
    """Last thing in such a kernel: the next kernel may launch (its programs then wait in
    pdl_wait for this grid to finish)."""
    if GDC == 1:
        tl.extra.cuda.gdc_launch_dependents()


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return device_properties(device).multi_processor_count


def target_properties(sm: int):
    """Device properties of an sm_XY GPU as far as the launch heuristics read them without the
    GPU (compile-only inspection and tests): the compute capability; programs_per_sm then takes
    the shared memory per SM from _SHARED_PER_SM and default register and thread counts."""
    from types import SimpleNamespace

    return SimpleNamespace(major=sm // 10, minor=sm % 10)


# Shared memory per SM by compute capability, for torch builds whose device properties lack it.
_SHARED_PER_SM = {(7, 0): 96 << 10, (7, 5): 64 << 10, (8, 0): 164 << 10, (8, 6): 100 << 10,
                  (8, 7): 164 << 10, (8, 9): 100 << 10, (9, 0): 228 << 10}


def programs_per_sm(props, shared_bytes: int, regs_per_thread: int, num_warps: int) -> int:
    """How many programs of a kernel an SM holds at once, limited by shared memory (plus the
    1 KiB the driver reserves per block), registers and threads. `props`: CUDA device
    properties (torch.cuda.get_device_properties)."""
    cc = (props.major, props.minor)
    smem = getattr(props, "shared_memory_per_multiprocessor", 0) or _SHARED_PER_SM.get(
        cc, 100 << 10)
    regs = getattr(props, "regs_per_multiprocessor", 0) or 65536
    threads = getattr(props, "max_threads_per_multi_processor", 0) or 2048
    by_smem = smem // (shared_bytes + 1024)
    by_regs = regs // (regs_per_thread * 32 * num_warps)
    by_threads = threads // (32 * num_warps)
    return max(1, min(by_smem, by_regs, by_threads, 32))


def dot_dtype(q_dtype: torch.dtype):
    """(tl dtype of tl.dot operands, IEEE fp32 dot?) for queries of `q_dtype`. The CPU
    interpreter's tl.dot mishandles bf16 operands, so there bf16 runs as an FP32 dot."""
    if q_dtype == torch.float32 or (q_dtype == torch.bfloat16 and interpreting()):
        return tl.float32, True
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[q_dtype], False


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("K and V caches must have the same shape and dtype")
    if k_cache.shape[-1] != head_dim or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("cache head_dim must match and be contiguous")
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim {head_dim} not supported (16/32/64/128/256)")


def check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         out: torch.Tensor, k_scale, v_scale, window: int | None = None
                         ) -> tuple[int, int, int, bool]:
    """The checks every paged attention launcher makes: (query heads, KV heads, head_dim,
    E4M3 cache?) of q [T, Hq, D] over caches [blocks, Hkv, block_size, D], with a sliding
    `window` of at least one token where there is one."""
    if window is not None and window < 1:
        raise ValueError(f"window={window}: a sliding window holds at least one token")
    _, hq, d = q.shape
    hkv = k_cache.shape[1]
    check_cache(k_cache, v_cache, d)
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q/out head_dim must be contiguous")
    fp8 = k_cache.dtype == torch.uint8
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an E4M3 cache needs k_scale and v_scale")
    return hq, hkv, d, fp8


@triton.jit
def paged_row_offsets(bt_ptr, bt_stride, seq, pos, mask, BLOCK_SIZE: tl.constexpr,
                      stride_b, stride_t, head_off):
    """Element offset (int64) of the first element of token `pos` [N] of one KV head."""
    blk = tl.load(bt_ptr + seq.to(tl.int64) * bt_stride + pos // BLOCK_SIZE, mask=mask, other=0)
    return blk.to(tl.int64) * stride_b + (pos % BLOCK_SIZE).to(tl.int64) * stride_t + head_off


@triton.jit
def paged_byte_offsets(bt_ptr, bt_stride, seq, pos, mask, BLOCK_SIZE: tl.constexpr,
                       stride_b, stride_t, head_off):
    """paged_row_offsets in paged_word_offsets' unsigned form, for the E4M3 byte routes
    (offsets in bytes): a shift and a mask for the block size, one widening multiply for the
    block's base. Not used by the 16-bit kernel, which held more registers with it."""
    upos = pos.to(tl.uint32)
    blk = tl.load(bt_ptr + seq.to(tl.int64) * bt_stride + upos // BLOCK_SIZE, mask=mask, other=0)
    base = blk.to(tl.uint32).to(tl.int64) * stride_b.to(tl.uint32).to(tl.int64)
    return base + ((upos % BLOCK_SIZE) * stride_t).to(tl.int64) + head_off


@triton.jit
def load_raw(cache_ptr, row_off, mask, HEAD_DIM: tl.constexpr):
    """Raw cache tile [N, HEAD_DIM] (E4M3: bytes), masked rows = 0."""
    d = tl.arange(0, HEAD_DIM)
    return tl.load(cache_ptr + row_off[:, None] + d[None, :], mask=mask[:, None], other=0)


# Compiled kernels convert E4M3 with inline PTX (below); the CPU interpreter cannot run it, so
# there the same conversions are written with Triton ops. Read at import, like triton.jit's
# own choice between compiling and interpreting: set TRITON_INTERPRET before importing kvcap.
_CVT_ASM = tl.constexpr(not interpreting())
# native: bytes 0,1 -> $0 (f16x2), bytes 2,3 -> $1
_NATIVE_PTX = tl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                           "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the 128-byte lines at `ptrs` where `mask` holds (`prefetch.global.L2`, no
    registers filled, nothing waited for). A hint: L2 is the GPU's point of coherence, so a
    line another kernel is still writing is never read stale through it. The CPU interpreter
    cannot run PTX: there it does nothing."""
    if _CVT_ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


# The packed software decoder, one FP16 pair per 32-bit register in three instructions: a byte
# permute `prmt` puts the two E4M3 bytes at bits 0-7 and 16-23 and, in the byte above each,
# that byte's sign replicated (prmt's sign mode: selector nibble | 8); a shift left by 7 then
# moves each `eeeemmm` to FP16 exponent/mantissa bits 7-13 (+16) and brings a sign copy to
# bit 15 (+16); one AND keeps those bits (0xBF80 per half). The FP16 half is the E4M3 value
# times 2^-8 exactly, subnormals included (before 2026-12-02: shifts, two masks and an OR per
# pair, 16 integer instructions per two words where this takes 12; same bits).
_SOFTWARE_MASK = "0xBF80BF80"


def _packed_pair_ptx(dst: str, a: str, b: str, sel: int) -> str:
    """dst (f16x2, value * 2^-8) <- E4M3 bytes picked from a (bytes 0-3) / b (4-7) by the
    prmt selector `sel`: nibbles (low half's byte, its sign | 8, high half's byte, its sign | 8)."""
    return (f"prmt.b32 t, {a}, {b}, {sel:#06x}; shl.b32 t, t, 7; "
            f"and.b32 {dst}, t, {_SOFTWARE_MASK}; ")


def _sign_selector(lo: int, hi: int) -> int:
    """prmt selector for _packed_pair_ptx: byte `lo` to the low half, byte `hi` to the high."""
    return lo | (lo | 8) << 4 | hi << 8 | (hi | 8) << 12


def _packed_word_ptx(src: str) -> str:
    """The four bytes of `src` in element order: bytes 0,1 -> f16x2 u, bytes 2,3 -> v (declared
    with t by the caller). Results go to temporaries, moved out last by the caller: an inline
    asm output may share the input's register."""
    return (_packed_pair_ptx("u", src, src, _sign_selector(0, 1))
            + _packed_pair_ptx("v", src, src, _sign_selector(2, 3)))


# software, element order: bytes 0,1 -> $0, bytes 2,3 -> $1
_SOFTWARE_PTX = tl.constexpr("{ .reg .b32 t, u, v; " + _packed_word_ptx("$2")
                             + "mov.b32 $0, u; mov.b32 $1, v; }")


@triton.jit
def _e4m3_ptx(x, SOFTWARE: tl.constexpr, OPAQUE: tl.constexpr):
    """uint8 tensor -> float16, four bytes per 32-bit register, through inline PTX.

    Triton moves a pure conversion past the shared-memory load that feeds tl.dot, so the
    8-bit tile is read straight into the MMA operand layout. That is right for K (QK^T reads
    K along the head dimension, contiguous bytes) but for V the reduction axis is the token,
    and the 8-bit operand layout then costs one `ld.shared.b8` per byte. OPAQUE (marking the
    assembly impure) keeps the conversion where it is written: V is read from shared memory
    in 16-byte vectors, converted, and moved into the operand layout as FP16
    (`ldmatrix.trans`). See docs/kernels.md, "Third change"."""
    if SOFTWARE:
        r = tl.inline_asm_elementwise(_SOFTWARE_PTX, "=r,=r,r", [x], dtype=tl.float16,
                                      is_pure=not OPAQUE, pack=4)
    else:
        r = tl.inline_asm_elementwise(_NATIVE_PTX, "=r,=r,r", [x], dtype=tl.float16,
                                      is_pure=not OPAQUE, pack=4)
    return r


@triton.jit
def _e4m3_software_ops(x):
    """The packed decoder's result (value * 2^-8 as FP16 bits) with Triton ops, per byte."""
    w = x.to(tl.int32)
    h = ((w & 0x80) << 8) | ((w & 0x7F) << 7)
    return h.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def convert_tile(x, FP8: tl.constexpr, SOFTWARE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                 OPAQUE: tl.constexpr = False):
    """Raw [N, D] tile -> OUT_DTYPE. E4M3 bytes: native -> the value, software -> the value
    times 2^-8 (both exact: every such number is an FP16 and a BF16 number). OPAQUE: see
    _e4m3_ptx (pass it for tiles used as the PV operand)."""
    if FP8:
        if _CVT_ASM:
            x = _e4m3_ptx(x, SOFTWARE, OPAQUE)
        elif SOFTWARE:
            x = _e4m3_software_ops(x)
        else:
            x = x.to(tl.float8e4nv, bitcast=True)
    return x.to(OUT_DTYPE)


# Word-tile variants (decode at D >= 128): one 32-bit register of four bytes -> four FP16
# values, one per column group (column 4c + j -> group j), as four separate results. Pure, so
# Triton reads the words straight into the MMA operand layout: a 32-bit shared load gives an
# element of each of the four groups' operands, and nothing takes a second shared-memory trip.
_NATIVE_WORD_PTX = tl.constexpr(
    "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; "
    "cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; "
    "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }")
_SOFTWARE_WORD_PTX = tl.constexpr("{ .reg .b32 t, u, v; " + _packed_word_ptx("$4")
                                  + "mov.b32 {$0, $1}, u; mov.b32 {$2, $3}, v; }")
# Two words (two elements of the same thread, pack=2) -> each group's pair as one f16x2
# register, which is how the MMA operand holds them: the bytes are permuted before the
# conversion (two prmt per word pair) instead of the halves after it.
_NATIVE_PAIR_PTX = tl.constexpr(
    "{ .reg .b32 x, y; .reg .b16 xl, xh, yl, yh; "
    "prmt.b32 x, $4, $5, 0x5140; prmt.b32 y, $4, $5, 0x7362; "
    "mov.b32 {xl, xh}, x; mov.b32 {yl, yh}, y; "
    "cvt.rn.f16x2.e4m3x2 $0, xl; cvt.rn.f16x2.e4m3x2 $1, xh; "
    "cvt.rn.f16x2.e4m3x2 $2, yl; cvt.rn.f16x2.e4m3x2 $3, yh; }")
_SOFTWARE_PAIR_PTX = tl.constexpr(
    "{ .reg .b32 t, g0, g1, g2, g3; "
    + "".join(_packed_pair_ptx(f"g{j}", "$4", "$5", _sign_selector(j, 4 + j)) for j in range(4))
    + "mov.b32 $0, g0; mov.b32 $1, g1; mov.b32 $2, g2; mov.b32 $3, g3; }")


@triton.jit
def paged_word_offsets(bt_ptr, bt_stride, seq, pos, mask, BLOCK_SIZE: tl.constexpr,
                       stride_b, stride_t, head_off):
    """paged_row_offsets in 32-bit words (E4M3 cache, head_dim a multiple of 4), in the form
    that compiles shortest: positions, block numbers and strides are never negative, so as
    unsigned values a division by the block size needs no sign fix-ups (a shift and a mask for
    a power of two), the block's base is one widening multiply and the offset within a block
    stays 32-bit. Triton 3.6 (the H200's) compiled paged_row_offsets' signed form to 109 more
    instructions per tile of the word route (858 -> 749; docs/kernels.md, "Twenty-eighth
    change"). Kept apart from paged_row_offsets: the 16-bit kernel held more registers with it."""
    upos = pos.to(tl.uint32)
    blk = tl.load(bt_ptr + seq.to(tl.int64) * bt_stride + upos // BLOCK_SIZE, mask=mask, other=0)
    base = blk.to(tl.uint32).to(tl.int64) * (stride_b >> 2).to(tl.uint32).to(tl.int64)
    return base + ((upos % BLOCK_SIZE) * (stride_t >> 2)).to(tl.int64) + (head_off >> 2)


@triton.jit
def load_words(cache_ptr, word_off, mask, HEAD_DIM: tl.constexpr):
    """Raw E4M3 cache tile as int32 words [N, HEAD_DIM // 4] (four bytes each) of the rows at
    `word_off` (paged_word_offsets), masked rows 0."""
    c = tl.arange(0, HEAD_DIM // 4)
    wptr = cache_ptr.to(tl.pointer_type(tl.int32))
    return tl.load(wptr + word_off[:, None] + c[None, :], mask=mask[:, None], other=0)


@triton.jit
def convert_words(w, SOFTWARE: tl.constexpr, OUT_DTYPE: tl.constexpr, PAIRS: tl.constexpr = False):
    """int32 words [N, C] -> four column groups (t0..t3), tj[:, c] = decode(byte j of word c)
    (software: times 2^-8, as convert_tile)."""
    if _CVT_ASM and PAIRS:
        t0, t1, t2, t3 = tl.inline_asm_elementwise(
            _SOFTWARE_PAIR_PTX if SOFTWARE else _NATIVE_PAIR_PTX, "=r,=r,=r,=r,r,r", [w],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    elif _CVT_ASM:
        if SOFTWARE:
            t0, t1, t2, t3 = tl.inline_asm_elementwise(
                _SOFTWARE_WORD_PTX, "=h,=h,=h,=h,r", [w],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
        else:
            t0, t1, t2, t3 = tl.inline_asm_elementwise(
                _NATIVE_WORD_PTX, "=h,=h,=h,=h,r", [w],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        t0 = convert_tile((w & 0xFF).to(tl.uint8), True, SOFTWARE, tl.float16)
        t1 = convert_tile(((w >> 8) & 0xFF).to(tl.uint8), True, SOFTWARE, tl.float16)
        t2 = convert_tile(((w >> 16) & 0xFF).to(tl.uint8), True, SOFTWARE, tl.float16)
        t3 = convert_tile(((w >> 24) & 0xFF).to(tl.uint8), True, SOFTWARE, tl.float16)
    return t0.to(OUT_DTYPE), t1.to(OUT_DTYPE), t2.to(OUT_DTYPE), t3.to(OUT_DTYPE)


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One tile of the base-2 online softmax: masked scores s [M, N] (-inf = not visible),
    running max m_i and sum l_i [M]. Returns (m_new, alpha, p, l_new): alpha rescales what was
    accumulated so far, p are the tile's unnormalised probabilities."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def mm(a, b, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    """a [M, K] @ b [K, N] -> FP32 [M, N]: tensor-core dot, or broadcast-sum (M tiny)."""
    if USE_DOT:
        if IEEE:
            r = tl.dot(a, b, input_precision="ieee")
        else:
            r = tl.dot(a, b)
    else:
        r = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return r


@triton.jit
def load_cg(ptr, mask, other, CG: tl.constexpr):
    """Masked load; with CG it bypasses L1 (".cg"): for data that other programs of the same
    launch stored, which a stale L1 line could otherwise serve."""
    if CG:
        return tl.load(ptr, mask=mask, other=other, cache_modifier=".cg")
    else:
        return tl.load(ptr, mask=mask, other=other)


MERGE_CHUNK = tl.constexpr(8)  # splits merged per step: bounds the merge's registers


@triton.jit
def merge_splits(po_ptr, plse_ptr, vs_ptr, out_factor, row_base, head, stride_ph, stride_ps,
                 num_splits, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, FP8: tl.constexpr,
                 CG: tl.constexpr = False):
    """LSE merge of one (row, head)'s split-K partials: normalised partial outputs po
    [..., split, HEAD_DIM] and base-2 LSEs plse at row_base + head * stride_ph + split *
    stride_ps (empty splits hold -inf). Returns the FP32 [HEAD_DIM] output times out_factor
    (and the hoisted v_scale for E4M3). BLOCK_S: a power of two >= max(num_splits, 8); the
    partial outputs are read 8 splits at a time (a [64, D] tile would take 64 registers per
    thread in the decode kernel that folds this merge in). CG: load around L1."""
    base = row_base + head * stride_ph
    s = tl.arange(0, BLOCK_S)
    lse = load_cg(plse_ptr + base + s * stride_ps, s < num_splits, float("-inf"), CG)
    mx = tl.max(lse, 0)
    total = tl.sum(tl.where(lse > float("-inf"), tl.exp2(lse - mx), 0.0), 0)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for c in tl.static_range(0, BLOCK_S, MERGE_CHUNK):
        sc = c + tl.arange(0, MERGE_CHUNK)
        smask = sc < num_splits
        pbase = base + sc * stride_ps
        lc = load_cg(plse_ptr + pbase, smask, float("-inf"), CG)
        w = tl.where(lc > float("-inf"), tl.exp2(lc - mx), 0.0)
        o = load_cg(po_ptr + pbase[:, None] * HEAD_DIM + d[None, :], smask[:, None], 0.0, CG)
        acc += tl.sum(o * w[:, None], 0)
    scale = out_factor
    if FP8:
        scale = scale * tl.load(vs_ptr)
    return acc * (scale / total)

