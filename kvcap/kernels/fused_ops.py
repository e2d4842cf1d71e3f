"""Fused elementwise kernels of the decoder layer: residual add + RMSNorm, RoPE + q/k/v split,
SiLU-mul. One launch each instead of the 5-10 small torch kernels they replace (about 37
kernels per layer become about 12): at decode batch sizes those launches, not bytes, set much
of the step time. On the H200 they took the Llama-3.1-8B decode forward at concurrency 16 from
7.8 to 5.4 ms (docs/benchmarks/step-overhead-2026-11-29-h200-*.json).

Numerics repeat the torch twin's roundings (kvcap.models.llama, which follows HF transformers):
the residual sum and each RoPE product are rounded to the activation dtype exactly where torch
rounds them; RMSNorm accumulates in FP32 (its reduction order differs from torch's, so results
agree to FP32 rounding, not bit for bit); SiLU uses FP32 like torch's. The RoPE kernel can also
write K/V into the paged cache (the E4M3 encoder is kvcap.kernels.store_kv's). The models call
these only on CUDA (kvcap.models.llama.fused_ops_for; the environment
variable KVCAP_DISABLE_FUSED_OPS=1 switches back to torch ops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kvcap.kernels.common import hardware_e4m3_encode, pdl_launch, pdl_mode, pdl_release, pdl_wait
from kvcap.kernels.store_kv import check_cache_layout, encode_e4m3

if TYPE_CHECKING:
    from kvcap.kv_cache.pool import LayerKVCache


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, eps,
                         stride_x, stride_r, stride_o, stride_ro,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                         GDC: tl.constexpr = 0):
    pdl_wait(GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the dtype add torch does
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=m)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    y = (h * inv).to(x.dtype)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype),
             mask=m)
    pdl_release(GDC)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, res_out: torch.Tensor | None = None):
    """RMSNorm of x (or of x + residual, whose dtype-rounded sum is returned as the new
    residual): returns normed, or (normed, new_residual). x, residual [T, H], last dim
    contiguous. `res_out` [T, H] receives the new residual (it may be `residual` itself: each
    row is read before it is written); piecewise CUDA graphs pass their static buffer."""
    t, n = x.shape
    out = torch.empty_like(x)
    if residual is None:
        res_out = out
    elif res_out is None:
        res_out = torch.empty_like(x)
    elif res_out.shape != x.shape or res_out.dtype != x.dtype or res_out.stride(1) != 1:
        raise ValueError(f"res_out must be a {tuple(x.shape)} {x.dtype} tensor with contiguous "
                         f"rows, got {tuple(res_out.shape)} {res_out.dtype}")
    if t:
        r = residual if residual is not None else x
        block = triton.next_power_of_2(n)
        pdl = pdl_launch(x.device, t)
        grid = (t,)
        _add_rms_norm_kernel[grid](
            x, r, weight, out, res_out, n, eps, x.stride(0), r.stride(0), out.stride(0),
            res_out.stride(0), HAS_RES=residual is not None, BLOCK=block,
            GDC=pdl_mode(pdl, grid, x.device),
            num_warps=max(1, min(16, block // 256)) if x.is_cuda else 1, enable_fp_fusion=False,
            **pdl)
    return out if residual is None else (out, res_out)


@triton.jit
def _rope_split_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, stride_t, stride_cos,
                       kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
                       stride_cb, stride_ch, stride_ct,
                       HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                       STORE: tl.constexpr, FP8: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       HW_ENCODE: tl.constexpr = False, GDC: tl.constexpr = 0):
    pdl_wait(GDC)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    src = qkv_ptr + t * stride_t + h * D
    x = tl.load(src + d)
    if h < HQ + HKV:  # q or k head: x * cos + rotate_half(x) * sin, rounded like torch
        partner = tl.load(src + (d + D // 2) % D)
        rot = tl.where(d < D // 2, -partner.to(tl.float32), partner.to(tl.float32))
        c = tl.load(cos_ptr + t * stride_cos + d).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_cos + d).to(tl.float32)
        a = (x.to(tl.float32) * c).to(x.dtype)
        b = (rot * s).to(x.dtype)
        y = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
        if h < HQ:
            tl.store(q_ptr + (t * HQ + h) * D + d, y)
        else:
            tl.store(k_ptr + (t * HKV + h - HQ) * D + d, y)
            if STORE:
                _store_row(y, kc_ptr, ks_ptr, slot_ptr, t, h - HQ, d, stride_cb, stride_ch,
                           stride_ct, FP8, BLOCK_SIZE, HW_ENCODE)
    else:
        tl.store(v_ptr + (t * HKV + h - HQ - HKV) * D + d, x)
        if STORE:
            _store_row(x, vc_ptr, vs_ptr, slot_ptr, t, h - HQ - HKV, d, stride_cb, stride_ch,
                       stride_ct, FP8, BLOCK_SIZE, HW_ENCODE)
    pdl_release(GDC)


@triton.jit
def _store_row(x, cache_ptr, scale_ptr, slot_ptr, t, kv_head, d, stride_cb, stride_ch,
               stride_ct, FP8: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               HW_ENCODE: tl.constexpr):
    """One KV head's row of token t into the paged cache at its slot (-1: padding, skipped):
    the same bytes as kvcap.kernels.store_kv (E4M3: encode(x / scale))."""
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        dst = (cache_ptr + (slot // BLOCK_SIZE) * stride_cb + kv_head * stride_ch
               + (slot % BLOCK_SIZE) * stride_ct + d)
        if FP8:
            tl.store(dst, encode_e4m3(x.to(tl.float32), tl.load(scale_ptr), HW_ENCODE))
        else:
            tl.store(dst, x.to(cache_ptr.dtype.element_ty))


def rope_split_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int, cache: LayerKVCache | None = None,
                   slot_mapping: torch.Tensor | None = None, fp8_mode: str = "auto",
                   out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """qkv [T, (Hq + 2 Hkv) * D] (rows contiguous), cos/sin [T, 1, D] ->
    contiguous q [T, Hq, D], k [T, Hkv, D] rotated and v [T, Hkv, D] (written into `out`'s
    three contiguous tensors when given: piecewise CUDA graphs pass their static buffers).

    With `cache` and `slot_mapping` [T] (int64 block * block_size + offset, -1 = skip) the
    same launch also writes k and v into the layer's paged cache (E4M3: quantized with its
    scales), byte for byte what kvcap.kernels.store_kv writes: a decode step then spends one
    launch per layer less, and the E4M3 encode runs spread over the K/V heads' programs.
    `fp8_mode` is the cache reader's (store_kv.store_kv)."""
    t = qkv.shape[0]
    shapes = ((t, num_heads, head_dim), (t, num_kv_heads, head_dim),
              (t, num_kv_heads, head_dim))
    if out is None:
        q, k, v = (qkv.new_empty(s) for s in shapes)
    else:
        for buf, s in zip(out, shapes, strict=True):
            if buf.shape != s or buf.dtype != qkv.dtype or not buf.is_contiguous():
                raise ValueError(f"rope_split_qkv out: want contiguous {s} {qkv.dtype}, "
                                 f"got {tuple(buf.shape)} {buf.dtype}")
        q, k, v = out
    if t:
        if qkv.stride(1) != 1 or cos.stride(2) != 1 or cos.stride() != sin.stride():
            raise ValueError("rope_split_qkv needs contiguous rows and matching cos/sin")
        store = cache is not None
        fp8 = store and cache.is_fp8
        if store:
            kc, vc = cache.k_cache, cache.v_cache
            check_cache_layout(kc, vc, num_kv_heads, head_dim)
            if slot_mapping is None or slot_mapping.shape != (t,):
                raise ValueError("writing the cache needs a slot_mapping with one slot per row")
            if fp8 and (cache.k_scale is None or cache.v_scale is None):
                raise ValueError("an E4M3 cache needs k_scale and v_scale")
            ks, vs = (cache.k_scale, cache.v_scale) if fp8 else (kc, vc)
            strides, block_size = kc.stride()[:3], kc.shape[2]
        else:  # unused placeholders (STORE=False)
            kc = vc = slot_mapping = ks = vs = qkv
            strides, block_size = (0, 0, 0), 1
        pdl = pdl_launch(qkv.device, t)
        grid = (t, num_heads + 2 * num_kv_heads)
        _rope_split_kernel[grid](
            qkv, cos, sin, q, k, v, qkv.stride(0), cos.stride(0),
            kc, vc, slot_mapping, ks, vs, *strides,
            HQ=num_heads, HKV=num_kv_heads, D=head_dim, STORE=store, FP8=fp8,
            BLOCK_SIZE=block_size, HW_ENCODE=fp8 and hardware_e4m3_encode(qkv.device, fp8_mode),
            GDC=pdl_mode(pdl, grid, qkv.device),
            num_warps=1 if head_dim <= 128 else 2,
            enable_fp_fusion=False, **pdl)  # no FMA: each product rounds as torch rounds it
    return q, k, v


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n + cols, mask=m, other=0.0)
    g32 = g.to(tl.float32)
    s = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype)  # F.silu rounds to the dtype first
    tl.store(out_ptr + row * stride_o + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype),
             mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] (gate | up) -> silu(gate) * up [T, I]."""
    t, two_i = gate_up.shape
    n = two_i // 2
    out = gate_up.new_empty(t, n)
    if t:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](
            gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block,
            num_warps=4 if gate_up.is_cuda else 1, enable_fp_fusion=False)
    return out
