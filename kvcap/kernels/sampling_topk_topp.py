"""Fused temperature + top-k + top-p + min-p sampling in two Triton launches.

Semantics: ``kvcap/sampling/reference.py`` (this module imports nothing else of kvcap).

Stage 1, grid (P, B), P = cdiv(V, BLOCK) programs per row: each program scales one BLOCK of
logits and writes its chunk max and sum of exp (online-softmax partials) and
  * filtered rows: its CAND largest tokens as packed int64 keys
    ``(ordered float bits << 32) | (2**32 - 1 - index)`` (larger value first, lower index on
    ties) via ``tl.topk``;
  * greedy rows: its single largest key;
  * plain rows (temperature only): its best Gumbel score and token index.
Stage 2, grid (B,): one program per row merges the partials. For filtered rows it sorts the
P * CAND candidates; every token strictly above G = max over chunks of each chunk's CAND-th
value is present, so when the final threshold lies above G (always for top-k < CAND) the exact
thresholds and the Gumbel race are computed on the candidates. Otherwise (large top-p nucleus,
large k, low min-p) the same program falls back to an exact bisection over the ordered float
bits of the whole row (count for top-k, mass for top-p), then a Gumbel pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)
I32_MIN = tl.constexpr(-2147483648)
I64_MIN = tl.constexpr(-9223372036854775808)
ORD_NEG_INF = tl.constexpr(-2139095041)  # ordered key of -inf
MAX_CANDIDATES = 4096  # P_PAD * CAND handled by one stage-2 program


@triton.jit
def _fmix32(h):
    """MurmurHash3 finaliser on a uint32 tensor."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _row_keys(rng_ptr, row):
    """uint32 hash keys of one row from rng int32 [B, 3] (seed lo, seed hi, step)."""
    lo = tl.load(rng_ptr + row * 3).to(tl.uint32, bitcast=True)
    hi = tl.load(rng_ptr + row * 3 + 1).to(tl.uint32, bitcast=True)
    step = tl.load(rng_ptr + row * 3 + 2).to(tl.uint32, bitcast=True)
    k0 = _fmix32(lo ^ _fmix32(step ^ 0x9E3779B9))
    k1 = _fmix32(hi ^ k0 ^ 0x7F4A7C15)
    return k0, k1


@triton.jit
def _gumbel(idx, k0, k1):
    """float32 Gumbel noise of token indices idx (int32) for row keys k0, k1."""
    h = _fmix32(_fmix32(idx.to(tl.uint32, bitcast=True) ^ k0) ^ k1)
    u = ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08
    return -tl.log(-tl.log(u))


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
def _stage1(
    x_ptr, stride_x, temp_ptr, mode_ptr, rng_ptr,
    part_m_ptr, part_s_ptr, cand_ptr, gscore_ptr, gidx_ptr,
    V, P,
    BLOCK: tl.constexpr, CAND: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = offs < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=valid, other=float("-inf"))
    temp = tl.load(temp_ptr + row)
    mode = tl.load(mode_ptr + row)
    z = _scale(x.to(tl.float32), temp)
    m_c = tl.max(z, axis=0)
    m_safe = tl.where(m_c == float("-inf"), 0.0, m_c)
    s_c = tl.sum(tl.exp(z - m_safe), axis=0)
    out = row * P + chunk
    tl.store(part_m_ptr + out, m_c)
    tl.store(part_s_ptr + out, s_c)
    if mode == 2:
        k0, k1 = _row_keys(rng_ptr, row)
        score = tl.where(valid, z + _gumbel(offs, k0, k1), float("-inf"))
        best = tl.max(score, axis=0)
        bidx = tl.min(tl.where(valid & (score == best), offs, 2147483647), axis=0)
        tl.store(gscore_ptr + out, best)
        tl.store(gidx_ptr + out, bidx)
    else:
        key = (_ordered(z).to(tl.int64) << 32) + (4294967295 - offs.to(tl.int64))
        key = tl.where(valid, key, I64_MIN)
        c = tl.arange(0, CAND)
        if mode == 1:
            top = tl.topk(key, CAND)
        else:
            top = tl.where(c == 0, tl.max(key, axis=0), I64_MIN)
        tl.store(cand_ptr + out.to(tl.int64) * CAND + c, top)


@triton.jit
def _count_mass(x_ptr, row_off, V, temp, thr, m_safe, TILE: tl.constexpr):
    """Count and sum of exp(z - m) over tokens whose ordered key is >= thr (full-row pass)."""
    cnt = tl.zeros([TILE], dtype=tl.int32)
    mass = tl.zeros([TILE], dtype=tl.float32)
    for start in range(0, V, TILE):
        offs = start + tl.arange(0, TILE)
        valid = offs < V
        x = tl.load(x_ptr + row_off + offs, mask=valid, other=float("-inf"))
        z = _scale(x.to(tl.float32), temp)
        hit = valid & (_ordered(z) >= thr)
        cnt += hit.to(tl.int32)
        mass += tl.where(hit, tl.exp(z - m_safe), 0.0)
    return tl.sum(cnt, axis=0), tl.sum(mass, axis=0)


@triton.jit
def _bisect(x_ptr, row_off, V, temp, m_safe, lo, hi, need, floor, BY_MASS: tl.constexpr,
            TILE: tl.constexpr):  # fmt: skip
    """Largest ordered key t in [lo, hi) with count (or mass) of z >= max(t, floor) >= need."""
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        thr = tl.maximum(mid, floor).to(tl.int32)
        cnt, mass = _count_mass(x_ptr, row_off, V, temp, thr, m_safe, TILE)
        if BY_MASS:
            ok = mass >= need
        else:
            ok = cnt >= need
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo.to(tl.int32)


@triton.jit
def _fallback(x_ptr, row_off, V, temp, kk, pp, mp, m_safe, top_ord, k0, k1, TILE: tl.constexpr):
    """Exact thresholds by bisection over ordered keys, then a Gumbel pass.

    Returns (token int32, threshold ordered key int32).
    """
    t_k = ORD_NEG_INF + tl.zeros([], tl.int32)
    if kk > 0:  # largest t with count(z >= t) >= k
        t_k = _bisect(x_ptr, row_off, V, temp, m_safe, t_k, top_ord + 1, kk, t_k, False, TILE)
    t_p = ORD_NEG_INF + tl.zeros([], tl.int32)
    if pp < 1.0:  # largest t with mass(z >= max(t, t_k)) >= p * mass(z >= t_k)
        _, z_k = _count_mass(x_ptr, row_off, V, temp, t_k, m_safe, TILE)
        t_p = _bisect(x_ptr, row_off, V, temp, m_safe, t_k, top_ord + 1, pp * z_k, t_k, True, TILE)
    thr = tl.maximum(t_k, t_p)
    best = float("-inf")
    best_idx = 2147483647
    for start in range(0, V, TILE):
        offs = start + tl.arange(0, TILE)
        valid = offs < V
        x = tl.load(x_ptr + row_off + offs, mask=valid, other=float("-inf"))
        z = _scale(x.to(tl.float32), temp)
        keep = valid & (_ordered(z) >= thr) & (tl.exp(z - m_safe) >= mp)
        score = tl.where(keep, z + _gumbel(offs, k0, k1), float("-inf"))
        tile_best = tl.max(score, axis=0)
        tile_idx = tl.min(tl.where(keep & (score == tile_best), offs, 2147483647), axis=0)
        better = tile_best > best
        best_idx = tl.where(better, tile_idx, best_idx)
        best = tl.where(better, tile_best, best)
    return best_idx, thr


@triton.jit
def _stage2(
    x_ptr, stride_x, temp_ptr, topk_ptr, topp_ptr, minp_ptr, mode_ptr, rng_ptr,
    part_m_ptr, part_s_ptr, cand_ptr, gscore_ptr, gidx_ptr, tok_ptr, thr_ptr, path_ptr,
    V, P,
    P_PAD: tl.constexpr, CAND: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    mode = tl.load(mode_ptr + row)
    temp = tl.load(temp_ptr + row)
    pi = tl.arange(0, P_PAD)
    pv = pi < P
    pm = tl.load(part_m_ptr + row * P + pi, mask=pv, other=float("-inf"))
    ps = tl.load(part_s_ptr + row * P + pi, mask=pv, other=0.0)
    m = tl.max(pm, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    z_all = tl.sum(ps * tl.exp(pm - m_safe), axis=0)
    tok = tl.zeros([], tl.int32)
    thr_ord = ORD_NEG_INF + tl.zeros([], tl.int32)
    path = tl.zeros([], tl.int32)
    if mode == 2:  # plain temperature sampling: merge the chunks' Gumbel winners
        gs = tl.load(gscore_ptr + row * P + pi, mask=pv, other=float("-inf"))
        gi = tl.load(gidx_ptr + row * P + pi, mask=pv, other=2147483647)
        tok = tl.min(tl.where(gs == tl.max(gs, axis=0), gi, 2147483647), axis=0)
    else:
        c = tl.arange(0, CAND)
        ptrs = cand_ptr + (row * P + pi[:, None]).to(tl.int64) * CAND + c[None, :]
        ck = tl.load(ptrs, mask=pv[:, None], other=I64_MIN)
        s = tl.sort(tl.reshape(ck, [P_PAD * CAND]), descending=True)
        ordv = (s >> 32).to(tl.int32)
        idx = (4294967295 - (s & 4294967295)).to(tl.int32)
        first = tl.max(tl.where(tl.arange(0, P_PAD * CAND) == 0, idx, -1), axis=0)
        tok = first  # greedy, and rows whose logits are all -inf
        if (mode == 1) & (m > float("-inf")):
            k0, k1 = _row_keys(rng_ptr, row)
            kk = tl.load(topk_ptr + row)
            kk = tl.where(kk >= V, 0, kk)
            pp = tl.load(topp_ptr + row)
            mp = tl.load(minp_ptr + row)
            # every token with ordered key > g is among the candidates
            g = tl.max(tl.max(tl.where(c[None, :] == CAND - 1, (ck >> 32).to(tl.int32), I32_MIN),
                              axis=1), axis=0)  # fmt: skip
            pos = tl.arange(0, P_PAD * CAND)
            real = ordv > I32_MIN
            v = tl.where(real, _unordered(ordv), float("-inf"))
            e = tl.exp(v - m_safe)
            n_c = tl.sum((ordv > g).to(tl.int32), axis=0)
            t_k = tl.where(kk > 0, tl.sum(tl.where(pos == kk - 1, ordv, 0), axis=0), I32_MIN)
            cum = tl.cumsum(tl.where(real & (ordv >= t_k), e, 0.0), axis=0)
            z_k = tl.where(kk > 0, tl.max(cum, axis=0), z_all)
            j = tl.min(tl.where(cum >= pp * z_k, pos, P_PAD * CAND), axis=0)
            t_p = tl.sum(tl.where(pos == j, ordv, 0), axis=0)
            t_p = tl.where((pp < 1.0) & (j < P_PAD * CAND), t_p, I32_MIN)
            g_val = tl.where(g > I32_MIN, _unordered(g), float("-inf"))
            k_ok = (kk == 0) | (kk <= n_c)
            k_cut = (kk > 0) & (kk <= n_c)
            mp_cut = (mp > 0.0) & (tl.exp(g_val - m_safe) < mp)
            fast = (g == I32_MIN) | (k_ok & (k_cut | (t_p > g) | mp_cut))
            if fast:
                thr_ord = tl.maximum(t_k, t_p)
                keep = real & (ordv >= thr_ord) & (e >= mp)
                score = tl.where(keep, v + _gumbel(idx, k0, k1), float("-inf"))
                best = tl.max(score, axis=0)
                tok = tl.min(tl.where(keep & (score == best), idx, 2147483647), axis=0)
            else:
                row_off = row.to(tl.int64) * stride_x
                top_ord = tl.max(ordv, axis=0)
                tok, thr_ord = _fallback(
                    x_ptr, row_off, V, temp, kk, pp, mp, m_safe, top_ord, k0, k1, TILE
                )
                path = 1 + tl.zeros([], tl.int32)
    thr = tl.where(thr_ord > ORD_NEG_INF, _unordered(thr_ord), float("-inf"))
    tl.store(tok_ptr + row, tok)
    tl.store(thr_ptr + row, thr)
    tl.store(path_ptr + row, path)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def launch_config(batch: int, vocab: int, max_top_k: int) -> tuple[int, int]:
    """(BLOCK, CAND): chunk size per stage-1 program and candidates kept per chunk."""
    cand = min(128, max(16, _pow2(max_top_k + 1))) if 0 < max_top_k < vocab else 32
    block = 4096 if batch <= 8 else 8192
    block = max(cand, min(block, _pow2(vocab)))
    while _pow2(triton.cdiv(vocab, block)) * cand > MAX_CANDIDATES:
        block *= 2
    return block, cand


def fused_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    rng: torch.Tensor,
    mode: torch.Tensor,
    max_top_k: int = 0,
    return_aux: bool = False,
    block: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    logits float32/fp16/bf16 [B, V] (unit stride on V); temperature, top_p, min_p float32 [B];
    top_k int32 [B] (0 = off); rng int32 [B, 3]; mode int32 [B] (0 greedy, 1 filtered, 2 plain);
    max_top_k: host-side max of top_k (sizes the candidate lists; larger k stays exact).
    block / num_warps override the stage-1 chunk size and warps (tests and tuning sweeps).
    Returns token ids int64 [B]; with return_aux also the threshold t = max(t_k, t_p) float32
    [B] (-inf when off) and the path taken int32 [B] (0 candidates, 1 bisection fallback).
    """
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    auto_block, cand = launch_config(b, v, max_top_k)
    block = block or auto_block
    p = triton.cdiv(v, block)
    dev = logits.device
    f32 = torch.empty((4, b * p), dtype=torch.float32, device=dev)
    i32 = torch.empty((3, max(b * p, b)), dtype=torch.int32, device=dev)
    cands = torch.empty((b * p * cand,), dtype=torch.int64, device=dev)
    part_m, part_s, gscore, thr = f32[0], f32[1], f32[2], f32[3, :b]
    gidx, tok, path = i32[0], i32[1, :b], i32[2, :b]
    _stage1[(p, b)](
        logits, logits.stride(0), temperature, mode, rng,
        part_m, part_s, cands, gscore, gidx, v, p,
        BLOCK=block, CAND=cand, num_warps=num_warps or (8 if block >= 8192 else 4),
    )  # fmt: skip
    _stage2[(b,)](
        logits, logits.stride(0), temperature, top_k, top_p, min_p, mode, rng,
        part_m, part_s, cands, gscore, gidx, tok, thr, path, v, p,
        P_PAD=_pow2(p), CAND=cand, TILE=2048, num_warps=8,
    )  # fmt: skip
    if return_aux:
        return tok.to(torch.int64), thr, path
    return tok.to(torch.int64)
