"""Paged decode attention (one new token per sequence): split-K flash-decoding + LSE merge.

One program per (sequence, head program, split). A head program is either one KV head with
all GROUP query heads that share it (grouped route: each KV tile is loaded once and hits the
tensor cores through tl.dot, M = the padded group) or one query head (plain route: broadcast
multiply-sum, the rollback). Both E4M3 decoders work on the same raw byte tile, so the loop is
the same for every cache dtype; at head_dim 128 E4M3 tiles are read as 32-bit words in four
column groups instead (attend_word_tiles, see use_words). Scores and outputs accumulate in
FP32. Scales are hoisted: k_scale (and the software decoder's 2^8) fold into the softmax
scale, v_scale multiplies the normalised output once, after the split merge. Rows of sequences
whose query length is not 1 are skipped (the prefill kernel serves them), so mixed batches
need no host-side split. BF16 queries over an E4M3 cache run FP16 dots (fp16_scale): the
decoders give FP16 values, so only the query is converted, once per program.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvcap.kernels.common import (
    FP_FUSION,
    LOG2E,
    MIXED_FP8_MODES,
    SOFTWARE_FP8_FACTOR,
    check_attention_args,
    convert_tile,
    convert_words,
    device_properties,
    dot_dtype,
    for_gpu,
    fp16_dots_enabled,
    grouped_enabled,
    has_mma,
    has_native_fp8,
    load_raw,
    load_words,
    merge_splits,
    mixed_decoders_enabled,
    mm,
    online_softmax_step,
    paged_byte_offsets,
    paged_row_offsets,
    paged_word_offsets,
    pdl_launch,
    pdl_mode,
    pdl_release,
    pdl_wait,
    prefetch_l2,
    programs_per_sm,
    sm_count,
    split_k_enabled,
    use_software_fp8,
    words_enabled,
)


@triton.jit
def _load_q(q_ptr, row_base, heads, hmask, HEAD_DIM: tl.constexpr, DOT_DTYPE: tl.constexpr,
            stride_qh):
    """Query rows [BLOCK_H, HEAD_DIM]."""
    base = q_ptr + row_base + heads[:, None].to(tl.int64) * stride_qh
    d = tl.arange(0, HEAD_DIM)[None, :]
    return tl.load(base + d, mask=hmask[:, None], other=0.0).to(DOT_DTYPE)


@triton.jit
def store_rows(base, hmask, o, HEAD_DIM: tl.constexpr):
    """Store [BLOCK_H, HEAD_DIM] at base [BLOCK_H, 1] pointers."""
    d = tl.arange(0, HEAD_DIM)[None, :]
    tl.store(base + d, o.to(base.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _row_offsets(bt_ptr, bt_stride, seq, pos, mask, BLOCK_SIZE: tl.constexpr, stride_cb,
                 stride_ct, head_off, UNSIGNED: tl.constexpr):
    """Cache offsets of a tile's rows, in the unsigned form (paged_byte_offsets) where it was
    timed faster: decode's E4M3 byte route at D = 64, 0.95-0.99x natively and 0.97-0.98x in
    software (H200, triton 3.6; docs/kernels.md, "Twenty-ninth change"). The short route at
    D = 128 lost 0.6 µs in software at one sequence with it, the 16-bit kernel held more
    registers, and prefill (which shares attend_tiles) was not timed with it."""
    if UNSIGNED:
        off = paged_byte_offsets(bt_ptr, bt_stride, seq, pos, mask, BLOCK_SIZE, stride_cb,
                                 stride_ct, head_off)
    else:
        off = paged_row_offsets(bt_ptr, bt_stride, seq, pos, mask, BLOCK_SIZE, stride_cb,
                                stride_ct, head_off)
    return off


@triton.jit
def attend_tiles(q, kc_ptr, vc_ptr, bt_ptr, bt_stride, seq, lo, hi,
                 qk_scale, head_off, stride_cb, stride_ct, qpos,
                 BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, FP8: tl.constexpr, SOFTWARE: tl.constexpr,
                 SOFTWARE_V: tl.constexpr, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 IEEE: tl.constexpr, CAUSAL: tl.constexpr, PREFETCH: tl.constexpr,
                 UNSIGNED_ROWS: tl.constexpr = False, wlo=0, WINDOW: tl.constexpr = 0):
    """Online-softmax attention of BLOCK_H query rows over cached tokens [lo, hi) of one KV
    head. Returns (m, l, acc): base-2 running max, sum, unnormalised FP32 output. With
    CAUSAL, row r sees positions <= qpos[r]. With PREFETCH the raw K/V bytes of the next tile
    are loaded into registers before the current tile is decoded and used, keeping loads in
    flight. SOFTWARE / SOFTWARE_V: the decoder of K / of V (they may differ). UNSIGNED_ROWS:
    row offsets in paged_byte_offsets' form (_row_offsets). WINDOW > 0: a sliding window --
    no position below `wlo` is read, and with CAUSAL row r sees only qpos[r] - WINDOW + 1 ..
    qpos[r]."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    if PREFETCH:
        pos0 = lo + tl.arange(0, BLOCK_N)
        mask0 = pos0 < hi
        if WINDOW > 0:
            mask0 = mask0 & (pos0 >= wlo)
        row0 = _row_offsets(bt_ptr, bt_stride, seq, pos0, mask0, BLOCK_SIZE,
                            stride_cb, stride_ct, head_off, UNSIGNED_ROWS)
        kr = load_raw(kc_ptr, row0, mask0, HEAD_DIM)
        vr = load_raw(vc_ptr, row0, mask0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pmask = pos < hi
        if WINDOW > 0:  # only a window's first tile starts below wlo
            pmask = pmask & (pos >= wlo)
        if PREFETCH:
            npos = pos + BLOCK_N
            nmask = npos < hi
            nrow = _row_offsets(bt_ptr, bt_stride, seq, npos, nmask, BLOCK_SIZE,
                                stride_cb, stride_ct, head_off, UNSIGNED_ROWS)
            kn = load_raw(kc_ptr, nrow, nmask, HEAD_DIM)
            vn = load_raw(vc_ptr, nrow, nmask, HEAD_DIM)
        else:
            row = _row_offsets(bt_ptr, bt_stride, seq, pos, pmask, BLOCK_SIZE, stride_cb,
                               stride_ct, head_off, UNSIGNED_ROWS)
            kr = load_raw(kc_ptr, row, pmask, HEAD_DIM)
            vr = load_raw(vc_ptr, row, pmask, HEAD_DIM)
        k = convert_tile(kr, FP8, SOFTWARE, DOT_DTYPE)
        s = mm(q, tl.trans(k), USE_DOT, IEEE) * qk_scale
        if CAUSAL:
            valid = pmask[None, :] & (pos[None, :] <= qpos[:, None])
            if WINDOW > 0:
                valid = valid & (pos[None, :] > qpos[:, None] - WINDOW)
        else:
            valid = pmask[None, :]
        m_new, alpha, p, l_i = online_softmax_step(tl.where(valid, s, float("-inf")), m_i, l_i)
        if CAUSAL and WINDOW > 0:
            # Prefill through a window: a query tile starts at its first row's window, so a
            # later row may see nothing in the first tiles, and online_softmax_step gives such
            # a row a running max of 0. Kept, that 0 became the reference of the row's real
            # scores (p = exp2(s - 0)): scores well below 0 underflowed (in FP16 below 2^-24)
            # and the row's output was lost to 0. A row that has seen nothing keeps -inf.
            m_new = tl.where(l_i > 0, m_new, float("-inf"))
        v = convert_tile(vr, FP8, SOFTWARE_V, DOT_DTYPE, True)
        acc = acc * alpha[:, None] + mm(p.to(DOT_DTYPE), v, USE_DOT, IEEE)
        m_i = m_new
        if PREFETCH:
            kr = kn
            vr = vn
    return m_i, l_i, acc


@triton.jit
def _absmax(x):
    """max |x| over a 2-D tile, in FP32."""
    return tl.max(tl.max(tl.abs(x.to(tl.float32)), 1), 0)


@triton.jit
def _to_dot(q, q_up, DOT_DTYPE: tl.constexpr, F16_DOTS: tl.constexpr):
    """Queries as the QK dot's operand; with F16_DOTS (BF16 queries) times q_up first, the
    power of two of fp16_scale."""
    if F16_DOTS:
        q = (q.to(tl.float32) * q_up).to(DOT_DTYPE)
    else:
        q = q.to(DOT_DTYPE)
    return q


@triton.jit
def fp16_scale(amax):
    """(2^s, 2^-s) so that the largest |q| of the program's query rows times 2^s lies in
    [2^14, 2^15): BF16 queries then convert to FP16 without overflow and, but for elements
    below 2^-28 of that largest (whose products lie far under the FP32 sum's rounding),
    exactly. This lets BF16 queries over an E4M3 cache run the FP16 route's dots: K and V
    decode to FP16 exactly on either decoder, and the probabilities carry more mantissa in
    FP16 than in BF16. One scale for all rows keeps k's scale a scalar (a per-row scale
    spilled at the word route's 128-register cap)."""
    bits = amax.to(tl.int32, bitcast=True)
    shift = tl.where(amax > 0, 141 - ((bits >> 23) & 0xFF), 0)  # 14 - unbiased exponent
    shift = tl.minimum(tl.maximum(shift, -126), 126)
    up = ((shift + 127) << 23).to(tl.float32, bitcast=True)
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    return up, down


@triton.jit
def attend_word_tiles(q_ptr, q_base, heads, hmask, kc_ptr, vc_ptr, bt_ptr, bt_stride, seq, lo, hi,
                      qk_scale, head_off, stride_cb, stride_ct, stride_qh,
                      BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      BLOCK_N: tl.constexpr, SOFTWARE: tl.constexpr, SOFTWARE_V: tl.constexpr,
                      DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, PAIRS: tl.constexpr,
                      F16_DOTS: tl.constexpr = False, wlo=0, WINDOW: tl.constexpr = 0):
    """attend_tiles for E4M3 caches read as 32-bit words: the head dimension is split into the
    four column groups a word decodes to (column 4c + j -> group j), so QK^T is four dots of
    K = D/4 and the output is four [BLOCK_H, D/4] accumulators (returned in group order).
    F16_DOTS: BF16 queries on FP16 dots (fp16_scale). WINDOW > 0: positions below `wlo` are
    neither read nor seen."""
    qb = q_ptr + q_base + heads[:, None].to(tl.int64) * stride_qh
    c4 = tl.arange(0, HEAD_DIM // 4)[None, :] * 4
    q0 = tl.load(qb + c4, mask=hmask[:, None], other=0.0)
    q1 = tl.load(qb + c4 + 1, mask=hmask[:, None], other=0.0)
    q2 = tl.load(qb + c4 + 2, mask=hmask[:, None], other=0.0)
    q3 = tl.load(qb + c4 + 3, mask=hmask[:, None], other=0.0)
    if F16_DOTS:
        amax = tl.maximum(tl.maximum(_absmax(q0), _absmax(q1)),
                          tl.maximum(_absmax(q2), _absmax(q3)))
        q_up, down = fp16_scale(amax)
        qk_scale = qk_scale * down
    else:
        q_up = 1.0
    q0 = _to_dot(q0, q_up, DOT_DTYPE, F16_DOTS)
    q1 = _to_dot(q1, q_up, DOT_DTYPE, F16_DOTS)
    q2 = _to_dot(q2, q_up, DOT_DTYPE, F16_DOTS)
    q3 = _to_dot(q3, q_up, DOT_DTYPE, F16_DOTS)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    a0 = tl.zeros([BLOCK_H, HEAD_DIM // 4], tl.float32)
    a1 = tl.zeros([BLOCK_H, HEAD_DIM // 4], tl.float32)
    a2 = tl.zeros([BLOCK_H, HEAD_DIM // 4], tl.float32)
    a3 = tl.zeros([BLOCK_H, HEAD_DIM // 4], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pmask = pos < hi
        if WINDOW > 0:
            pmask = pmask & (pos >= wlo)
        row = paged_word_offsets(bt_ptr, bt_stride, seq, pos, pmask, BLOCK_SIZE, stride_cb,
                                 stride_ct, head_off)
        k0, k1, k2, k3 = convert_words(load_words(kc_ptr, row, pmask, HEAD_DIM), SOFTWARE,
                                       DOT_DTYPE, PAIRS)
        s = mm(q0, tl.trans(k0), True, IEEE) + mm(q1, tl.trans(k1), True, IEEE)
        s += mm(q2, tl.trans(k2), True, IEEE) + mm(q3, tl.trans(k3), True, IEEE)
        s = tl.where(pmask[None, :], s * qk_scale, float("-inf"))
        m_new, alpha, p, l_i = online_softmax_step(s, m_i, l_i)
        pd = p.to(DOT_DTYPE)
        v0, v1, v2, v3 = convert_words(load_words(vc_ptr, row, pmask, HEAD_DIM), SOFTWARE_V,
                                       DOT_DTYPE, PAIRS)
        a0 = a0 * alpha[:, None] + mm(pd, v0, True, IEEE)
        a1 = a1 * alpha[:, None] + mm(pd, v1, True, IEEE)
        a2 = a2 * alpha[:, None] + mm(pd, v2, True, IEEE)
        a3 = a3 * alpha[:, None] + mm(pd, v3, True, IEEE)
        m_i = m_new
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def _store_groups(base, hmask, o0, o1, o2, o3, HEAD_DIM: tl.constexpr):
    """Store four column groups [BLOCK_H, HEAD_DIM // 4] (column 4c + j) at base pointers."""
    c4 = tl.arange(0, HEAD_DIM // 4)[None, :] * 4
    tl.store(base + c4, o0.to(base.dtype.element_ty), mask=hmask[:, None])
    tl.store(base + c4 + 1, o1.to(base.dtype.element_ty), mask=hmask[:, None])
    tl.store(base + c4 + 2, o2.to(base.dtype.element_ty), mask=hmask[:, None])
    tl.store(base + c4 + 3, o3.to(base.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def window_start(seq_len, WINDOW: tl.constexpr):
    """The first position a decode query (at seq_len - 1) sees through a WINDOW-token window."""
    return tl.maximum(seq_len - WINDOW, 0)


@triton.jit
def first_tile_start(seq_len, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """Where a decode query's tiles begin: 0, or with a sliding WINDOW the start of the tile
    holding window_start(seq_len)."""
    if WINDOW > 0:
        return (window_start(seq_len, WINDOW) // BLOCK_N) * BLOCK_N
    return 0


@triton.jit
def _split_bounds(seq_len, split, num_splits, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr = 0):
    """[lo, hi): the cached positions split `split` of num_splits attends (whole tiles of
    those from first_tile_start on)."""
    first = first_tile_start(seq_len, BLOCK_N, WINDOW)
    per_split = tl.cdiv(tl.cdiv(seq_len - first, BLOCK_N), num_splits) * BLOCK_N
    lo = first + split * per_split
    return lo, tl.minimum(lo + per_split, seq_len)


@triton.jit
def _prefetch_first_tile(kc_ptr, vc_ptr, bt_ptr, bt_stride, seq_lens_ptr, num_splits, head_off,
                         stride_cb, stride_ct, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_N: tl.constexpr, UNSIGNED_ROWS: tl.constexpr,
                         WINDOW: tl.constexpr = 0):
    """L2 prefetch of this program's first K/V tile (every 128-byte line of each row), from
    what the kernel before a dependent launch does not write -- the sequence length and the
    block table (host copies made before the step) -- so it can run ahead of pdl_wait and
    overlap the previous kernel's tail. The newest token's row, which that kernel may still be
    writing, is only hinted at, never read (prefetch_l2)."""
    seq = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo, hi = _split_bounds(seq_len, tl.program_id(2), num_splits, BLOCK_N, WINDOW)
    pos = lo + tl.arange(0, BLOCK_N)
    mask = pos < hi
    if WINDOW > 0:
        mask = mask & (pos >= window_start(seq_len, WINDOW))
    rows = _row_offsets(bt_ptr, bt_stride, seq, pos, mask, BLOCK_SIZE, stride_cb, stride_ct,
                        head_off, UNSIGNED_ROWS)
    LINE_ELEMS: tl.constexpr = 1024 // kc_ptr.dtype.element_ty.primitive_bitwidth
    ROW_LINES: tl.constexpr = max(1, HEAD_DIM // LINE_ELEMS)
    lines = rows[:, None] + (tl.arange(0, ROW_LINES) * LINE_ELEMS)[None, :]
    prefetch_l2(kc_ptr + lines, mask[:, None])
    prefetch_l2(vc_ptr + lines, mask[:, None])


@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, po_ptr, plse_ptr, cnt_ptr,
    bt_ptr, seq_lens_ptr, qsl_ptr, ks_ptr, vs_ptr, sm_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ch, stride_ct, bt_stride,
    stride_pb, stride_ph, stride_ps, num_splits,
    GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, FP8: tl.constexpr, SOFTWARE: tl.constexpr, SOFTWARE_V: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
    PREFETCH: tl.constexpr, WORDS: tl.constexpr, PAIRS: tl.constexpr = False,
    FOLD: tl.constexpr = False, BLOCK_S: tl.constexpr = 8,
    F16_DOTS: tl.constexpr = False, GDC: tl.constexpr = 0,
    PREWAIT: tl.constexpr = False, WINDOW: tl.constexpr = 0,
):
    seq = tl.program_id(0)
    hp = tl.program_id(1)
    split = tl.program_id(2)
    kvh = (hp * HEADS) // GROUP
    if PREWAIT:  # an experiment, off by default (paged_decode's `prewait`)
        _prefetch_first_tile(kc_ptr, vc_ptr, bt_ptr, bt_stride, seq_lens_ptr, num_splits,
                             kvh.to(tl.int64) * stride_ch, stride_cb, stride_ct, HEAD_DIM,
                             BLOCK_SIZE, BLOCK_N, FP8 and HEAD_DIM == 64, WINDOW)
    pdl_wait(GDC)  # q and the cache rows come from the kernel before (common.pdl_launch)
    # All three loads issued together: the length is not behind the branch's round trip.
    q_row = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if q_end - q_row != 1:
        return
    h = tl.arange(0, BLOCK_H)
    hmask = h < HEADS
    heads = hp * HEADS + h
    lo, hi = _split_bounds(seq_len, split, num_splits, BLOCK_N, WINDOW)
    wlo = window_start(seq_len, WINDOW) if WINDOW > 0 else 0
    if SPLIT and split > 0 and lo >= seq_len:
        # A split the sequence leaves empty (the engine sizes splits for a context class)
        # writes nothing: the merge reads only used_splits' partials.
        return

    qk_scale = sm_scale
    out_scale = 1.0
    if FP8:
        qk_scale = qk_scale * tl.load(ks_ptr)
        out_scale = tl.load(vs_ptr)
    if SOFTWARE:
        qk_scale = qk_scale * 256.0
    if SOFTWARE_V:
        out_scale = out_scale * 256.0
    if WORDS:
        m_i, l_i, a0, a1, a2, a3 = attend_word_tiles(
            q_ptr, q_row.to(tl.int64) * stride_qt, heads, hmask, kc_ptr, vc_ptr, bt_ptr,
            bt_stride, seq, lo, hi, qk_scale, kvh.to(tl.int64) * stride_ch, stride_cb,
            stride_ct, stride_qh, BLOCK_H, HEAD_DIM, BLOCK_SIZE, BLOCK_N, SOFTWARE, SOFTWARE_V,
            DOT_DTYPE, IEEE, PAIRS, F16_DOTS, wlo, WINDOW)
    else:
        if F16_DOTS:  # BF16 queries, FP16 dots: one power of two for the program's queries
            q = _load_q(q_ptr, q_row.to(tl.int64) * stride_qt, heads, hmask, HEAD_DIM,
                        tl.float32, stride_qh)
            q_up, down = fp16_scale(_absmax(q))
            qk_scale = qk_scale * down
            q = (q * q_up).to(DOT_DTYPE)
        else:
            q = _load_q(q_ptr, q_row.to(tl.int64) * stride_qt, heads, hmask, HEAD_DIM,
                        DOT_DTYPE, stride_qh)
        m_i, l_i, acc = attend_tiles(
            q, kc_ptr, vc_ptr, bt_ptr, bt_stride, seq, lo, hi, qk_scale,
            kvh.to(tl.int64) * stride_ch, stride_cb, stride_ct, h,
            BLOCK_H, HEAD_DIM, BLOCK_SIZE, BLOCK_N, FP8, SOFTWARE, SOFTWARE_V, USE_DOT,
            DOT_DTYPE, IEEE, False, PREFETCH, FP8 and HEAD_DIM == 64, wlo, WINDOW)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    if not SPLIT:
        inv = (out_scale / l_safe)[:, None]
        base = out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None].to(tl.int64) * stride_oh
    else:
        inv = (1.0 / l_safe)[:, None]
        pbase = (seq.to(tl.int64) * stride_pb + heads.to(tl.int64) * stride_ph
                 + split * stride_ps)
        base = po_ptr + pbase[:, None] * HEAD_DIM
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(plse_ptr + pbase, lse, mask=hmask)
    if WORDS:
        _store_groups(base, hmask, a0 * inv, a1 * inv, a2 * inv, a3 * inv, HEAD_DIM)
    else:
        store_rows(base, hmask, acc * inv, HEAD_DIM)
    if SPLIT and FOLD:
        _merge_if_last(out_ptr, po_ptr, plse_ptr, cnt_ptr + seq * tl.num_programs(1) + hp, vs_ptr,
                       q_row, seq, hp * HEADS, stride_ot, stride_oh, stride_pb, stride_ph,
                       stride_ps, used_splits(seq_len, num_splits, BLOCK_N, WINDOW), HEADS,
                       BLOCK_S, HEAD_DIM, FP8, SOFTWARE_V)
    pdl_release(GDC)


@triton.jit
def used_splits(seq_len, num_splits, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr = 0):
    """How many of a sequence's num_splits splits hold tokens (at least 1): _decode_kernel
    gives each split cdiv(tiles, num_splits) tiles, so a sequence shorter than the length
    the split count was chosen for leaves the last splits empty (tiles: those _split_bounds
    shares out)."""
    n_tiles = tl.cdiv(seq_len - first_tile_start(seq_len, BLOCK_N, WINDOW), BLOCK_N)
    per_split = tl.maximum(tl.cdiv(n_tiles, num_splits), 1)
    return tl.maximum(tl.cdiv(n_tiles, per_split), 1)


@triton.jit
def _merge_if_last(out_ptr, po_ptr, plse_ptr, cnt, vs_ptr, q_row, seq, head0, stride_ot,
                   stride_oh, stride_pb, stride_ph, stride_ps, num_splits, HEADS: tl.constexpr,
                   BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, FP8: tl.constexpr,
                   SOFTWARE_V: tl.constexpr):
    """The split-K merge folded into the decode kernel: each program of a (sequence, head
    program) counts itself in at `cnt` (acq_rel, after a barrier so its partial stores are
    issued first); the one that arrives last merges the HEADS heads, reading the others'
    partials around L1, and puts the counter back to 0 for the next call or graph replay."""
    tl.debug_barrier()
    prev = tl.atomic_add(cnt, 1, sem="acq_rel")
    tl.debug_barrier()
    if prev == num_splits - 1:
        tl.store(cnt, 0)
        factor = 256.0 if SOFTWARE_V else 1.0  # SOFTWARE_FP8_FACTOR
        for i in tl.static_range(HEADS):
            res = merge_splits(po_ptr, plse_ptr, vs_ptr, factor, seq.to(tl.int64) * stride_pb,
                               head0 + i, stride_ph, stride_ps, num_splits, BLOCK_S, HEAD_DIM,
                               FP8, True)
            dst = (out_ptr + q_row.to(tl.int64) * stride_ot + (head0 + i) * stride_oh
                   + tl.arange(0, HEAD_DIM))
            tl.store(dst, res.to(out_ptr.dtype.element_ty))


@triton.jit
def _merge_kernel(
    out_ptr, po_ptr, plse_ptr, qsl_ptr, seq_lens_ptr, vs_ptr, out_factor,
    stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, num_splits,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr,
    GDC: tl.constexpr = 0, WINDOW: tl.constexpr = 0,
):
    pdl_wait(GDC)  # the partials come from the decode kernel
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if q_end - q_row != 1:
        return
    res = merge_splits(po_ptr, plse_ptr, vs_ptr, out_factor, seq.to(tl.int64) * stride_pb, head,
                       stride_ph, stride_ps, used_splits(seq_len, num_splits, BLOCK_N, WINDOW),
                       BLOCK_S, HEAD_DIM, FP8)
    dst = out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + tl.arange(0, HEAD_DIM)
    tl.store(dst, res.to(out_ptr.dtype.element_ty))
    pdl_release(GDC)


MAX_SPLITS = 64
MAX_SHORT_SPLITS = 16  # choose_num_splits' short-context rule splits at most this far
# The folded merge reads the partials 8 splits at a time, all in flight; past 32 splits
# (ptxas sm_90a, E4M3 word route: 40 bytes spilled at 64) the merge kernel does it.
FOLD_MAX_SPLITS = 32
WAVE_FILL = 0.85  # the least filled last wave choose_num_splits accepts when splitting past one


def choose_num_splits(num_seqs: int, head_programs: int, max_seq_len: int, block_n: int,
                      num_sms: int, programs_per_sm: int = 4, whole_waves: bool = False,
                      short_programs_per_sm: int | None = None,
                      resident: int | None = None) -> int:
    """Split the context so the grid holds about `programs_per_sm` programs per SM (memory
    latency needs many loads in flight), keeping >= 4 tiles per split. With `whole_waves`
    (`programs_per_sm` is then how many programs an SM holds at once) the grid never exceeds
    one full wave by a partial one: 9 splits of 64 (sequence, head) programs on 132 SMs x 4 is
    576 programs, 48 of which run in a second wave on an almost idle GPU (H200, 8B shape,
    8 x 32K: 184 us at 9 splits, 161 us at 8).

    `short_programs_per_sm`: where the 4-tile rule leaves a short context's grid smaller than
    that many programs per SM, split further, down to one tile per split and at most
    MAX_SHORT_SPLITS (never past the grid the rule above allows). A call over a short context
    is latency-bound: its time is the serial walk of one program's tiles, not the bytes (H200,
    8B shape, BF16 queries, docs/benchmarks/short-2026-12-02-h200-8b-bf16.json: 1 x 1K took
    13.3 us at 2 E4M3 splits and 8.4 at 8; the 16-bit kernel 12.9 at 4 and 8.1 at 16). The
    engine chooses splits for a context class (2048 for every shorter context), so the
    merge also pays for splits a shorter sequence leaves empty: 32 splits over 1K tokens
    took 9.4 us, 16 took 8.1 (rules-2026-12-02-h200-*.json), hence the cap.

    `resident`: how many programs an SM holds at once, for a kernel whose `programs_per_sm` is
    a target rather than its residency (the 16-bit kernel): where the unsplit grid fits one
    wave, the split grid stays within it too. H200, 8B shape, BF16, 5 resident programs: at
    32 sequences 3 splits (768 programs, 1.16 waves) took 87 / 163 / 637 us at 2K / 4K / 16K
    tokens and 2 splits 74 / 133 / 487; at 64 sequences 1 split took 0.89-0.94x 2 splits'
    time (docs/benchmarks/splits-2026-12-03-h200-8b-bf16-wide-{1,2}.json)."""
    if not split_k_enabled():
        return 1
    tiles = triton.cdiv(max(max_seq_len, 1), block_n)
    limit = max(1, min(tiles // 4, MAX_SPLITS))
    base = max(num_seqs * head_programs, 1)
    slots = programs_per_sm * num_sms
    if not whole_waves or base <= slots:
        widest = slots // base if whole_waves else triton.cdiv(slots, base)
        splits = int(max(1, min(widest, limit)))
    else:
        # More (sequence, head) programs than one wave holds: split so the last wave is
        # nearly full (8B shape, 64 x 16K on the H200 at 3 programs per SM: 512 programs fill
        # 1.29 waves and take 566 us; 2 splits fill 2.59 and take 522 us).
        widest, splits = 1, 1
        for s in range(1, limit + 1):
            waves = s * base / slots
            if waves / math.ceil(waves) >= WAVE_FILL:
                splits = s
                break
    if short_programs_per_sm:
        short = min(tiles, MAX_SHORT_SPLITS, widest, short_programs_per_sm * num_sms // base)
        splits = max(splits, short)
    if resident and base <= resident * num_sms:
        splits = min(splits, max(1, resident * num_sms // base))
    return splits


class DecodeConfig(NamedTuple):
    block_n: int
    num_warps: int
    num_stages: int
    prefetch: bool
    programs_per_sm: int  # drives choose_num_splits
    maxnreg: int | None = None  # register cap per thread (None: the compiler's choice)
    whole_waves: bool = False  # programs_per_sm is the residency: split in whole waves
    pairs: bool = False  # word route: convert byte pairs (see paged_decode)
    short_programs_per_sm: int | None = None  # choose_num_splits' short-context grid
    resident: int | None = None  # programs an SM holds, where programs_per_sm is a target


# Shared memory of the E4M3 word-route program (BLOCK_N 128, 4 warps, byte pairs, 128-register
# cap) by pipeline depth, triton 3.6 and 3.9, sm_80 to sm_90 (scripts/inspect_decode_ptx.py
# --words --defaults; tests/test_kernels_compile.py checks it). Triton pipelines a load that
# depends on another load of the loop (the block table) (S - 1) // 2 iterations ahead, so the
# K/V tiles get one shared buffer at 3 stages -- their loads are issued after the tile was
# used, and each tile's memory latency is exposed -- and two buffers at 5 stages.
WORD_ROUTE_SHARED_BYTES = {3: 41472, 5: 74752}
# Wide short calls: more (sequence, KV head) programs than an SM's 3 five-stage programs per SM
# cover, but no more than 4 three-stage ones do, over at most this many tokens, take 3 stages
# and one split (one wave, no merge). H200, 8B shape, BF16 queries, 64 sequences (512
# programs; docs/benchmarks/splits-2026-12-03-h200-8b-bf16-wide-{1,2}.json): 5 stages at 2 splits
# took 63 / 93 / 156 us at 1,152 / 2K / 4K tokens, 3 stages at 1 split 45 / 72 / 136; at 16K
# 557 against 538 (there the double-buffered tiles matter more than the merge), hence the
# bound.
WIDE_WORD_ROUTE_TOKENS = 4096
# The word route at D = 128 in 64-token tiles (4 warps, 5 stages, byte pairs, 128-register cap):
# ptxas sm_90a, triton 3.9, 39,424 bytes of shared memory and 119 registers, so registers bound
# it at 4 programs per Hopper SM where the 128-token program's 74,752 bytes hold 3. H100, 8B
# shape, BF16 queries, three sweeps in one run (docs/benchmarks/word-tiles-2026-12-07-h100-8b-
# bf16.json; docs/kernels.md, "Thirty-ninth change"): over 16K / 32K tokens 64-token tiles took
# 0.93-0.94x the 128-token launch's time at 64 sequences (one split: 512 programs, one wave of
# 4 x 132) and 0.97-1.00x at 8 and 16 sequences (6 / 3 splits, ~3 programs per SM, beat the
# full 4), natively and in software. Taken on the GPUs where it was measured
# (WORD_ROUTE_TILE_BY_GPU, matched by name as common.PDL_MAX_ROWS_BY_GPU is) and past
# WIDE_WORD_ROUTE_TOKENS only: shorter calls keep the launches measured there.
WORD_ROUTE_64_SHARED_BYTES = 39424
WORD_ROUTE_TILE_BY_GPU = {"H100 80GB HBM3": 64}
ENV_WORD_ROUTE_TILE = "KVCAP_WORD_ROUTE_TILE"

# The 16-bit kernel's program by head size (4 warps, 2 stages; BLOCK_N 128 at D = 64, 64 above) on
# sm_80 to sm_90: shared memory bytes, and registers per thread by target (sm_80; other pre-Hopper
# targets; sm_90+) -- the larger of triton 3.6 and 3.9 (tests/test_kernels_compile.py checks
# both). D = 64: 38,912 bytes, 122 / 128 / 92 registers (triton 3.9: 96 / 93 / 92), so 5 programs
# per SM on the H200, 4 on the A100. D = 128: 38,912 bytes, 128 / 96 / 96 (triton 3.9: 96 / 80 /
# 80), 5 on the H200, 4 on the A100. D = 256: 75,776 bytes, 230 / 168 / 168, 3 on the H200.
SIXTEEN_BIT_SHARED_BYTES = {64: 38912, 128: 38912, 256: 75776}
_SIXTEEN_BIT_REGISTERS = {64: (122, 128, 92), 128: (128, 96, 96), 256: (230, 168, 168)}
# At D = 64 (the embedded model's shape, 3 KV heads) the one-wave cap changes the split count
# only for wide calls: on the H200 56-58 sequences 4 -> 3, 74-87 3 -> 2, 111-175 2 -> 1.
# Measured there, BF16 (docs/benchmarks/splits-2026-12-03i-h200-d64-bf16-wide.json), us at
# 2K / 16K tokens, target's count -> capped: 80 sequences 42.8 / 316.3 -> 39.8 / 245.1; 132:
# 69.4 / 492.2 -> 55.3 / 400.2; 150: 72.2 / 509.3 -> 61.7 / 452.2 (0.77-0.93x; the capped count
# was the best of 1-3 splits in 5 of 6 cells, 132 x 16K 3 splits 391.6).
# At D = 256 the target stays 8 programs per SM, but where the unsplit grid fits one wave of
# the 3 resident ones the split grid does too. H200, GQA-6, BF16
# (docs/benchmarks/splits-2026-12-03h-h200-gqa6-bf16-{wide,narrow}.json), us at 4K / 16K / 32K
# tokens, target's split count -> capped: 4 sequences (64 -> 24 splits at 16K / 32K) 86.4 /
# 146.9 -> 74.7 / 135.7 at 16K / 32K; 8 (33 -> 12) 49.3 / 142.4 / 265.8 -> 42.7 / 133.1 /
# 255.6; 16 (17 -> 6) 79.6 / 262.2 / 512.0 -> 71.9 / 253.3 / 500.0; 32 (9 -> 3) 79 / 502 ->
# 74 / 497 at 2K / 16K; 64 (5 -> 1) 143 / 1,049 -> 133 / 985 at 2K / 16K. Applied where an SM
# holds at least 3 (measured on the H200); GPUs that hold fewer (A100: 2, 100 KiB parts: 1)
# would leave SMs idle under a one-wave cap, so they keep the target.
SIXTEEN_BIT_D256_MIN_RESIDENT = 3


def sixteen_bit_registers(props, head_dim: int) -> int:
    """Registers per thread of the 16-bit kernel at `head_dim` (64, 128 or 256) on this GPU."""
    sm80, pre_hopper, hopper = _SIXTEEN_BIT_REGISTERS[head_dim]
    if props.major >= 9:
        return hopper
    return sm80 if (props.major, props.minor) == (8, 0) else pre_hopper


def sixteen_bit_resident(props, head_dim: int) -> int | None:
    """Programs per SM the 16-bit kernel holds at once, where decode_config caps its splits by
    them (D = 64 and 128, and D = 256 on GPUs holding at least SIXTEEN_BIT_D256_MIN_RESIDENT)."""
    if head_dim not in SIXTEEN_BIT_SHARED_BYTES:
        return None
    resident = programs_per_sm(props, SIXTEEN_BIT_SHARED_BYTES[head_dim],
                               sixteen_bit_registers(props, head_dim), 4)
    if head_dim == 256 and resident < SIXTEEN_BIT_D256_MIN_RESIDENT:
        return None
    return resident


# The word route at D = 256 (BLOCK_N 64, 4 warps, 3 stages, byte pairs), ptxas triton 3.6:
# 43,264 bytes of shared memory on sm_80 to sm_90; 168 registers per thread uncapped (no
# spill), 128 under the cap, where sm_90 spills 4-20 bytes and sm_80 / sm_86 24-64
# (tests/test_kernels_compile.py checks both). H200, BF16 queries, GQA-6
# (docs/benchmarks/occupancy-2026-12-02b-h200-gqa6-words-bf16.json): capped, 4 programs per SM,
# at the split counts whole waves give, native decode took 0.76x the byte route's time at
# 8 x 32K and 0.83x at 64 x 16K (79% of the read ceiling, against 60-65%), the software decoder
# 0.87x / 0.91x; 5 stages, 32-token tiles and 8 warps were slower, 128-token tiles uncapped
# slower or no faster. So the cap where it was measured (sm_90), none below (3 programs per SM
# where the shared memory allows: derived, not measured).
WORD_ROUTE_D256_SHARED_BYTES = 43264
WORD_ROUTE_D256_REGISTERS = 168


# Short contexts (choose_num_splits' short_programs_per_sm): the E4M3 word route's programs
# walk 128-token tiles through a 5-stage pipeline, and its short calls were fastest at about
# 2 programs per SM (H200, 8B shape: 1 x 1K / 4 x 1K / 8 x 1K best at 8 / 8 / 4 splits), the
# 16-bit kernel's at its usual 4.
SHORT_WORD_PROGRAMS_PER_SM = 2
# E4M3 at D = 128 over contexts up to this long (the engine's shortest context class) takes
# the byte route in 64-token tiles, 2 stages, 8 programs per SM: a short call is one or two
# tiles per program, and the word route's tile walk is the longer one (measurement in
# docs/kernels.md, "Fifteenth change").
SHORT_BYTE_ROUTE_TOKENS = 2048
# ... and at most one (sequence, head program) per 4 SMs: the byte route took 0.86-1.00x the
# word route's time at B <= 4 (8 KV heads: <= 32 programs on 132 SMs) and 1.02-1.40x at B >= 8.
SHORT_BYTE_ROUTE_SMS_PER_PROGRAM = 4


# The E4M3 byte route at D = 64 (the embedded model; BLOCK_N 128, 4 warps): shared memory by
# pipeline depth (triton 3.9, sm_80 to sm_90), and a register bound above what ptxas gives (92-121
# with triton 3.9); tests/test_kernels_compile.py checks both with triton 3.9 in CI and 3.6 on the
# H200 (scripts/gpu_matrix.sh tests). At 2 stages the K/V loads, which depend on the block-table
# load, are not pipelined at all ((S - 1) // 2 = 0 iterations ahead; see WORD_ROUTE_SHARED_BYTES);
# 5 stages double-buffer them. H200, BF16 queries, 3 KV heads
# (docs/benchmarks/occupancy-2026-12-04-h200-smol-bf16.json): 5 stages at 4 programs per SM and
# whole-wave splits took 0.82x the 2-stage launch's time natively at 64 x 32K / 128K, 0.86-0.91x
# at 8 / 16 sequences; the software decoder 0.87-0.91x at 8 / 16 sequences, 1.03x at 64.
BYTE_ROUTE_D64_SHARED_BYTES = {2: 38912, 5: 56320}
BYTE_ROUTE_D64_REGISTERS = 128
# The 5-stage launch where an SM holds at least this many of its programs (Hopper: 4), else
# the 2-stage one (A100: 2 at 5 stages against 4 at 2 -- derived, not measured).
BYTE_ROUTE_D64_MIN_RESIDENT = 4


def byte_route_d64_launch(props) -> tuple[int, int | None]:
    """(pipeline stages, programs per SM for whole-wave splits, or None for the 2-stage
    launch's split target) of the E4M3 byte route at D = 64."""
    resident = programs_per_sm(props, BYTE_ROUTE_D64_SHARED_BYTES[5], BYTE_ROUTE_D64_REGISTERS, 4)
    if resident >= BYTE_ROUTE_D64_MIN_RESIDENT:
        return 5, resident
    return 2, None


def word_route_d256_launch(props) -> tuple[int | None, int]:
    """(register cap, programs per SM) of the E4M3 word route at D = 256."""
    cap = 128 if (props.major, props.minor) >= (9, 0) else None
    return cap, programs_per_sm(props, WORD_ROUTE_D256_SHARED_BYTES,
                                cap or WORD_ROUTE_D256_REGISTERS, 4)


def word_route_launch(props) -> tuple[int, int]:
    """(pipeline stages, programs per SM) of the E4M3 word route on a GPU with these device
    properties: 5 stages (double-buffered K/V) where an SM still holds 3 such programs (Hopper:
    228 KiB of shared memory), else 3 stages (A100: 3 programs, 100 KiB parts such as the
    RTX 30xx / 40xx: 2)."""
    resident = word_route_programs(props, 5)
    if resident >= 3:
        return 5, resident
    return 3, word_route_programs(props, 3)


def word_route_tile(device: torch.device, max_seq_len: int, programs: int = 0) -> int:
    """Tokens per tile of the E4M3 word route at D = 128: 64 on the GPUs WORD_ROUTE_TILE_BY_GPU
    names, over calls longer than WIDE_WORD_ROUTE_TOKENS, except where the call's `programs`
    ((sequence, KV head) pairs) hold more than one but at most three per SM; else 128.
    KVCAP_WORD_ROUTE_TILE=64|128 forces either on any GPU (for measurements).

    The exception is the H100's 32 x 16K / 32K (256 programs on 132 SMs, one split either way):
    128-token tiles took 0.98-0.99x the 64-token time there, natively and in software, where
    64-token tiles won at 64 and 128 programs (0.97-1.00x) and at 512 (0.93-0.94x)
    (docs/benchmarks/word-tiles-2026-12-07c-h100-8b-bf16-32-and-short.json)."""
    raw = os.environ.get(ENV_WORD_ROUTE_TILE, "").strip()
    if raw:
        if raw not in ("64", "128"):
            raise ValueError(f"{ENV_WORD_ROUTE_TILE}={raw!r}: expected 64 or 128 tokens per "
                             f"tile of the E4M3 word route (unset it for the default)")
        return int(raw)
    if max_seq_len <= WIDE_WORD_ROUTE_TOKENS:
        return 128
    tile = for_gpu(WORD_ROUTE_TILE_BY_GPU, getattr(device_properties(device), "name", ""), 128)
    sms = sm_count(device)
    return 128 if tile == 64 and sms < programs <= 3 * sms else tile


def word_route_programs(props, stages: int) -> int:
    """Programs per SM of the E4M3 word route at D = 128 with `stages` pipeline stages (its
    shared memory, WORD_ROUTE_SHARED_BYTES; 128 registers; 4 warps)."""
    return programs_per_sm(props, WORD_ROUTE_SHARED_BYTES[stages], 128, 4)


def decode_config(head_dim: int, grouped: bool, fp8: bool, device: torch.device,
                  words: bool | None = None, mma: bool | None = None,
                  short_route: bool = False, programs: int = 0,
                  max_seq_len: int = 0) -> DecodeConfig:
    """Launch configuration of the decode kernel (`words`: the E4M3 word route; default: the
    route use_words picks; `mma`: the GPU has Triton's tensor-core dots, default: has_mma;
    `short_route`: the call is short_byte_route's, which at D = 128 reads E4M3 bytes in
    64-token tiles; `programs` (sequences x head programs) and `max_seq_len`, where given,
    let a wide short call take the word route's three-stage launch, WIDE_WORD_ROUTE_TOKENS).

    Below sm_80 (V100, T4: FMA dots) the MMA-tuned tiles spill kilobytes per thread (ptxas,
    triton 3.6: 3.9-11.6 KB at BLOCK_N 128 / 64), so those GPUs take 32-token tiles (16 at
    D = 256), which compile without spills for every cache dtype and head size — chosen from
    the compiler's output, not measured (no such GPU was available); tests/test_kernels_compile.py
    checks the spills.

    From the H200 sweeps (docs/kernels.md): FP16 tiles go through Triton's software pipeliner
    (num_stages=2) and want ~4 programs per SM. E4M3 tiles are converted in registers between
    the shared-memory load and the dot, are bound by that per-element work rather than by
    bytes, and gain from 128-token tiles at D <= 128. The E4M3 word route (D = 128) needs 168
    registers per thread uncapped, so an H200 SM holds 3 programs; capped at 128 (ptxas sm_90a:
    40 bytes spilled, none with byte pairs) it holds 4 (docs/benchmarks/occupancy-2026-12-01*-
    h200.json). Nsight Compute then showed the K/V loads single-buffered at 3 stages (see
    WORD_ROUTE_SHARED_BYTES); 5 stages double-buffer them at 3 programs per SM, 0-5% faster
    on the H200's 8B cells (occupancy-2026-12-01d-h200.json), so GPUs with the shared memory
    for it get 5 stages (word_route_launch); splits fill whole waves. Both decoders share the
    tile loop, so they share the configuration. Converting byte pairs (`pairs`) takes 64 of the
    144 permutes out of the compiled kernel and runs 1.3-6% faster, bit-identical
    (docs/benchmarks/pairs-2026-12-01-h200.json)."""
    if device.type != "cuda":
        return DecodeConfig(16, 1, 1, fp8, 4)
    if not grouped:
        return DecodeConfig(64 if head_dim <= 64 else 32, 4, 2, False, 4)
    if not (has_mma(device) if mma is None else mma):
        return DecodeConfig(32 if head_dim <= 128 else 16, 4, 2, False, 8)
    if words is None:
        words = use_words(head_dim, grouped, fp8, device, short_route)
    if fp8 and not words and short_route and head_dim == 128:
        return DecodeConfig(64, 4, 2, False, 8, short_programs_per_sm=8)
    if fp8 and words and head_dim == 128:
        props = device_properties(device)
        if word_route_tile(device, max_seq_len, programs) == 64:
            # Splits aim at 3 programs per SM (8 / 16 sequences: 6 / 3 splits beat the full 4),
            # but a grid that fits one wave of the 4 resident stays unsplit (64 sequences).
            resident = programs_per_sm(props, WORD_ROUTE_64_SHARED_BYTES, 128, 4)
            return DecodeConfig(64, 4, 5, False, min(3, resident), maxnreg=128,
                                whole_waves=True, pairs=True,
                                short_programs_per_sm=SHORT_WORD_PROGRAMS_PER_SM,
                                resident=resident)
        stages, resident = word_route_launch(props)
        if stages == 5 and 0 < max_seq_len <= WIDE_WORD_ROUTE_TOKENS:
            wide, sms = word_route_programs(props, 3), sm_count(device)
            if resident * sms < programs <= wide * sms:
                stages, resident = 3, wide
        return DecodeConfig(128, 4, stages, False, resident, maxnreg=128, whole_waves=True,
                            pairs=True, short_programs_per_sm=SHORT_WORD_PROGRAMS_PER_SM)
    if fp8 and words and head_dim == 256:
        cap, resident = word_route_d256_launch(device_properties(device))
        return DecodeConfig(64, 4, 3, False, resident, maxnreg=cap, whole_waves=True,
                            pairs=True)
    # The short-context rule where it was measured to help (H200: D = 64 and 128); at
    # D = 256 more splits than the 4-tile rule's were slower or no faster.
    short = None if head_dim >= 256 else (8 if fp8 else 4)
    if fp8 and head_dim == 64 and not words:
        stages, resident = byte_route_d64_launch(device_properties(device))
        if resident:
            return DecodeConfig(128, 4, stages, False, resident, whole_waves=True,
                                short_programs_per_sm=short)
    if fp8:
        return DecodeConfig(128 if head_dim <= 128 else 64, 4, 2, False, 8,
                            short_programs_per_sm=short)
    pps = 8 if head_dim >= 256 else 4
    resident = sixteen_bit_resident(device_properties(device), head_dim)
    return DecodeConfig(128 if head_dim <= 64 else 64, 4, 2, False, pps,
                        short_programs_per_sm=short, resident=resident)


def short_byte_route(head_dim: int, fp8: bool, max_seq_len: int, programs: int,
                     num_sms: int) -> bool:
    """Whether an E4M3 decode at D = 128 reads bytes in 64-token tiles instead of the word
    route: over at most SHORT_BYTE_ROUTE_TOKENS (the engine's shortest context class) with at
    most one (sequence, head program) per SHORT_BYTE_ROUTE_SMS_PER_PROGRAM SMs."""
    return (fp8 and head_dim == 128 and max_seq_len <= SHORT_BYTE_ROUTE_TOKENS
            and programs * SHORT_BYTE_ROUTE_SMS_PER_PROGRAM <= num_sms)


def use_words(head_dim: int, grouped: bool, fp8: bool, device: torch.device,
              short_route: bool = False) -> bool:
    """Whether E4M3 decode reads the cache as words (attend_word_tiles) by default: at
    D = 128 and 256. H200, same run (docs/benchmarks/words-2026-11-30-h200.json): the word route
    took 0.88-0.90x the byte route's time natively and 0.93-0.94x in software at D = 128,
    0.96-1.03x at D = 256 at the byte route's tiles, and 1.8-2.4x at D = 64 (four K = 16 dots
    per tile); at D = 256 with its own launch (word_route_d256_launch, 2026-12-02) 0.76-0.83x
    natively and 0.87-0.91x in software. It exists to feed tensor-core operand layouts, so GPUs
    without Triton MMA (below sm_80) read bytes; the CPU interpreter follows the sm_80+ rule, so
    CPU tests run the defaults those GPUs run. `short_route`: a short call at D = 128 takes
    the byte route (short_byte_route)."""
    return (fp8 and grouped and head_dim in (128, 256) and words_enabled()
            and has_mma(device) and not short_route)


def fp8_decoders(device: torch.device, fp8_mode: str) -> tuple[bool, bool]:
    """(software K decoder?, software V decoder?). fp8_mode "native-k" decodes K in hardware
    and V with the packed software decoder, "native-v" the reverse; "native" and "software"
    use one decoder for both. The decoders give identical values on different units (the
    conversion pipe vs the integer ALUs). "auto" is "native" where the GPU converts E4M3
    ("native-k" with KVCAP_MIXED_DECODERS=1) and "software" elsewhere or with
    KVCAP_FORCE_SOFTWARE_FP8=1. Why "native-k" is not the default (H200): alone, the decode
    kernel takes 0.93-1.00x the all-native time on all six benchmark cells, in random and in
    in-order block tables (docs/benchmarks/decoders-2026-12-01-h200*.json), yet end to end at
    16 x 16K on the 8B shape decode is 1.1-1.5% slower with it, in three runs and both arm
    orders (throughput-2026-12-01-h200-16k-*.json). The prefill and QSA kernels always use
    one decoder for both."""
    if fp8_mode in MIXED_FP8_MODES:
        if not has_native_fp8(device):
            raise ValueError(f"fp8_mode={fp8_mode!r} needs the SM89+ hardware conversion")
        return fp8_mode == "native-v", fp8_mode == "native-k"
    software = use_software_fp8(device, fp8_mode)
    if fp8_mode == "auto" and not software and mixed_decoders_enabled():
        return False, True  # native-k
    return software, software


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def merge_counters(device: torch.device, n: int) -> torch.Tensor:
    """The folded merge's arrival counters on `device` (int32, zero between calls: the merging
    program resets its own); decode calls on one device must not overlap on different streams
    (the engine runs one forward at a time). They only grow outside CUDA graph capture: a
    tensor zeroed during capture is only zeroed when the graph replays."""
    cur = _COUNTERS.get(device)
    if cur is None or cur.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"fold=True needs {n} merge counters but CUDA graph capture is "
                             "running: make one call of this batch size before capturing")
        cur = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return cur


def config_splits(cfg: DecodeConfig, num_seqs: int, head_programs: int, max_seq_len: int,
                  num_sms: int, block_n: int | None = None) -> int:
    """choose_num_splits for a launch of configuration `cfg` (tiles of `block_n` tokens where a
    caller overrides the configuration's)."""
    return choose_num_splits(num_seqs, head_programs, max_seq_len, block_n or cfg.block_n,
                             num_sms, cfg.programs_per_sm, cfg.whole_waves,
                             cfg.short_programs_per_sm, cfg.resident)


def default_launch(num_seqs: int, head_programs: int, max_seq_len: int, head_dim: int,
                   fp8: bool, device: torch.device) -> tuple[bool, DecodeConfig, int]:
    """(word route?, launch configuration, split count) that paged_decode's grouped route
    takes by default for this call: what benchmarks print and sweeps pin."""
    num_sms = sm_count(device)
    short = short_byte_route(head_dim, fp8, max_seq_len, num_seqs * head_programs, num_sms)
    words = use_words(head_dim, True, fp8, device, short)
    cfg = decode_config(head_dim, True, fp8, device, words, short_route=short,
                        programs=num_seqs * head_programs, max_seq_len=max_seq_len)
    return words, cfg, config_splits(cfg, num_seqs, head_programs, max_seq_len, num_sms)


def split_buffers(num_seqs: int, hq: int, num_splits: int, d: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised split-K partials (outputs, base-2 LSEs): a split writes its own before
    the merge reads it, and splits a sequence leaves empty are neither written nor read."""
    po = torch.empty((num_seqs, hq, num_splits, d), dtype=torch.float32, device=device)
    plse = torch.empty((num_seqs, hq, num_splits), dtype=torch.float32, device=device)
    return po, plse


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, softmax_scale: float, max_seq_len: int,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 fp8_mode: str = "auto", **knobs) -> torch.Tensor:
    """Decode attention for every sequence whose query length is 1 (others are skipped).

    q [T, Hq, D], out [T, Hq, D] (the token row of sequence i is query_start_loc[i]);
    caches [num_blocks, Hkv, block_size, D] (uint8 = E4M3 with 0-dim FP32 k/v scales);
    block_tables int32 [B, W]; seq_lens int32 [B]; query_start_loc int32 [B+1].
    The launch knobs (`knobs`, decode_launcher's keyword arguments) follow.
    `max_seq_len` (host int) only drives the launch heuristics (split count; at D = 128 the
    short-context byte route, short_byte_route): any value is correct.
    `words`: read an E4M3 cache as 32-bit words in four column groups (attend_word_tiles;
    grouped route, head_dim >= 64 only). `fp8_mode`: auto | native | software | native-k |
    native-v (fp8_decoders). `maxnreg`: a register cap per thread (more programs per SM;
    CUDA only; 0 = none; default: decode_config's when no other launch knob is given).
    `pairs`: the word route permutes each thread's byte pairs before the conversion, so every
    column group's pair leaves it as one f16x2 register (fewer permutes; same values).
    `fold`: merge the split-K partials inside the decode kernel (the last program of each
    sequence and head program to finish does it) instead of in a second launch, up to
    FOLD_MAX_SPLITS splits. Off by default: on the H200 it saved nothing (0.96-1.04x on the 8B
    cells, 0.77-0.92x at 4 x 4K; docs/benchmarks/fold-2026-12-01-h200.json) -- the arrival
    atomic and barriers cost every program what the second launch cost once.
    `fp16_dots`: BF16 queries over an E4M3 cache run the FP16 route's dots (the queries scaled
    into FP16 by a power of two, fp16_scale; the default on GPUs with Triton MMA unless
    KVCAP_DISABLE_FP16_DOTS=1) instead of BF16 dots, which need every decoded FP16 value
    converted to BF16 (1.11-1.14x the time natively on the H200's 8B cells: docs/kernels.md,
    "Ninth change").
    `prewait`: each program first L2-prefetches its first K/V tile, from the sequence length
    and block table alone, before it waits for the kernel before it (programmatic dependent
    launch, common.pdl_launch), so the prefetch overlaps that kernel's tail. An experiment, off
    by default, not yet timed (docs/kernels.md, "Thirtieth change"); same outputs either way.
    """
    launch = decode_launcher(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
                             softmax_scale, max_seq_len, k_scale, v_scale, fp8_mode=fp8_mode,
                             **knobs)
    if launch is not None:
        launch(q, k_cache, v_cache, out, k_scale, v_scale)
    return out


def decode_launcher(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, softmax_scale: float, max_seq_len: int,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    fp8_mode: str = "auto", grouped: bool | None = None,
                    num_splits: int | None = None, block_n: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None,
                    prefetch: bool | None = None, words: bool | None = None,
                    maxnreg: int | None = None, pairs: bool | None = None,
                    fold: bool = False, fp16_dots: bool | None = None,
                    prewait: bool = False, window: int | None = None):
    """paged_decode's host work -- checks, route, launch configuration, split buffers -- done
    once: returns `launch(q, k_cache, v_cache, out, k_scale, v_scale)`, which runs the kernels
    for tensors shaped, strided and typed as these (another layer's cache and scales, the same
    metadata), or None when there is nothing to launch. The attention backend builds one per
    step and shape and launches it in every layer, so the layers skip this Python (~25 us a
    call on a CPU core: the eager step's host time, not the GPU's, set its speed).
    `window`: the layer's sliding window (LayerKVCache.window): each query reads only its last
    `window` positions, and that span, not max_seq_len, drives the heuristics."""
    num_seqs = seq_lens.shape[0]
    hq, hkv, d, fp8 = check_attention_args(q, k_cache, v_cache, out, k_scale, v_scale, window)
    if num_seqs == 0:
        return None
    if window is not None:
        max_seq_len = min(max_seq_len, window)
    group = hq // hkv
    software, software_v = fp8_decoders(q.device, fp8_mode) if fp8 else (False, False)
    bf16_e4m3 = fp8 and q.dtype == torch.bfloat16
    if fp16_dots is None:  # below sm_80 (FMA dots) the FP32 query tile spilled 352 bytes
        fp16_dots = bf16_e4m3 and has_mma(q.device) and fp16_dots_enabled()
    if fp16_dots and not bf16_e4m3:
        raise ValueError("fp16_dots=True is for BF16 queries over an E4M3 cache: it needs both")
    if grouped is None:
        grouped = grouped_enabled()
    heads = group if grouped else 1
    head_programs = hkv if grouped else hq
    short = grouped and short_byte_route(d, fp8, max_seq_len, num_seqs * head_programs,
                                         sm_count(q.device))
    if words is None:
        words = use_words(d, grouped, fp8, q.device, short)
    if words and not (fp8 and grouped and d >= 64):
        raise ValueError("words=True needs an E4M3 cache, the grouped route and head_dim >= 64")
    cfg = decode_config(d, grouped, fp8, q.device, words, short_route=short,
                        programs=num_seqs * head_programs, max_seq_len=max_seq_len)
    if pairs is None:
        pairs = words and cfg.pairs
    if pairs and not words:
        raise ValueError("pairs=True converts the word route's byte pairs: it needs words=True")
    bn, nw, ns = block_n or cfg.block_n, num_warps or cfg.num_warps, num_stages or cfg.num_stages
    pf = cfg.prefetch if prefetch is None else prefetch
    if maxnreg is None and block_n is None and num_warps is None and num_stages is None:
        maxnreg = cfg.maxnreg  # the cap belongs to the default launch configuration
    if num_splits is None:
        num_splits = config_splits(cfg, num_seqs, head_programs, max_seq_len,
                                   sm_count(q.device), bn)
    elif num_splits < 1:  # a grid of no splits launches nothing: `out` was left unwritten
        raise ValueError(f"num_splits={num_splits}: a decode needs at least one split")
    block_h = max(16, triton.next_power_of_2(heads)) if grouped else 1
    counters = k_cache  # unused without fold
    fold = fold and num_splits > 1
    if fold and num_splits > FOLD_MAX_SPLITS:
        raise ValueError(f"fold=True merges at most {FOLD_MAX_SPLITS} splits in the decode "
                         f"kernel, not {num_splits}: pass fold=False or fewer splits")
    if fold:
        counters = merge_counters(q.device, num_seqs * head_programs)
    if num_splits > 1:
        po, plse = split_buffers(num_seqs, hq, num_splits, d, q.device)
    else:
        po = plse = out  # unused
    ps = (hq * num_splits, num_splits, 1)
    dt, ieee = dot_dtype(torch.float16 if fp16_dots else q.dtype)
    launch = {"maxnreg": maxnreg} if maxnreg and q.device.type == "cuda" else {}  # 0: no cap
    pdl = pdl_launch(q.device, num_seqs)
    grid = (num_seqs, head_programs, num_splits)
    scalars = (softmax_scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
               *ps, num_splits)
    consts = dict(
        GROUP=group, HEADS=heads, BLOCK_H=block_h, HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[2],
        BLOCK_N=bn, SPLIT=num_splits > 1, FP8=fp8, SOFTWARE=software, SOFTWARE_V=software_v,
        USE_DOT=grouped, PREFETCH=pf, WORDS=words, PAIRS=pairs,
        FOLD=fold, BLOCK_S=max(8, triton.next_power_of_2(num_splits)),
        DOT_DTYPE=dt, IEEE=ieee, F16_DOTS=fp16_dots,
        PREWAIT=prewait, WINDOW=window or 0,
        GDC=pdl_mode(pdl, grid, q.device), num_warps=nw,
        num_stages=ns, **launch, **pdl,
    )
    merge = None
    if num_splits > 1 and not fold:
        merge_grid = (num_seqs, hq)
        merge_scalars = (SOFTWARE_FP8_FACTOR if software_v else 1.0, out.stride(0),
                         out.stride(1), *ps, num_splits)
        merge = (merge_grid, merge_scalars, dict(
            BLOCK_S=max(8, triton.next_power_of_2(num_splits)), HEAD_DIM=d,
            FP8=fp8, BLOCK_N=bn, GDC=pdl_mode(pdl, merge_grid, q.device), WINDOW=window or 0,
            num_warps=4 if q.device.type == "cuda" else 1, **pdl,
        ))

    def run(q, k_cache, v_cache, out, k_scale, v_scale) -> None:
        ks, vs = (k_scale, v_scale) if fp8 else (k_cache, k_cache)  # unused without FP8
        _decode_kernel[grid](q, k_cache, v_cache, out, po, plse, counters, block_tables,
                             seq_lens, query_start_loc, ks, vs, *scalars, **consts,
                             **FP_FUSION)
        if merge is not None:
            mgrid, mscalars, mconsts = merge
            _merge_kernel[mgrid](out, po, plse, query_start_loc, seq_lens, vs, *mscalars,
                                 **mconsts, **FP_FUSION)

    return run
