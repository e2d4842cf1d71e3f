"""Exact per-row top-k of QSA group scores (radix select), expanded to token indices.

Order of choice: higher score first, the lower group index on ties, exactly as the torch
reference (a stable descending sort). Scores become order-preserving int32 keys (-0.0 is
folded onto +0.0 so the two tie, as they do in torch). Four passes of 8-bit histograms
(`tl.histogram`) narrow the k-th largest key T and how many keys equal to T are kept
(`rem`); a last pass, in ascending group order, keeps every key > T and the first `rem` keys
== T, so the kept groups come out sorted by group index without a sort.

Long rows run in two stages: stage 1 (one program per CHUNK groups) keeps each chunk's exact
top-k with the same rule, stage 2 selects from the chunk winners (kept in ascending index
order, -1 for unused slots). A group in the global top-k is beaten by fewer than k groups of
its own chunk, so it survives stage 1: the result is exact. The final stage writes tokens
[R*g .. R*g+R-1] per kept group, then the open tail R*vis .. pos, then -1 up to W.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcap.kernels.common import FP_FUSION

_INT_MIN = tl.constexpr(-2147483648)


@triton.jit
def _threshold(val_ptr, idx_ptr, base, gbase, n, k, EXPLICIT: tl.constexpr,
               BLOCK: tl.constexpr):
    """(T, rem): the k-th largest key and how many keys == T to keep; (INT_MIN, 2^30) when the
    list holds at most k valid elements (every one is kept). Keys: FP32 bits b ->
    b ^ ((b >> 31) & 0x7FFFFFFF), whose signed order is the float order (+0/-0 equal).
    Loads are written out inline: the CPU interpreter pays per nested jit call."""
    bins = tl.arange(0, 256)
    n = tl.where(n > k, n, 0)  # at most k elements: no pass needed, all are kept
    prefix = tl.zeros([], tl.int32)
    rem = k
    total = tl.zeros([], tl.int32)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], tl.int32)
        for s in range(0, n, BLOCK):
            i = s + tl.arange(0, BLOCK)
            m = i < n
            x = tl.load(val_ptr + base + i, mask=m, other=0.0)
            if EXPLICIT:
                m = m & (tl.load(idx_ptr + base + i, mask=m, other=-1) >= 0)
            b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
            u = (b ^ ((b >> 31) & 0x7FFFFFFF)) ^ _INT_MIN
            if p > 0:
                m = m & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram((u >> shift) & 0xFF, 256, mask=m)
        cnt = tl.sum(hist, 0)
        if p == 0:
            total = cnt
        cum_ge = cnt - tl.cumsum(hist, 0) + hist  # elements with digit >= d
        dstar = tl.maximum(tl.sum((cum_ge >= rem).to(tl.int32), 0) - 1, 0)
        rem = rem - tl.sum(tl.where(bins > dstar, hist, 0), 0)
        prefix = prefix | (dstar << shift)
    take_all = total <= k  # then every valid element passes key >= INT_MIN
    thr = tl.where(take_all, _INT_MIN, prefix ^ _INT_MIN)
    return thr, tl.where(take_all, 1 << 30, rem)


@triton.jit
def _topk_kernel(
    val_ptr, idx_ptr, vis_ptr, pos_ptr, out_val_ptr, out_idx_ptr, tok_ptr,
    k, list_len, num_heads, num_chunks, width,
    RATIO: tl.constexpr, CHUNK: tl.constexpr, STAGE: tl.constexpr, INCLUDE_TAIL: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """STAGE 0: one stage over the score row; 1: a chunk's winners; 2: from the winners."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    vis = tl.load(vis_ptr + t)
    row = (t.to(tl.int64) * num_heads + h) * list_len
    if STAGE == 1:
        gbase = c * CHUNK
        n = tl.minimum(tl.maximum(vis - gbase, 0), CHUNK)
        base = row + gbase
    elif STAGE == 2:
        gbase = 0
        n = tl.cdiv(vis, CHUNK) * k
        base = row
    else:
        gbase = 0
        n = vis
        base = row
    EXPLICIT: tl.constexpr = STAGE == 2
    thr, rem = _threshold(val_ptr, idx_ptr, base, gbase, n, k, EXPLICIT, BLOCK)
    kept = tl.zeros([], tl.int32)
    eq_seen = tl.zeros([], tl.int32)
    j = tl.arange(0, RATIO)
    if STAGE == 1:
        obase = ((t.to(tl.int64) * num_heads + h) * num_chunks + c) * k
    else:
        obase = (t.to(tl.int64) * num_heads + h) * width
    for s in range(0, n, BLOCK):
        i = s + tl.arange(0, BLOCK)
        m = i < n
        x = tl.load(val_ptr + base + i, mask=m, other=0.0)
        if EXPLICIT:
            g = tl.load(idx_ptr + base + i, mask=m, other=-1)
            m = m & (g >= 0)
        else:
            g = gbase + i
        b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
        key = b ^ ((b >> 31) & 0x7FFFFFFF)
        eq = (m & (key == thr)).to(tl.int32)
        eq_rank = eq_seen + tl.cumsum(eq, 0) - eq
        sel = m & ((key > thr) | ((eq > 0) & (eq_rank < rem)))
        si = sel.to(tl.int32)
        rank = kept + tl.cumsum(si, 0) - si
        if STAGE == 1:
            tl.store(out_val_ptr + obase + rank, x, mask=sel)
            tl.store(out_idx_ptr + obase + rank, g, mask=sel)
        else:
            dst = tok_ptr + obase + (rank * RATIO)[:, None] + j[None, :]
            tl.store(dst, (g * RATIO)[:, None] + j[None, :], mask=sel[:, None])
        kept += tl.sum(si, 0)
        eq_seen += tl.sum(eq, 0)
    if STAGE == 1:
        for s in range(0, k, BLOCK):
            i = s + tl.arange(0, BLOCK)
            tl.store(out_idx_ptr + obase + i, tl.full([BLOCK], -1, tl.int32),
                     mask=(i >= kept) & (i < k))
    else:
        start = kept * RATIO
        tail_n = tl.zeros([], tl.int32)
        if INCLUDE_TAIL:
            tail_n = tl.maximum(tl.load(pos_ptr + t) - vis * RATIO + 1, 0)
        for s in range(0, width, BLOCK_W):
            col = s + tl.arange(0, BLOCK_W)
            val = tl.where(col < start + tail_n, vis * RATIO + col - start, -1)
            tl.store(tok_ptr + obase + col, val, mask=(col >= start) & (col < width))


def topk_config(device: torch.device) -> tuple[int, int]:
    """(BLOCK, num_warps)."""
    return (1024, 8) if device.type == "cuda" else (512, 1)


def qsa_topk(scores: torch.Tensor, visible: torch.Tensor, pos: torch.Tensor, k: int,
             ratio: int, include_tail: bool = True, chunk: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Selected token indices of every row and selection head.

    scores FP32 [T, Hs, G] (only the first visible[t] groups of row t are read);
    visible int32 [T] (<= G); pos int32 [T] query positions (-1 = padding row: no tail);
    returns int32 [T, Hs, k*ratio + (ratio-1 if include_tail)], -1 padded; identical to
    kvcap.qsa.selection.select_tokens. `chunk` (groups per stage-1 program; default
    max(4k, 2048)) makes long rows run in two stages.
    """
    t, hs, g = scores.shape
    if scores.dtype != torch.float32 or scores.stride(2) != 1 or not scores.is_contiguous():
        raise ValueError("scores must be contiguous FP32 [T, Hs, G]")
    width = k * ratio + (ratio - 1 if include_tail else 0)
    if out is None:
        out = torch.empty((t, hs, width), dtype=torch.int32, device=scores.device)
    if t == 0:
        return out
    block, warps = topk_config(scores.device)
    chunk = chunk or max(4 * k, 2048)
    chunk = triton.next_power_of_2(chunk)
    nchunks = triton.cdiv(max(g, 1), chunk)
    common = dict(RATIO=ratio, CHUNK=chunk, INCLUDE_TAIL=include_tail, BLOCK=block,
                  BLOCK_W=256, num_warps=warps)
    if nchunks <= 1 or chunk <= k:
        _topk_kernel[(t, hs, 1)](scores, scores, visible, pos, scores, visible, out,
                                 k, g, hs, 1, width, STAGE=0, **common, **FP_FUSION)
        return out
    cand_val = torch.empty((t, hs, nchunks * k), dtype=torch.float32, device=scores.device)
    cand_idx = torch.empty((t, hs, nchunks * k), dtype=torch.int32, device=scores.device)
    _topk_kernel[(t, hs, nchunks)](scores, scores, visible, pos, cand_val, cand_idx, out,
                                   k, g, hs, nchunks, width, STAGE=1, **common, **FP_FUSION)
    _topk_kernel[(t, hs, 1)](cand_val, cand_idx, visible, pos, cand_val, cand_idx, out,
                             k, nchunks * k, hs, nchunks, width, STAGE=2, **common,
                             **FP_FUSION)
    return out
