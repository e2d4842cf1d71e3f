"""QSA group scoring over the paged indexer cache (twin: kvcap.qsa.selection.score_groups).

One program per (query row, selection head, tile of BLOCK_G groups). The row's J query
vectors (trained: the index heads; training-free: the KV head's query heads) are the rows of
a tl.dot against the tile's group keys, read from the paged side cache
[NB+2, Hk, groups_per_block, dk] through the block table. Modes:
  0 relu_sum  sum_j ReLU(q_j . k) * scale   (trained indexer, one shared key head)
  1 dot_sum   sum_j q_j . k                 2 dot_max  max_j q_j . k
  3 bound_sum sum_j (q_j . c + |q_j| . r)   4 bound_max  max_j (...), c = (lo+hi)/2,
    r = (hi-lo)/2 (the min/max bound sum_d max(q lo, q hi)), in FP32 (IEEE dot).
Groups at or past the row's visible count are written as -inf (and never loaded).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcap.kernels.common import FP_FUSION, dot_dtype, mm

MODES = {"relu_sum": 0, "dot_sum": 1, "dot_max": 2, "bound_sum": 3, "bound_max": 4}


@triton.jit
def _score_kernel(
    q_ptr, lo_ptr, hi_ptr, bt_ptr, seq_ptr, vis_ptr, out_ptr, scale,
    stride_qt, stride_qs, stride_qj, stride_cb, stride_ch, stride_cr, bt_stride,
    stride_ot, stride_os, num_groups,
    J: tl.constexpr, BLOCK_J: tl.constexpr, DK: tl.constexpr, GPB: tl.constexpr,
    BLOCK_G: tl.constexpr, MODE: tl.constexpr, SHARED_KEY: tl.constexpr,
    DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    vis = tl.load(vis_ptr + t)
    g = tile * BLOCK_G + tl.arange(0, BLOCK_G)
    dst = out_ptr + t.to(tl.int64) * stride_ot + h * stride_os + g
    if tile * BLOCK_G >= vis:
        tl.store(dst, tl.full([BLOCK_G], float("-inf"), tl.float32), mask=g < num_groups)
        return
    seq = tl.load(seq_ptr + t)
    gm = g < vis
    blk = tl.load(bt_ptr + seq.to(tl.int64) * bt_stride + g // GPB, mask=gm, other=0)
    if SHARED_KEY:
        kh = 0
    else:
        kh = h
    row = blk.to(tl.int64) * stride_cb + kh * stride_ch + (g % GPB) * stride_cr
    d = tl.arange(0, DK)
    jj = tl.arange(0, BLOCK_J)
    jm = jj < J
    qp = q_ptr + t.to(tl.int64) * stride_qt + h * stride_qs + jj[:, None] * stride_qj + d[None, :]
    q = tl.load(qp, mask=jm[:, None], other=0.0)
    k = tl.load(lo_ptr + row[:, None] + d[None, :], mask=gm[:, None], other=0.0)
    if MODE < 3:
        s = mm(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), True, IEEE)  # [BLOCK_J, BLOCK_G]
    else:
        hi = tl.load(hi_ptr + row[:, None] + d[None, :], mask=gm[:, None], other=0.0)
        lo32 = k.to(tl.float32)
        hi32 = hi.to(tl.float32)
        q32 = q.to(tl.float32)
        centre = (lo32 + hi32) * 0.5
        radius = (hi32 - lo32) * 0.5
        s = mm(q32, tl.trans(centre), True, True) + mm(tl.abs(q32), tl.trans(radius), True,
                                                        True)
    if MODE == 0:
        res = tl.sum(tl.where(jm[:, None], tl.maximum(s, 0.0), 0.0), 0) * scale
    elif MODE == 1 or MODE == 3:
        res = tl.sum(tl.where(jm[:, None], s, 0.0), 0)
    else:
        res = tl.max(tl.where(jm[:, None], s, float("-inf")), 0)
    tl.store(dst, tl.where(gm, res, float("-inf")), mask=g < num_groups)


def qsa_score(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor | None,
              block_tables: torch.Tensor, row_seq: torch.Tensor, visible: torch.Tensor,
              num_groups: int, mode: str, scale: float = 1.0,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Scores FP32 [T, Hs, num_groups] of every row's visible groups (-inf past them).

    q [T, Hs, J, dk] (queries in the side-cache dtype; the torch twin casts the same way);
    lo (and hi for bound modes) [NB+2, Hk, gpb, dk] side cache, Hk == Hs or 1 (shared key);
    block_tables int32 [B, W]; row_seq int [T] (the row's sequence); visible int32 [T].
    """
    t, hs, j, dk = q.shape
    if mode not in MODES:
        raise ValueError(f"score mode {mode!r} is not one of {tuple(MODES)}")
    if mode.startswith("bound") and hi is None:
        raise ValueError("bound modes need the max-bound cache")
    hk = lo.shape[1]
    if hk not in (1, hs) or lo.shape[3] != dk or q.stride(3) != 1 or lo.stride(3) != 1:
        raise ValueError(f"score shapes: q {tuple(q.shape)} vs cache {tuple(lo.shape)}")
    if dk < 16 or dk & (dk - 1):
        raise ValueError(f"index key dim {dk} must be a power of two >= 16")
    if out is None:
        out = torch.empty((t, hs, num_groups), dtype=torch.float32, device=q.device)
    if t == 0 or num_groups == 0:
        return out
    dt, ieee = dot_dtype(lo.dtype)
    on_gpu = q.device.type == "cuda"
    block_g = 64 if on_gpu else 16
    grid = (t, hs, triton.cdiv(num_groups, block_g))
    _score_kernel[grid](
        q, lo, hi if hi is not None else lo, block_tables, row_seq, visible, out, scale,
        q.stride(0), q.stride(1), q.stride(2), lo.stride(0), lo.stride(1), lo.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), num_groups,
        J=j, BLOCK_J=max(16, triton.next_power_of_2(j)), DK=dk, GPB=lo.shape[2],
        BLOCK_G=block_g, MODE=MODES[mode], SHARED_KEY=hk == 1,
        DOT_DTYPE=dt, IEEE=ieee, num_warps=4 if on_gpu else 1, **FP_FUSION,
    )
    return out
