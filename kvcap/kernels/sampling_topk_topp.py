"""Fused temperature + top-k + top-p + min-p sampling in one or two Triton launches.

Semantics: ``kvcap/sampling/reference.py`` (this module imports nothing else of kvcap).
A token is a packed int64 key ``(ordered float bits << 32) | (2**32 - 1 - index)``: a larger
key is a larger value, or the lower index on ties.

Stage 1, P = cdiv(V, BLOCK) chunks per row, one program per (row, chunk). Each program scales
its BLOCK logits and writes (chunk max, sum of exp, count, tau) to ``stats`` and its
candidates to ``cand``:
  * filtered rows: with the chunk viewed as NG = 4 * CAND groups, the CAND-th largest group
    maximum bounds from below at least CAND tokens; every finite token at or above it is
    compacted into the chunk's CAP = 4 * CAND slots (on overflow from ties, the bound is raised
    by bisection until the tokens fit). tau (stored) = ordered key such that every finite
    token of the chunk above it is in the list;
  * greedy rows: the largest key; plain rows (temperature only): the best Gumbel score key.
Stage 2, one program per row: merges the chunks. With G = max tau, every finite token whose
key is > G is present, and there are >= CAND of them; G is raised by bisection over the
candidates until at most CAP2 remain above it (still a complete set, and >= CAP2 - ties of
them); these are compacted, sorted, and give t_k, t_p, min-p and the Gumbel race exactly when
the answer lies above G. Otherwise (large top-p nucleus, large k, low min-p, many ties) the
program falls back to an exact bisection over the ordered keys of the whole row (count for
top-k, float64 mass for top-p).

The stages run as (``fused_sample(one_launch=...)``):
  * two launches: ``_stage1`` grid (B, P), then ``_stage2`` grid (B,);
  * one launch: ``_fused_one_launch`` grid (B, P). Each program does stage 1 on its chunk,
    then adds 1 to the row's arrival counter (an acq_rel atomic, after a barrier so all its
    stores are issued); the program that arrives last (it saw P - 1) resets the counter to 0
    and runs stage 2 for the row, reading the other programs' stats and candidates past L1
    (``.cg`` loads). One launch saves a launch's host time; at large B the merged kernel may
    lose occupancy, so the default is one launch when B <= ONE_LAUNCH_MAX_BATCH = 8: on the
    H200 (V 248,320, ``python -m kvcap.bench.sampler --sweep``) one launch takes 44-56 us
    eagerly against two launches' 72-74 us at B 1-8, and under graphs 31 vs 35 us at B=1,
    while at B=16 two launches are faster under graphs (62 vs 79 us). Both give identical
    results.
The bodies of the stages are the jit helpers ``_chunk_stats`` and ``_merge_row``, which all
three kernels call. Host side, ``fused_sample`` caches what it derives from the shapes
(launch configuration, grids, workspace) per (device, B, V, max_top_k, overrides).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvcap.kernels.common import FP_FUSION, load_cg

FLT_MAX = tl.constexpr(3.4028234663852886e38)
I32_MIN = tl.constexpr(-2147483648)
I32_MAX = tl.constexpr(2147483647)
I64_MIN = tl.constexpr(-9223372036854775808)
ORD_NEG_INF = tl.constexpr(-2139095041)  # ordered key of -inf
CAP2 = 256  # most complete candidates sorted by one stage-2 program
TILE = 2048  # tokens per step of the fallback's passes over a row
STAGE2_WARPS = 8  # stage 2 of the two-launch path (the one-launch kernel uses stage 1's)
ONE_LAUNCH_MAX_BATCH = 8  # from the H200 sweep (see the module docstring)
_EXACT = os.environ.get("TRITON_INTERPRET", "0") != "1"  # libdevice exp (not interpreted)
NF, NI = 4, 5  # fparams (temperature, top_p, min_p, 0), iparams (top_k, mode, seed lo/hi, step)


@triton.jit
def _fmix32(h):
    """MurmurHash3 finaliser on a uint32 tensor."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _row_keys(ip_ptr, row):
    """uint32 hash keys of one row from iparams (seed lo, seed hi, step at columns 2..4)."""
    lo = tl.load(ip_ptr + row * 5 + 2).to(tl.uint32, bitcast=True)
    hi = tl.load(ip_ptr + row * 5 + 3).to(tl.uint32, bitcast=True)
    step = tl.load(ip_ptr + row * 5 + 4).to(tl.uint32, bitcast=True)
    k0 = _fmix32(lo ^ _fmix32(step ^ 0x9E3779B9))
    k1 = _fmix32(hi ^ k0 ^ 0x7F4A7C15)
    return k0, k1


@triton.jit
def _gumbel(idx, k0, k1):
    """float32 Gumbel noise of token indices idx (int32) for row keys k0, k1."""
    h = _fmix32(_fmix32(idx.to(tl.uint32, bitcast=True) ^ k0) ^ k1)
    # 23 bits + half a step: exact in float32 and < 1 (reference.uniform_from_hash)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    return -tl.log(-tl.log(u))


@triton.jit
def _exp(x, EXACT: tl.constexpr):
    """exp with the CUDA math library's rounding (as torch) when EXACT, else the fast path."""
    if EXACT:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _scale(x, temp):
    """Step 1 of the reference: divide by temp (>0) or keep, NaN -> -inf, clamp +inf, -0 -> +0."""
    safe_t = tl.where(temp > 0, temp, 1.0)
    z = tl.where(temp > 0, tl.math.div_rn(x, safe_t + tl.zeros_like(x)), x)
    z = tl.where(z != z, float("-inf"), z)
    z = tl.minimum(z, FLT_MAX)
    return tl.where(z == 0, 0.0, z)


@triton.jit
def _ordered(z):
    """int32 key monotone in the float32 value z (no NaN, no -0.0)."""
    b = z.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _unordered(o):
    """Inverse of _ordered: int32 key -> float32 value."""
    return tl.where(o < 0, o ^ 0x7FFFFFFF, o).to(tl.float32, bitcast=True)


@triton.jit
def _pack(o, idx):
    """int64 token key from ordered value key o (int32) and index idx (int32)."""
    return (o.to(tl.int64) << 32) + (4294967295 - idx.to(tl.int64))


@triton.jit
def _chunk_stats(
    x_ptr, stride_x, fp_ptr, ip_ptr, stats_ptr, cand_ptr, V, P, ROW_CAND, row, chunk,
    GS: tl.constexpr, NG: tl.constexpr, CAND: tl.constexpr, CAP: tl.constexpr,
):  # fmt: skip
    """Stage 1's work on chunk `chunk` of row `row`: its stats and candidates."""
    g = tl.arange(0, NG)[:, None]
    offs = chunk * (NG * GS) + g * GS + tl.arange(0, GS)[None, :]  # [NG, GS]
    valid = offs < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=valid, other=float("-inf"))
    temp = tl.load(fp_ptr + row * 4)
    mode = tl.load(ip_ptr + row * 5 + 1)
    z = _scale(x.to(tl.float32), temp)
    gmax = tl.max(z, axis=1)  # [NG]
    m_c = tl.max(gmax, axis=0)
    m_safe = tl.where(m_c == float("-inf"), 0.0, m_c)
    s_c = tl.sum(tl.sum(tl.exp(z - m_safe).to(tl.float64), axis=1), axis=0)
    out = cand_ptr + row.to(tl.int64) * ROW_CAND + chunk * CAP
    key = tl.where(valid, _pack(_ordered(z), offs), I64_MIN)
    cnt = tl.zeros([], tl.int32) + 1
    tau = tl.zeros([], tl.int32) + I32_MAX
    if mode == 2:  # plain sampling: this chunk's Gumbel winner
        k0, k1 = _row_keys(ip_ptr, row)
        score = tl.where(valid, z + _gumbel(offs, k0, k1), float("-inf"))
        best = tl.max(tl.max(tl.where(valid, _pack(_ordered(score), offs), I64_MIN), 1), 0)
        tl.store(out, best)
    elif mode == 0:  # greedy: this chunk's arg-max
        tl.store(out, tl.max(tl.max(key, axis=1), axis=0))
    else:
        o = _ordered(z)
        fin = valid & (z > float("-inf"))
        tau_f = tl.min(tl.topk(gmax, CAND), axis=0)  # CAND-th largest group max
        tau = tl.where(tau_f > float("-inf"), _ordered(tau_f) - 1, ORD_NEG_INF)
        cnt = tl.sum(tl.sum((fin & (o > tau)).to(tl.int32), axis=1), axis=0)
        if cnt > CAP:  # many ties: smallest t with count(o > t) <= CAP, by bisection
            lo = tau.to(tl.int64)
            hi = _ordered(m_c).to(tl.int64)
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                c_mid = tl.sum(tl.sum((fin & (o > mid.to(tl.int32))).to(tl.int32), 1), 0)
                lo = tl.where(c_mid > CAP, mid, lo)
                hi = tl.where(c_mid > CAP, hi, mid)
            tau = hi.to(tl.int32)
        sel = (fin & (o > tau)).to(tl.int32)
        per_g = tl.sum(sel, axis=1)
        cnt = tl.sum(per_g, axis=0)
        slot = (tl.cumsum(per_g, axis=0) - per_g)[:, None] + tl.cumsum(sel, axis=1) - 1
        tl.store(out + slot, key, mask=sel != 0)  # compacted: every finite token with o > tau
    st = stats_ptr + (row * P + chunk) * 4
    tl.store(st, m_c.to(tl.float64))
    tl.store(st + 1, s_c)
    tl.store(st + 2, cnt.to(tl.float64))
    tl.store(st + 3, tau.to(tl.float64))


@triton.jit
def _stage1(
    x_ptr, stride_x, fp_ptr, ip_ptr, stats_ptr, cand_ptr, V, P, ROW_CAND,
    GS: tl.constexpr, NG: tl.constexpr, CAND: tl.constexpr, CAP: tl.constexpr,
):  # fmt: skip
    _chunk_stats(x_ptr, stride_x, fp_ptr, ip_ptr, stats_ptr, cand_ptr, V, P, ROW_CAND,
                 tl.program_id(0), tl.program_id(1), GS, NG, CAND, CAP)  # fmt: skip


@triton.jit
def _count_mass(x_ptr, row_off, V, temp, thr, m_safe, EXACT: tl.constexpr, TILE: tl.constexpr):
    """Count and float64 sum of exp(z - m) over tokens whose ordered key is >= thr."""
    cnt = tl.zeros([TILE], dtype=tl.int32)
    mass = tl.zeros([TILE], dtype=tl.float64)
    for start in range(0, V, TILE):
        offs = start + tl.arange(0, TILE)
        valid = offs < V
        x = tl.load(x_ptr + row_off + offs, mask=valid, other=float("-inf"))
        z = _scale(x.to(tl.float32), temp)
        hit = valid & (_ordered(z) >= thr)
        cnt += hit.to(tl.int32)
        mass += tl.where(hit, _exp(z - m_safe, EXACT), 0.0).to(tl.float64)
    return tl.sum(cnt, axis=0), tl.sum(mass, axis=0)


@triton.jit
def _bisect(x_ptr, row_off, V, temp, m_safe, lo, hi, need, floor, BY_MASS: tl.constexpr,
            EXACT: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """Largest ordered key t in [lo, hi) with count (or mass) of z >= max(t, floor) >= need.

    The caller guarantees the predicate holds at lo and fails at hi.
    """
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        thr = tl.maximum(mid, floor).to(tl.int32)
        cnt, mass = _count_mass(x_ptr, row_off, V, temp, thr, m_safe, EXACT, TILE)
        if BY_MASS:
            ok = mass >= need
        else:
            ok = cnt >= need
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo.to(tl.int32)


@triton.jit
def _fallback(x_ptr, row_off, V, temp, kk, pp, mp, m_safe, k_hi, top_ord, k0, k1,
              EXACT: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """Exact thresholds by bisection over ordered keys, then a Gumbel pass over the row.

    k_hi: an ordered key where count(z >= k_hi) < k is known. Returns (token, threshold key).
    """
    t_k = ORD_NEG_INF + tl.zeros([], tl.int32)
    if kk > 0:  # largest t with count(z >= t) >= k
        t_k = _bisect(x_ptr, row_off, V, temp, m_safe, t_k, k_hi, kk, t_k, False, EXACT, TILE)
    t_p = ORD_NEG_INF + tl.zeros([], tl.int32)
    if pp < 1.0:  # largest t with mass(z >= max(t, t_k)) >= p * mass(z >= t_k)
        _, z_k = _count_mass(x_ptr, row_off, V, temp, t_k, m_safe, EXACT, TILE)
        need = pp.to(tl.float64) * z_k
        t_p = _bisect(x_ptr, row_off, V, temp, m_safe, t_k, top_ord + 1, need, t_k, True, EXACT,
                      TILE)  # fmt: skip
    thr = tl.maximum(t_k, t_p)
    best = tl.zeros([], tl.int64) + I64_MIN
    for start in range(0, V, TILE):
        offs = start + tl.arange(0, TILE)
        valid = offs < V
        x = tl.load(x_ptr + row_off + offs, mask=valid, other=float("-inf"))
        z = _scale(x.to(tl.float32), temp)
        keep = valid & (_ordered(z) >= thr) & (_exp(z - m_safe, EXACT) >= mp)
        score = z + _gumbel(offs, k0, k1)
        best = tl.maximum(best, tl.max(tl.where(keep, _pack(_ordered(score), offs), I64_MIN), 0))
    return (4294967295 - (best & 4294967295)).to(tl.int32), thr


@triton.jit
def _merge_row(
    x_ptr, stride_x, fp_ptr, ip_ptr, stats_ptr, cand_ptr, tok_ptr, aux_ptr, V, P, ROW_CAND, row,
    P_PAD: tl.constexpr, CAP: tl.constexpr, CAP2: tl.constexpr, EXACT: tl.constexpr,
    TILE: tl.constexpr, FALLBACK: tl.constexpr, CG: tl.constexpr,
):  # fmt: skip
    """Stage 2's work on row `row`: merge its P chunks, write token, threshold and path.

    CG: the chunks were written by other programs of this launch (one-launch path).
    """
    temp = tl.load(fp_ptr + row * 4)
    mode = tl.load(ip_ptr + row * 5 + 1)
    pi = tl.arange(0, P_PAD)
    pv = pi < P
    st = stats_ptr + (row * P + pi) * 4
    m_c = load_cg(st, pv, float("-inf"), CG).to(tl.float32)
    s_c = load_cg(st + 1, pv, 0.0, CG)
    cnt_c = load_cg(st + 2, pv, 0.0, CG).to(tl.int32)
    tau_c = load_cg(st + 3, pv, I32_MIN, CG).to(tl.int32)
    m = tl.max(m_c, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    z_all = tl.sum(s_c * tl.exp((m_c - m_safe).to(tl.float64)), axis=0)
    base = cand_ptr + row.to(tl.int64) * ROW_CAND
    first = tl.max(load_cg(base + pi * CAP, pv, I64_MIN, CG), axis=0)
    tok = (4294967295 - (first & 4294967295)).to(tl.int32)  # greedy and plain rows
    tok = tl.where((mode == 1) & (m == float("-inf")), 0, tok)  # nothing finite: token 0
    thr_ord = ORD_NEG_INF + tl.zeros([], tl.int32)
    path = tl.zeros([], tl.int32)
    if (mode == 1) & (m > float("-inf")):
        fp = fp_ptr + row * 4
        pp = tl.load(fp + 1)
        mp = tl.load(fp + 2)
        kk = tl.load(ip_ptr + row * 5)
        kk = tl.where(kk >= V, 0, kk)
        k0, k1 = _row_keys(ip_ptr, row)
        g = tl.max(tau_c, axis=0)  # every finite token with key > g is a candidate
        c = tl.arange(0, CAP)[None, :]
        ck = load_cg(base + pi[:, None] * CAP + c, pv[:, None] & (c < cnt_c[:, None]), I64_MIN, CG)
        o2 = (ck >> 32).to(tl.int32)
        n_c = tl.sum(tl.sum((o2 > g).to(tl.int32), axis=1), axis=0)
        exact_total = (g == ORD_NEG_INF) & (n_c <= CAP2)  # all finite tokens are candidates
        if n_c > CAP2:  # raise g (the set above it stays complete) until <= CAP2 tokens remain
            lo = g.to(tl.int64)
            hi = _ordered(m).to(tl.int64)
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                c_mid = tl.sum(tl.sum((o2 > mid.to(tl.int32)).to(tl.int32), axis=1), axis=0)
                lo = tl.where(c_mid > CAP2, mid, lo)
                hi = tl.where(c_mid > CAP2, hi, mid)
            g = hi.to(tl.int32)
        sel = (o2 > g).to(tl.int32)
        per_p = tl.sum(sel, axis=1)
        n_c = tl.sum(per_p, axis=0)
        k_ok = (kk == 0) | (kk <= n_c) | exact_total
        if k_ok:
            slot = (tl.cumsum(per_p, axis=0) - per_p)[:, None] + tl.cumsum(sel, axis=1) - 1
            scratch = base + P * CAP
            tl.store(scratch + slot, ck, mask=sel != 0)
            tl.debug_barrier()
            q = tl.arange(0, CAP2)
            s = tl.sort(tl.load(scratch + q, mask=q < n_c, other=I64_MIN), descending=True)
            ordv = (s >> 32).to(tl.int32)
            idx = (4294967295 - (s & 4294967295)).to(tl.int32)
            real = q < n_c
            v = tl.where(real, _unordered(ordv), float("-inf"))
            e = _exp(v - m_safe, EXACT)
            k_cut = (kk > 0) & (kk <= n_c)
            t_k = tl.sum(tl.where(q == kk - 1, ordv, 0), axis=0)
            t_k = tl.where(k_cut, t_k, ORD_NEG_INF)
            cum = tl.cumsum(tl.where(real & (ordv >= t_k), e, 0.0).to(tl.float64), axis=0)
            z_k = tl.where(k_cut | exact_total, tl.max(cum, axis=0), z_all)
            j = tl.min(tl.where(cum >= pp.to(tl.float64) * z_k, q, CAP2), axis=0)
            p_cut = (pp < 1.0) & (j < n_c)
            t_p = tl.sum(tl.where(q == j, ordv, 0), axis=0)
            t_p = tl.where(p_cut, t_p, ORD_NEG_INF)
            g_val = _unordered(tl.maximum(g, ORD_NEG_INF))
            mp_cut = (mp > 0.0) & (_exp(g_val - m_safe, EXACT) < mp)
            if k_cut | p_cut | mp_cut | exact_total:
                thr_ord = tl.maximum(t_k, t_p)
                keep = real & (ordv >= thr_ord) & (e >= mp)
                score = v + _gumbel(idx, k0, k1)
                best = tl.max(tl.where(keep, _pack(_ordered(score), idx), I64_MIN), axis=0)
                tok = (4294967295 - (best & 4294967295)).to(tl.int32)
            else:
                path = tl.zeros([], tl.int32) + 1
        else:
            path = tl.zeros([], tl.int32) + 1
        if path == 1:
            if FALLBACK:
                k_hi = tl.where(kk > n_c, g + 1, _ordered(m) + 1)  # count(z >= g + 1) = n_c
                tok, thr_ord = _fallback(x_ptr, row.to(tl.int64) * stride_x, V, temp, kk, pp,
                                         mp, m_safe, k_hi, _ordered(m), k0, k1, EXACT,
                                         TILE)  # fmt: skip
            else:
                tok = tl.zeros([], tl.int32) - 1  # left to the caller (see fused_sample)
    thr = tl.where(thr_ord > ORD_NEG_INF, _unordered(thr_ord), float("-inf"))
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(aux_ptr + row * 2, thr)
    tl.store(aux_ptr + row * 2 + 1, path.to(tl.float32))


@triton.jit
def _stage2(
    x_ptr, stride_x, fp_ptr, ip_ptr, stats_ptr, cand_ptr, tok_ptr, aux_ptr, V, P, ROW_CAND,
    P_PAD: tl.constexpr, CAP: tl.constexpr, CAP2: tl.constexpr, EXACT: tl.constexpr,
    TILE: tl.constexpr, FALLBACK: tl.constexpr,
):  # fmt: skip
    _merge_row(x_ptr, stride_x, fp_ptr, ip_ptr, stats_ptr, cand_ptr, tok_ptr, aux_ptr, V, P,
               ROW_CAND, tl.program_id(0), P_PAD, CAP, CAP2, EXACT, TILE, FALLBACK,
               False)  # fmt: skip


@triton.jit
def _fused_one_launch(
    x_ptr, stride_x, fp_ptr, ip_ptr, stats_ptr, cand_ptr, tok_ptr, aux_ptr, arrived_ptr, V, P,
    ROW_CAND, GS: tl.constexpr, NG: tl.constexpr, CAND: tl.constexpr, CAP: tl.constexpr,
    P_PAD: tl.constexpr, CAP2: tl.constexpr, EXACT: tl.constexpr, TILE: tl.constexpr,
    FALLBACK: tl.constexpr,
):  # fmt: skip
    """Grid (B, P): stage 1 on each chunk; the last program of a row to arrive merges it."""
    row = tl.program_id(0)
    _chunk_stats(x_ptr, stride_x, fp_ptr, ip_ptr, stats_ptr, cand_ptr, V, P, ROW_CAND, row,
                 tl.program_id(1), GS, NG, CAND, CAP)  # fmt: skip
    tl.debug_barrier()  # every thread's stats / candidate stores are issued before the release
    prev = tl.atomic_add(arrived_ptr + row, 1, sem="acq_rel")
    tl.debug_barrier()
    if prev == P - 1:  # all P chunks of the row are in: this program finishes it
        tl.store(arrived_ptr + row, 0)  # ready for the next call (or graph replay)
        _merge_row(x_ptr, stride_x, fp_ptr, ip_ptr, stats_ptr, cand_ptr, tok_ptr, aux_ptr, V, P,
                   ROW_CAND, row, P_PAD, CAP, CAP2, EXACT, TILE, FALLBACK, True)  # fmt: skip


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def one_launch_default(batch: int) -> bool:
    """fused_sample's choice when one_launch is None: one launch when B <= ONE_LAUNCH_MAX_BATCH
    (at larger B the merged kernel loses to two launches on the H200)."""
    return batch <= ONE_LAUNCH_MAX_BATCH


def launch_config(batch: int, vocab: int, max_top_k: int) -> tuple[int, int, int]:
    """(BLOCK, CAND, num_warps) of stage 1: tokens per program, guaranteed candidates per chunk
    (k <= CAND always takes the candidate path) and warps (about 16 tokens per thread)."""
    cand = min(64, max(32, _pow2(max_top_k + 1))) if 0 < max_top_k < vocab else 32
    block = 4096 if batch <= 32 else 8192
    block = max(4 * cand * 8, min(block, _pow2(vocab)))
    return block, cand, max(4, min(16, block // 512))


def pack_params(
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    rng: torch.Tensor,
    mode: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row parameters [B] (rng [B, 3]) -> (fparams float32 [B, 4], iparams int32 [B, 5])."""
    zero = torch.zeros_like(temperature, dtype=torch.float32)
    fp = torch.stack([temperature.float(), top_p.float(), min_p.float(), zero], dim=1)
    ip = torch.cat([top_k.int().unsqueeze(1), mode.int().unsqueeze(1), rng.int()], dim=1)
    return fp.contiguous(), ip.contiguous()


_WORKSPACE: dict[tuple[torch.device, int, int, int], tuple[torch.Tensor, ...]] = {}


def _workspace(dev: torch.device, b: int, p: int, row_cand: int) -> tuple[torch.Tensor, ...]:
    """(stats f64 [B*P*4], cand i64 [B*row_cand], aux f32 [B*2], arrived i32 [B]) reused per
    (device, B, P, row_cand): calls must not overlap on different streams. ``arrived`` counts
    the chunks of a row done in the one-launch path; it starts at zero and the program that
    merges the row puts it back to zero, so it is zero between calls (graph replays too). Make
    the first call of a shape outside CUDA graph capture (the usual warm-up): zeros made
    during capture are only written when the graph replays."""
    key = (dev, b, p, row_cand)
    if key not in _WORKSPACE:
        _WORKSPACE[key] = (
            torch.empty(b * p * 4, dtype=torch.float64, device=dev),
            torch.empty(b * row_cand, dtype=torch.int64, device=dev),
            torch.empty(b * 2, dtype=torch.float32, device=dev),
            torch.zeros(b, dtype=torch.int32, device=dev),
        )
    return _WORKSPACE[key]


class _Plan(NamedTuple):
    """Everything fused_sample derives from the shapes and overrides (see _plan)."""

    grid1: tuple[int, int]  # (B, P): stage 1 and the one-launch kernel
    grid2: tuple[int]  # (B,): stage 2
    p: int
    row_cand: int
    gs: int
    ng: int
    cand: int
    cap: int
    cap2: int
    p_pad: int
    num_warps: int  # stage 1's, also the one-launch kernel's
    one_launch: bool  # the default path (one_launch_default)
    stats: torch.Tensor
    cands: torch.Tensor
    aux: torch.Tensor
    arrived: torch.Tensor


_PLANS: dict[tuple, _Plan] = {}


def _plan(dev: torch.device, b: int, v: int, max_top_k: int, block: int | None,
          num_warps: int | None, cand: int | None, cap2: int) -> _Plan:  # fmt: skip
    auto_block, auto_cand, auto_warps = launch_config(b, v, max_top_k)
    cand = cand or auto_cand
    ng = 4 * cand
    gs = max(1, (block or auto_block) // ng)
    cap = 4 * cand
    p = triton.cdiv(v, ng * gs)
    cap2 = min(cap2, _pow2(p * cap))
    row_cand = p * cap + cap2
    ws = _workspace(dev, b, p, row_cand)
    return _Plan((b, p), (b,), p, row_cand, gs, ng, cand, cap, cap2, _pow2(p),
                 num_warps or auto_warps, one_launch_default(b), *ws)  # fmt: skip


def fused_sample(
    logits: torch.Tensor,
    fparams: torch.Tensor,
    iparams: torch.Tensor,
    max_top_k: int = 0,
    return_aux: bool = False,
    block: int | None = None,
    num_warps: int | None = None,
    cand: int | None = None,
    cap2: int = CAP2,
    fallback: bool = True,
    one_launch: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    logits float32/fp16/bf16 [B, V] (unit stride on V); fparams float32 [B, 4] and iparams
    int32 [B, 5] from :func:`pack_params` (mode 0 greedy, 1 filtered, 2 temperature only);
    max_top_k: host-side max of top_k (sizes the candidate lists; larger k stays exact).
    block / num_warps / cand override stage 1's tokens per program, warps and guaranteed
    candidates per chunk, cap2 the sorted candidates of stage 2 (tests use small values).
    Returns token ids int64 [B]; with return_aux also the threshold t = max(t_k, t_p) float32
    [B] (-inf when off) and the path int32 [B] (0 candidates, 1 bisection fallback).
    fallback=False skips the in-kernel bisection (one program per row, ~32 passes over it:
    3.7 ms for 16 x 248,320 on the H200) and returns -1 for those rows instead, for the caller
    to sample them another way (kvcap.sampling.Sampler uses the sort-based twin).
    one_launch: True runs one kernel (the last program of a row merges it), False the two
    launches; None picks one launch when B <= ONE_LAUNCH_MAX_BATCH. Results are identical.
    """
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    dev = logits.device
    key = (dev, b, v, max_top_k, block, num_warps, cand, cap2)
    pl = _PLANS.get(key)
    if pl is None:
        if len(_PLANS) >= 4096:  # many (B, max_top_k) seen: start over (workspaces are kept)
            _PLANS.clear()
        pl = _PLANS[key] = _plan(*key)
    tok = torch.empty(b, dtype=torch.int64, device=dev)
    if pl.one_launch if one_launch is None else one_launch:
        _fused_one_launch[pl.grid1](
            logits, logits.stride(0), fparams, iparams, pl.stats, pl.cands, tok, pl.aux,
            pl.arrived, v, pl.p, pl.row_cand, GS=pl.gs, NG=pl.ng, CAND=pl.cand, CAP=pl.cap,
            P_PAD=pl.p_pad, CAP2=pl.cap2, EXACT=_EXACT, TILE=TILE, FALLBACK=fallback,
            num_warps=pl.num_warps, **FP_FUSION,
        )  # fmt: skip
    else:
        _stage1[pl.grid1](
            logits, logits.stride(0), fparams, iparams, pl.stats, pl.cands, v, pl.p,
            pl.row_cand, GS=pl.gs, NG=pl.ng, CAND=pl.cand, CAP=pl.cap, num_warps=pl.num_warps,
            **FP_FUSION,
        )  # fmt: skip
        _stage2[pl.grid2](
            logits, logits.stride(0), fparams, iparams, pl.stats, pl.cands, tok, pl.aux, v,
            pl.p, pl.row_cand, P_PAD=pl.p_pad, CAP=pl.cap, CAP2=pl.cap2, EXACT=_EXACT,
            TILE=TILE, FALLBACK=fallback, num_warps=STAGE2_WARPS, **FP_FUSION,
        )  # fmt: skip
    if return_aux:
        a = pl.aux.view(b, 2)
        return tok, a[:, 0].clone(), a[:, 1].to(torch.int32)
    return tok
