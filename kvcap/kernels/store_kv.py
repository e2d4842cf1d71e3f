"""store_kv: write new K/V rows into the paged cache by slot, quantizing to E4M3 on write.

The E4M3 encoder divides x by the scale (IEEE division), then rounds to nearest even and
saturates to +-448 (NaN -> 0x7F with its sign): byte-identical to `kvcap.numerics.e4m3.encode`.
Two forms give those bytes: integer arithmetic on the FP32 bits, the same algorithm as the
torch codec, exact on every GPU; and, on SM89+, the hardware conversion (`cvt.rn.satfinite`),
a few instructions instead of a serial integer chain (common.hardware_e4m3_encode chooses;
the engine's startup check compares the hardware bytes with the codec's, decoder_check).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcap.kernels.common import FP_FUSION, hardware_e4m3_encode, sm_count

# The hardware conversion of one FP32 value (converted twice into the pair's two bytes; the
# low byte is kept): round to nearest even, finite values and infinities beyond 448 -> +-448,
# NaN -> 0x7F. encode_e4m3 ORs the input's sign back, as the integer encoder writes NaN.
_HARDWARE_ENCODE_PTX = tl.constexpr("{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $1; "
                                    "cvt.u32.u16 $0, t; }")


@triton.jit
def encode_e4m3(x, scale, HARDWARE: tl.constexpr = False):
    """FP32 tensor -> E4M3FN bytes (uint8) of x / scale; HARDWARE: the SM89+ conversion
    (same bytes)."""
    y = tl.math.div_rn(x, scale)
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    if HARDWARE:
        code = tl.inline_asm_elementwise(_HARDWARE_ENCODE_PTX, "=r,r", [bits], dtype=tl.int32,
                                         is_pure=True, pack=1) & 0x7F
        return (code | sign).to(tl.uint8)
    abits = bits & 0x7FFFFFFF
    a = abits.to(tl.float32, bitcast=True)
    # normal range: round the 23-bit mantissa to 3 bits (RNE) and rebias 127 -> 7
    safe = tl.minimum(abits, 0x7F800000)  # keeps NaN bit patterns from overflowing
    normal = ((safe + 0x7FFFF + ((safe >> 20) & 1)) >> 20) - 960
    # subnormal range: adding 2^14 leaves a grid of 2^-9 steps, so the FP32 add rounds to
    # the nearest multiple of 2^-9 (ties to even); its low bits are the E4M3 code
    sub = (a + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    code = tl.where(a < 0.015625, sub, normal)
    code = tl.minimum(code, 0x7E)
    code = tl.where(y != y, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ch, stride_ct,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, FP8: tl.constexpr, HW_ENCODE: tl.constexpr = False,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    hmask = (h < NUM_KV_HEADS)[:, None]
    t64 = t.to(tl.int64)
    src_k = k_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :]
    src_v = v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :]
    dst = blk.to(tl.int64) * stride_cb + off * stride_ct + h[:, None] * stride_ch + d[None, :]
    k = tl.load(src_k, mask=hmask)
    v = tl.load(src_v, mask=hmask)
    if FP8:
        kq = encode_e4m3(k.to(tl.float32), tl.load(ks_ptr), HW_ENCODE)
        vq = encode_e4m3(v.to(tl.float32), tl.load(vs_ptr), HW_ENCODE)
        tl.store(kc_ptr + dst, kq, mask=hmask)
        tl.store(vc_ptr + dst, vq, mask=hmask)
    else:
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=hmask)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=hmask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, fp8_mode: str = "auto") -> None:
    """Write k/v [T, Hkv, D] to caches [num_blocks, Hkv, block_size, D] at slot_mapping [T]
    (int64 block * block_size + offset; -1 = skip). uint8 caches are E4M3: bytes =
    encode(x / scale) with k_scale/v_scale 0-dim FP32 tensors on the cache's device;
    `fp8_mode` is the reader's (common.hardware_e4m3_encode picks the encoder form)."""
    t, hkv, d = k.shape
    if t == 0:
        return
    if v.shape != k.shape:
        raise ValueError(f"shape mismatch: k {tuple(k.shape)} v {tuple(v.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("head_dim must be contiguous")
    check_cache_layout(k_cache, v_cache, hkv, d)
    if slot_mapping.shape[0] != t:
        raise ValueError("slot_mapping must have one entry per row")
    fp8 = k_cache.dtype == torch.uint8
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an E4M3 cache needs k_scale and v_scale")
    block_h = store_heads_per_program(t, hkv, k.device)
    _store_kv_kernel[(t, triton.cdiv(hkv, block_h))](
        k, v, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[2],
        BLOCK_H=block_h, FP8=fp8, HW_ENCODE=fp8 and hardware_e4m3_encode(k.device, fp8_mode),
        **FP_FUSION,
    )


def check_cache_layout(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int,
                       head_dim: int) -> None:
    """Raise ValueError unless the caches are [blocks, num_kv_heads, block_size, head_dim]
    with head_dim contiguous and K and V sharing layout and dtype."""
    if k_cache.dim() != 4 or k_cache.shape[1] != num_kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(f"shape mismatch: {num_kv_heads} KV heads x head_dim {head_dim} "
                         f"against cache {tuple(k_cache.shape)}")
    if k_cache.stride(3) != 1:
        raise ValueError("the cache's head_dim must be contiguous")
    if k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
        raise ValueError("K and V caches must share layout and dtype")


def store_heads_per_program(num_tokens: int, num_kv_heads: int, device: torch.device) -> int:
    """KV heads one program writes. A decode step writes a few tokens, and one program per
    token is then a serial chain per thread (the E4M3 encoder's IEEE division is a dozens-of-
    instructions sequence per element: 8 heads x 128 x 2 values over 128 threads took 2.6 us
    per call against the 16-bit copy's 1.4 on the H200, 32 layers: 37 us of a 1 x 1K step,
    docs/benchmarks/step-profile-2026-12-02-h200-1k-bf16.json), so with fewer tokens than
    SMs each head gets its own program; a prefill's many tokens keep one program per token.
    (The CPU interpreter counts 4 SMs, so tests take both layouts.)"""
    if num_tokens < sm_count(device):
        return 1
    return triton.next_power_of_2(num_kv_heads)
