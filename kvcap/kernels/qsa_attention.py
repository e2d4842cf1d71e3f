"""Sparse paged attention over each query row's selected tokens (QSA), split-K + LSE merge.

One program per (query row, KV head, split). The row's selection (int32 token positions,
ascending, the first `count[t]` valid, then -1) is cut into contiguous ranges, one per
split; each tile of BLOCK_N selected tokens is gathered through the block table (groups of
R consecutive tokens, so rows come in short contiguous runs) and attended by all GROUP query
heads of the KV head at once (the rows of a tl.dot). Selections are shared by all KV heads
(trained indexer, Hs = 1) or per KV head (training-free, Hs = Hkv).

Numerics as the dense kernels (SYSTEM.md §1): FP32 scores and accumulators, E4M3 decoded on
read natively or by the exact packed software decoder, k_scale (and the software decoder's
2^8) folded into the softmax scale, v_scale applied once to the normalised output after the
merge; masked loads with other=0. Rows with count < 0 (padding) are never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcap.kernels.common import (
    FP_FUSION,
    LOG2E,
    SOFTWARE_FP8_FACTOR,
    check_cache,
    convert_tile,
    dot_dtype,
    has_mma,
    load_raw,
    merge_splits,
    mm,
    one_decoder_software_fp8,
    online_softmax_step,
    paged_row_offsets,
    sm_count,
)
from kvcap.kernels.decode import _load_q, choose_num_splits, decode_config, store_rows


@triton.jit
def _sparse_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, po_ptr, plse_ptr, tok_ptr, bt_ptr, seq_ptr, cnt_ptr,
    ks_ptr, vs_ptr, sm_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ch, stride_ct, bt_stride,
    stride_tt, stride_ts, stride_pt, stride_ph, stride_ps, num_splits,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    FP8: tl.constexpr, SOFTWARE: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, SHARED_SEL: tl.constexpr,
):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    cnt = tl.load(cnt_ptr + t)
    if cnt < 0:
        return
    seq = tl.load(seq_ptr + t)
    if SHARED_SEL:
        hs = 0
    else:
        hs = kvh
    per = tl.cdiv(tl.cdiv(cnt, BLOCK_N), num_splits) * BLOCK_N
    lo = split * per
    hi = tl.minimum(lo + per, cnt)
    h = tl.arange(0, BLOCK_H)
    hmask = h < GROUP
    heads = kvh * GROUP + h
    qk_scale = sm_scale
    out_scale = 1.0
    if FP8:
        qk_scale = qk_scale * tl.load(ks_ptr)
        out_scale = tl.load(vs_ptr)
    if SOFTWARE:
        qk_scale = qk_scale * 256.0
        out_scale = out_scale * 256.0
    q = _load_q(q_ptr, t.to(tl.int64) * stride_qt, heads, hmask, HEAD_DIM, DOT_DTYPE,
                stride_qh)
    head_off = kvh.to(tl.int64) * stride_ch
    tok_base = tok_ptr + t.to(tl.int64) * stride_tt + hs * stride_ts
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        i = start + tl.arange(0, BLOCK_N)
        m = i < hi
        tok = tl.load(tok_base + i, mask=m, other=0)
        m = m & (tok >= 0)
        row = paged_row_offsets(bt_ptr, bt_stride, seq, tok, m, BLOCK_SIZE, stride_cb,
                                stride_ct, head_off)
        kr = load_raw(kc_ptr, row, m, HEAD_DIM)
        vr = load_raw(vc_ptr, row, m, HEAD_DIM)
        s = mm(q, tl.trans(convert_tile(kr, FP8, SOFTWARE, DOT_DTYPE)), USE_DOT, IEEE)
        s = tl.where(m[None, :], s * qk_scale, float("-inf"))
        m_new, alpha, p, l_i = online_softmax_step(s, m_i, l_i)
        v = convert_tile(vr, FP8, SOFTWARE, DOT_DTYPE, True)
        acc = acc * alpha[:, None] + mm(p.to(DOT_DTYPE), v, True, IEEE)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    if not SPLIT:
        inv = (out_scale / l_safe)[:, None]
        base = out_ptr + t.to(tl.int64) * stride_ot + heads[:, None].to(tl.int64) * stride_oh
        store_rows(base, hmask, acc * inv, HEAD_DIM)
    else:
        inv = (1.0 / l_safe)[:, None]
        pbase = t.to(tl.int64) * stride_pt + heads.to(tl.int64) * stride_ph + split * stride_ps
        store_rows(po_ptr + pbase[:, None] * HEAD_DIM, hmask, acc * inv, HEAD_DIM)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(plse_ptr + pbase, lse, mask=hmask)


@triton.jit
def _merge_rows_kernel(
    out_ptr, po_ptr, plse_ptr, cnt_ptr, vs_ptr, out_factor,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, num_splits,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0)
    head = tl.program_id(1)
    if tl.load(cnt_ptr + t) < 0:
        return
    res = merge_splits(po_ptr, plse_ptr, vs_ptr, out_factor, t.to(tl.int64) * stride_pt, head,
                       stride_ph, stride_ps, num_splits, BLOCK_S, HEAD_DIM, FP8)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + head * stride_oh + tl.arange(0, HEAD_DIM),
             res.to(out_ptr.dtype.element_ty))


def sparse_config(device: torch.device, fp8: bool, head_dim: int = 128,
                  mma: bool | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_N, num_warps, num_stages, programs per SM) — the dense decode's choices. `mma`:
    the GPU has Triton's tensor-core dots (default: has_mma); without them (V100, T4) the
    decode kernel's own no-spill configuration (decode_config)."""
    if device.type != "cuda":
        return 16, 1, 1, 4
    if not (has_mma(device) if mma is None else mma):
        cfg = decode_config(head_dim, True, fp8, device, words=False, mma=False)
        return cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.programs_per_sm
    return 64, 4, 2, 8 if fp8 else 4


def qsa_sparse_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         out: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor,
                         row_seq: torch.Tensor, block_tables: torch.Tensor,
                         softmax_scale: float, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None, fp8_mode: str = "auto",
                         num_splits: int | None = None) -> torch.Tensor:
    """Attention of every row over its selected tokens.

    q, out [T, Hq, D]; caches [NB, Hkv, block_size, D] (uint8 = E4M3 with 0-dim FP32
    scales); tokens int32 [T, Hs, W] (Hs = 1 or Hkv; the first counts[t] entries valid and
    causal); counts int32 [T] (-1 = padding row, left untouched); row_seq int [T];
    block_tables int32 [B, max_blocks].
    """
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    check_cache(k_cache, v_cache, d)
    hs, width = tokens.shape[1], tokens.shape[2]
    if hq % hkv or hs not in (1, hkv):
        raise ValueError(f"heads: {hq} query, {hkv} KV, {hs} selection")
    if q.stride(2) != 1 or out.stride(2) != 1 or tokens.stride(2) != 1:
        raise ValueError("q/out/tokens last dims must be contiguous")
    if t == 0:
        return out
    group = hq // hkv
    fp8 = k_cache.dtype == torch.uint8
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an E4M3 cache needs k_scale and v_scale")
    software = fp8 and one_decoder_software_fp8(q.device, fp8_mode)
    bn, nw, ns, pps = sparse_config(q.device, fp8, d)
    if num_splits is None:
        num_splits = choose_num_splits(t, hkv, width, bn, sm_count(q.device), pps)
    if num_splits > 1:
        po = torch.empty((t, hq, num_splits, d), dtype=torch.float32, device=q.device)
        plse = torch.empty((t, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        po = plse = out
    ps = (hq * num_splits, num_splits, 1)
    dt, ieee = dot_dtype(q.dtype)
    dummy = k_cache
    _sparse_kernel[(t, hkv, num_splits)](
        q, k_cache, v_cache, out, po, plse, tokens, block_tables, row_seq, counts,
        k_scale if fp8 else dummy, v_scale if fp8 else dummy, softmax_scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        tokens.stride(0), tokens.stride(1), *ps, num_splits,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_SIZE=k_cache.shape[2], BLOCK_N=bn, SPLIT=num_splits > 1, FP8=fp8,
        SOFTWARE=software, USE_DOT=True, DOT_DTYPE=dt, IEEE=ieee,
        SHARED_SEL=hs == 1, num_warps=nw, num_stages=ns, **FP_FUSION,
    )
    if num_splits > 1:
        _merge_rows_kernel[(t, hq)](
            out, po, plse, counts, v_scale if fp8 else dummy,
            SOFTWARE_FP8_FACTOR if software else 1.0,
            out.stride(0), out.stride(1), *ps, num_splits,
            BLOCK_S=max(8, triton.next_power_of_2(num_splits)), HEAD_DIM=d, FP8=fp8,
            num_warps=4 if q.device.type == "cuda" else 1, **FP_FUSION,
        )
    return out
