"""Eager torch attention backend: the CPU engine's backend and the twin of every kernel.

Deliberately plain: store by slot (E4M3 through `kvcap.numerics.e4m3.encode`), then per
sequence gather its pages, dequantize (`decode(q) * scale`), and run causal GQA attention with
an FP32 softmax. No per-token Python loops; one loop over sequences.
"""

from __future__ import annotations

import torch

from kvcap.attention.base import AttentionBackend
from kvcap.attention.metadata import AttentionMetadata
from kvcap.kv_cache.pool import LayerKVCache
from kvcap.numerics import e4m3


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                       slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] into the paged cache at slot_mapping [T] (int64, -1 = skip)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    if slots.numel() == 0:
        return
    bs = cache.block_size
    blk, off = slots // bs, slots % bs
    for src, dst, scale in ((k, cache.k_cache, cache.k_scale), (v, cache.v_cache, cache.v_scale)):
        rows = src[: slot_mapping.shape[0]][valid]
        if cache.is_fp8:
            vals = e4m3.encode(rows, scale)
        else:
            vals = rows.to(dst.dtype)
        dst[blk, :, off] = vals  # advanced indices first: [n, Hkv, D]


def gather_kv_reference(cache: LayerKVCache, block_table: torch.Tensor, seq_len: int,
                        start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized FP32 K and V of one sequence's positions [start, seq_len): [Hkv, n, D]
    each. Blocks before `start`'s are not read."""
    bs = cache.block_size
    nblk = (seq_len + bs - 1) // bs
    first = start // bs
    blocks = block_table[first:nblk].long()
    if blocks.numel() < nblk - first or bool((blocks < 0).any()):
        raise ValueError(f"block table covers fewer than the {nblk} blocks of {seq_len} tokens")
    out = []
    for src, scale in ((cache.k_cache, cache.k_scale), (cache.v_cache, cache.v_scale)):
        # Select the pages on the contiguous cache, then go head-major -> [Hkv, nblk, bs, D].
        # (index_select along dim 1 of the permuted view copied the *whole* pool first: 10 ms
        # per layer per sequence for a 1457-block pool on CPU, vs 0.03 ms this way.)
        pages = src.index_select(0, blocks).permute(1, 0, 2, 3)
        hkv, d = pages.shape[0], pages.shape[3]
        x = pages.reshape(hkv, (nblk - first) * bs, d)[:, start - first * bs: seq_len - first * bs]
        x = e4m3.decode(x, scale) if cache.is_fp8 else x.float()
        out.append(x)
    return out[0], out[1]


def attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                     softmax_scale: float, window: int | None = None,
                     key_start: int = 0) -> torch.Tensor:
    """Causal GQA attention of n new queries q [n, Hq, D] over k/v [Hkv, S, D] (FP32) holding
    positions key_start .. key_start + S - 1, where query j sits at position context_len + j
    and, with a `window`, sees only the positions p - window + 1 .. p. Returns FP32
    [n, Hq, D]."""
    n, hq, d = q.shape
    hkv, s, _ = k.shape
    group = hq // hkv
    # Group query heads by their KV head: [Hkv, group * n, D], no K/V repetition.
    qf = q.float().reshape(n, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * n, d)
    scores = torch.matmul(qf, k.transpose(1, 2)) * softmax_scale  # [Hkv, group * n, S]
    # (the last query's window starts latest: past key_start, some key is masked)
    windowed = window is not None and context_len + n - window > key_start
    if n > 1 or context_len + 1 < key_start + s or windowed:
        qpos = context_len + torch.arange(n, device=q.device).repeat(group)
        kpos = key_start + torch.arange(s, device=q.device)
        mask = kpos[None, :] > qpos[:, None]
        if windowed:
            mask |= kpos[None, :] <= qpos[:, None] - window
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, v)  # [Hkv, group * n, D]
    return o.reshape(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


class TorchReferenceBackend(AttentionBackend):
    """Eager reference backend (see module docstring). Padding rows of `out` stay untouched."""

    name = "torch"

    def forward(self, q, k, v, cache: LayerKVCache, meta: AttentionMetadata,
                softmax_scale: float, out: torch.Tensor) -> torch.Tensor:
        if q.shape[1] % k.shape[1] != 0:
            raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]}")
        store_kv_reference(k, v, cache, meta.slot_mapping)
        qsl = meta.query_start_loc_cpu
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            start, end = qsl[i], qsl[i + 1]
            n = end - start
            if n == 0:
                continue
            # With a window, the first query sees nothing before seq_len - n - window + 1.
            lo = max(seq_len - n - cache.window + 1, 0) if cache.window else 0
            kf, vf = gather_kv_reference(cache, meta.block_tables[i], seq_len, lo)
            res = attend_reference(q[start:end], kf, vf, seq_len - n, softmax_scale,
                                   cache.window, lo)
            out[start:end] = res.to(out.dtype)
        return out
