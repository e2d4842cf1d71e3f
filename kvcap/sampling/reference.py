"""Sort-based torch reference ("twin") of the fused sampling kernel.

Exact semantics, shared by this module and ``kvcap/kernels/sampling_topk_topp.py``.
All arithmetic is float32; B = batch rows, V = vocabulary size.

1. Scaled logits ``z``. Greedy rows (temperature 0) keep the raw logits; other rows use
   ``z = logits / temperature`` (IEEE division). NaN becomes ``-inf``, ``+inf`` is clamped to
   the largest finite float32, and ``-0.0`` becomes ``+0.0``. ``m = max(z)``;
   ``e = exp(z - m)`` is the unnormalised probability (``m`` replaced by 0 when the whole row
   is ``-inf``).
2. Top-k (``k`` in ``[1, V)``; ``k <= 0`` or ``k >= V`` is off): ``t_k`` is the k-th largest
   value of ``z``; every token with ``z >= t_k`` is kept, so **all ties at the k-th value are
   kept** (the kept set can exceed k).
3. Top-p (``p < 1``; ``p >= 1`` is off), on the distribution left by top-k: sort the kept ``e``
   in descending order, ``c`` = running sum in float64, ``Z`` = total (``c[-1]`` here; the
   kernel sums the same float32 terms in float64 in another order). ``j`` = first position
   with ``c[j] >= p * Z`` (p widened to float64), ``t_p = z_sorted[j]``: the smallest prefix
   whose mass reaches p, **boundary token included**, and every token tied with the boundary
   value too (``z >= t_p``).
4. Min-p (``min_p > 0``): keep tokens with ``e >= min_p`` (that is ``p_i >= min_p * p_max``).
   It is applied last and does not change the mass used by top-p.
   Kept set: ``z >= max(t_k, t_p)`` and ``e >= min_p``; the arg-max token is always kept.
5. Sampling (Gumbel-max with counter-based uniforms): for token ``i`` of a row with
   ``seed`` (taken mod 2**64) and ``step`` (mod 2**32), ``h = hash(seed, step, i)`` (32 bits,
   :func:`token_hash`), ``u = ((h >> 9) + 0.5) * 2**-23``: 23 random bits, every value exact
   in float32 and strictly inside (0, 1) (the 24-bit form rounded its top value to 1.0, whose
   noise is +inf: that token won whatever its probability, about once in 340 steps at a 49K
   vocabulary, and a masked token's -inf + inf was NaN, which arg-max picks),
   ``score = z - log(-log(u))`` on kept tokens; the token with the largest score wins, the
   lowest index on ties. A token's random number depends only on its own (seed, step, index),
   never on the other rows of the batch. Greedy rows take ``argmax(z)`` (lowest index on
   ties). A row whose logits are all ``-inf``/NaN returns token 0.

The kernel reproduces these rules bit for bit (on CUDA it uses the CUDA math library's exp, as
torch does) except where a boundary test lands within rounding: the float64 top-p sums differ in
order (relative 1e-16), and for top-p without top-k the kernel's total mass comes from per-chunk
partial sums (relative ~1e-7).
"""

from __future__ import annotations

import torch

FLT_MAX = 3.4028234663852886e38
MASK32 = 0xFFFFFFFF
_M1 = 0x85EBCA6B
_M2 = 0xC2B2AE35
_STEP_SALT = 0x9E3779B9
_HI_SALT = 0x7F4A7C15


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for int64 ``h`` in [0, 2**32) without int64 overflow."""
    lo = h & 0xFFFF
    hi = h >> 16
    return ((((hi * c) & 0xFFFF) << 16) + lo * c) & MASK32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 32-bit finaliser on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, _M1)
    h = h ^ (h >> 13)
    h = _mul32(h, _M2)
    return h ^ (h >> 16)


def row_keys(rng: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row hash keys from ``rng``: int32 [B, 3] = (seed low, seed high, step) bit patterns.

    Returns two int64 [B, 1] tensors holding uint32 values.
    """
    r = rng.to(torch.int64) & MASK32
    lo, hi, step = r[:, 0:1], r[:, 1:2], r[:, 2:3]
    k0 = fmix32(lo ^ fmix32(step ^ _STEP_SALT))
    k1 = fmix32(hi ^ k0 ^ _HI_SALT)
    return k0, k1


def token_hash(rng: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """32-bit hash of (seed, step, token index). rng int32 [B, 3]; idx int64 [B, N] or [N]."""
    k0, k1 = row_keys(rng)
    return fmix32(fmix32(idx.to(torch.int64) ^ k0) ^ k1)


def gumbel_noise(rng: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """float32 Gumbel noise ``-log(-log(u))`` for each (row, token index); shape of idx/[B, N]."""
    return -torch.log(-torch.log(uniform_from_hash(token_hash(rng, idx))))


def uniform_from_hash(h: torch.Tensor) -> torch.Tensor:
    """float32 in (0, 1) from a 32-bit hash: 23 bits plus a half step, exact in float32."""
    return ((h >> 9) & 0x7FFFFF).to(torch.float32).add_(0.5).mul_(2.0**-23)


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Step 1: logits float32 [B, V], temperature float32 [B] -> z float32 [B, V]."""
    x = logits.float()
    t = temperature.float().unsqueeze(1)
    z = torch.where(t > 0, x / torch.where(t > 0, t, torch.ones_like(t)), x)
    z = torch.nan_to_num(z, nan=float("-inf"), posinf=FLT_MAX, neginf=float("-inf"))
    z = torch.clamp(z, max=FLT_MAX)
    return torch.where(z == 0, torch.zeros_like(z), z)


def _sorted_desc(z: torch.Tensor, k: torch.Tensor, k_on: torch.Tensor,
                 compact: bool) -> torch.Tensor:
    """z sorted in descending order along V, or (compact, every row with top-k on) only the
    prefix that holds every token with z >= t_k, ties included: the same values as the full
    sort's prefix, and everything past it has no mass in step 3."""
    v = z.shape[1]
    if compact and bool(k_on.all()):
        t_k = torch.topk(z, int(k.max()), dim=1).values.gather(1, k.unsqueeze(1) - 1)
        n = int((z >= t_k).sum(dim=1).max())
        if n < v:
            return torch.topk(z, n, dim=1).values
    return torch.sort(z, dim=1, descending=True).values


def thresholds(
    z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, compact: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2-3: z float32 [B, V], top_k int [B], top_p float32 [B].

    Returns (t, e): t float32 [B] = max(t_k, t_p) (-inf when neither applies), e float32 [B, V].
    compact=True may size the sort by the data (reads values back: a sync on CUDA).
    """
    b, v = z.shape
    neg_inf = torch.full((b,), float("-inf"), device=z.device)
    m = z.max(dim=1).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(z - m.unsqueeze(1))
    k = top_k.to(torch.int64)
    k_on = (k > 0) & (k < v)
    zs = _sorted_desc(z, k, k_on, compact)
    n = zs.shape[1]
    t_k = torch.where(k_on, zs.gather(1, (k.clamp(1, n) - 1).unsqueeze(1)).squeeze(1), neg_inf)
    es = torch.where(zs >= t_k.unsqueeze(1), torch.exp(zs - m.unsqueeze(1)), 0.0)
    cum = torch.cumsum(es.double(), dim=1)
    p = top_p.float()
    j = (cum < (p.double() * cum[:, -1]).unsqueeze(1)).sum(dim=1).clamp(max=n - 1)
    t_p = torch.where(p < 1.0, zs.gather(1, j.unsqueeze(1)).squeeze(1), neg_inf)
    return torch.maximum(t_k, t_p), e


def keep_mask(
    z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    compact: bool = False,
) -> torch.Tensor:
    """Steps 2-4: bool [B, V], True where the token may be sampled (z from scaled_logits)."""
    t, e = thresholds(z, top_k, top_p, compact)
    return (z >= t.unsqueeze(1)) & (e >= min_p.float().unsqueeze(1))


def reference_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    rng: torch.Tensor,
    compact: bool | None = None,
) -> torch.Tensor:
    """Step 5. logits float32 [B, V]; per-row params [B]; rng int32 [B, 3] -> int64 [B].

    compact (default: on CPU) computes the same thing with data-sized work: a partial sort
    when every row has top-k, and the random numbers of kept tokens only (on CPU ~10x faster
    at 49K tokens per row). It reads values back, so on CUDA it is for callers that have
    synced anyway (the engine's host fallback)."""
    z = scaled_logits(logits, temperature)
    if compact is None:
        compact = z.device.type == "cpu"
    keep = keep_mask(z, top_k, top_p, min_p, compact)
    if compact:
        rows, cols = keep.nonzero(as_tuple=True)
        score = torch.full_like(z, float("-inf"))
        score[rows, cols] = z[rows, cols] + gumbel_noise(rng[rows], cols.unsqueeze(1))[:, 0]
    else:
        idx = torch.arange(z.shape[1], device=z.device)
        score = torch.where(keep, z + gumbel_noise(rng, idx), float("-inf"))
    sampled = torch.argmax(score, dim=1)
    greedy = torch.argmax(z, dim=1)
    return torch.where(temperature.to(z.device) > 0, sampled, greedy)
