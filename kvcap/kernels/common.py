"""Shared pieces of the attention kernels: E4M3 tile decoders, paged addressing, routing
switches and launch heuristics. Imports nothing else of kvcap (kernels take tensors and ints).

E4M3 decode on read, two exact routes:
  * native: uint8 -> bitcast float8e4nv -> .to(fp16/bf16), the hardware conversion (SM89+);
  * software ("packed"): four bytes per 32-bit word; two integer ops per pair of bytes move
    each byte's `eeeemmm` into FP16 exponent/mantissa positions (sign already in place), which
    is the E4M3 value times 2^-8 exactly (subnormals included). The 2^8 is folded into the
    hoisted scales, so the decoder costs no float multiply at all. A word yields bytes 0..3 as
    four column groups (column 4c + j), so the kernels split the head dimension the same way.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Environment rollback switches (read at every launch so tests can flip them).
ENV_FORCE_SOFTWARE_FP8 = "KVCAP_FORCE_SOFTWARE_FP8"
ENV_DISABLE_GROUPED = "KVCAP_DISABLE_GROUPED_DECODE"
ENV_DISABLE_SPLIT_K = "KVCAP_DISABLE_SPLIT_K"

SOFTWARE_FP8_FACTOR = 256.0  # the packed decoder yields value * 2^-8
LOG2E = 1.4426950408889634

_SIGN_PAIR = tl.constexpr(-2147450880)  # 0x80008000 as a signed int32
_MAG_PAIR = tl.constexpr(0x3F803F80)  # 0x7F007F00 >> 1


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def has_native_fp8(device: torch.device) -> bool:
    """SM89+ converts E4M3 in hardware; the CPU interpreter emulates the conversion."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


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


def grouped_enabled() -> bool:
    return not _flag(ENV_DISABLE_GROUPED)


def split_k_enabled() -> bool:
    return not _flag(ENV_DISABLE_SPLIT_K)


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


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


@triton.jit
def paged_row_offsets(bt_ptr, bt_stride, seq, pos, mask, BLOCK_SIZE: tl.constexpr,
                      stride_b, stride_t, head_off):
    """Element offset (int64) of the first element of token `pos` [N] of one KV head."""
    blk = tl.load(bt_ptr + seq.to(tl.int64) * bt_stride + pos // BLOCK_SIZE, mask=mask, other=0)
    return blk.to(tl.int64) * stride_b + (pos % BLOCK_SIZE).to(tl.int64) * stride_t + head_off


@triton.jit
def load_raw(cache_ptr, row_off, mask, HEAD_DIM: tl.constexpr, SOFTWARE: tl.constexpr):
    """Raw cache tile, masked rows = 0: [N, HEAD_DIM] elements, or for the software E4M3
    route [N, HEAD_DIM // 4] int32 words (four bytes each)."""
    if SOFTWARE:
        c = tl.arange(0, HEAD_DIM // 4)
        wptr = cache_ptr.to(tl.pointer_type(tl.int32))
        x = tl.load(wptr + (row_off // 4)[:, None] + c[None, :], mask=mask[:, None], other=0)
    else:
        d = tl.arange(0, HEAD_DIM)
        x = tl.load(cache_ptr + row_off[:, None] + d[None, :], mask=mask[:, None], other=0)
    return x


# Compiled kernels convert E4M3 with explicit PTX (below); the CPU interpreter cannot run
# inline assembly, so there the conversion goes through Triton's float8 type instead.
_CVT_ASM = tl.constexpr(not interpreting())
_CVT_PTX = tl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                        "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")


@triton.jit
def _e4m3_to_f16(x, OPAQUE: tl.constexpr):
    """uint8 tensor -> float16 through `cvt.rn.f16x2.e4m3x2`, four bytes per 32-bit register.

    Triton moves a pure conversion past the shared-memory load that feeds tl.dot, so the
    8-bit tile is read straight into the MMA operand layout. That is right for K (QK^T reads
    K along the head dimension, contiguous bytes) but for V the reduction axis is the token,
    and the 8-bit operand layout then costs one `ld.shared.b8` per byte. OPAQUE (marking the
    assembly impure) keeps the conversion where it is written: V is read from shared memory
    in 16-byte vectors, converted, and moved into the operand layout as FP16
    (`ldmatrix.trans`)."""
    return tl.inline_asm_elementwise(_CVT_PTX, "=r,=r,r", [x], dtype=tl.float16,
                                     is_pure=not OPAQUE, pack=4)


@triton.jit
def convert_tile(x, FP8: tl.constexpr, OUT_DTYPE: tl.constexpr, OPAQUE: tl.constexpr = False):
    """Raw [N, D] tile -> OUT_DTYPE; E4M3 bytes through the hardware conversion (exact: every
    E4M3 value is an FP16 and a BF16 number). OPAQUE: see _e4m3_to_f16 (pass it for tiles
    used as the PV operand)."""
    if FP8:
        if _CVT_ASM:
            x = _e4m3_to_f16(x, OPAQUE)
        else:
            x = x.to(tl.float8e4nv, bitcast=True)
    return x.to(OUT_DTYPE)


@triton.jit
def _half_to(h, OUT_DTYPE: tl.constexpr):
    x = h.to(tl.int16).to(tl.float16, bitcast=True)
    return x.to(OUT_DTYPE)


@triton.jit
def decode_words(w, OUT_DTYPE: tl.constexpr):
    """Packed software E4M3 decode of int32 words [N, C] (four bytes each) into four column
    groups (t0, t1, t2, t3), tj[:, c] = value(byte j of word c) * 2^-8."""
    odd = (w & _SIGN_PAIR) | ((w >> 1) & _MAG_PAIR)  # bytes 1 (low half) and 3 (high half)
    even = ((w << 8) & _SIGN_PAIR) | ((w << 7) & _MAG_PAIR)  # bytes 0 and 2
    t0 = _half_to(even, OUT_DTYPE)
    t1 = _half_to(odd, OUT_DTYPE)
    t2 = _half_to(even >> 16, OUT_DTYPE)
    t3 = _half_to(odd >> 16, OUT_DTYPE)
    return t0, t1, t2, t3


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
def merge_splits(po_ptr, plse_ptr, vs_ptr, out_factor, row_base, head, stride_ph, stride_ps,
                 num_splits, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """LSE merge of one (row, head)'s split-K partials: normalised partial outputs po
    [..., split, HEAD_DIM] and base-2 LSEs plse at row_base + head * stride_ph + split *
    stride_ps (empty splits hold -inf). Returns the FP32 [HEAD_DIM] output times out_factor
    (and the hoisted v_scale for E4M3)."""
    s = tl.arange(0, BLOCK_S)
    smask = s < num_splits
    pbase = row_base + head * stride_ph + s * stride_ps
    lse = tl.load(plse_ptr + pbase, mask=smask, other=float("-inf"))
    mx = tl.max(lse, 0)
    w = tl.where(smask & (lse > float("-inf")), tl.exp2(lse - mx), 0.0)
    d = tl.arange(0, HEAD_DIM)
    o = tl.load(po_ptr + pbase[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
    scale = out_factor
    if FP8:
        scale = scale * tl.load(vs_ptr)
    return tl.sum(o * w[:, None], 0) * (scale / tl.sum(w, 0))

