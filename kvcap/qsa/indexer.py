"""QSA indexer side caches (FP16/BF16, never quantized), paged by the main cache's block ids.

Per QSA layer, addressed with the same block ids as the main K/V cache (so prefix caching,
preemption and abort need nothing extra: a block's side rows live and die with the block):
  raw   [NB+2, Hk, R, dk]    a ring of the R raw keys of the block's open group (slot = pos % R)
                             (mean / trained summaries only)
  comp  [NB+2, Hk, bs/R, dk] one row per complete group: the compressed key (trained indexer:
                             mean of the R raw index keys, normalised, RoPE at the group's
                             first position), the mean key or the min bound (training-free)
  hi    [NB+2, Hk, bs/R, dk] the max bound ("minmax" summary only)
The min/max bounds need no ring: min and max are exact in any order, so every step folds its
keys into the open group's rows (running bounds); only complete groups are ever scored.
Block NB is the null block (zeros; padding rows of CUDA graphs read it), NB+1 a trash block
that absorbs the writes of rows that write nothing (so updates need no boolean indexing and
no host sync). Hk/dk are 1 x d_index (trained) or Hkv x head_dim (training-free).

A group's R keys are gathered from this step's rows where they belong to this step and from
the ring where an earlier step wrote them; both are cast to the side dtype first, so chunked
and one-shot prefill produce bit-identical side caches (for the bounds too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcap.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# (keys FP32 [n, R, Hk, dk], first positions int64 [n]) -> summary rows FP32 [n, Hk, dk]
Compressor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class RowInfo:
    """Per-row facts of one metadata object (device tensors, int64 [T]); built without syncs.

    seq: the row's sequence (clamped for padding rows), pos: its position, valid: a real row,
    ctx / seq_len: its sequence's cached length before the step and total length after it."""

    seq: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor
    ctx: torch.Tensor
    seq_len: torch.Tensor

    @classmethod
    def build(cls, meta: AttentionMetadata, num_rows: int) -> RowInfo:
        dev = meta.seq_lens.device
        b = meta.seq_lens.shape[0]
        t = torch.arange(num_rows, device=dev, dtype=torch.int64)
        qsl = meta.query_start_loc.long()
        seq = torch.searchsorted(qsl[1:].contiguous(), t, right=True)
        valid = seq < b
        seq = torch.clamp(seq, max=max(b - 1, 0))
        seq_len = meta.seq_lens.long()[seq]
        end = qsl[1:][seq]
        pos = seq_len - (end - t)
        ctx = seq_len - (end - qsl[:-1][seq])
        pos = torch.where(valid, pos, 0)
        return cls(seq=seq, pos=pos, valid=valid, ctx=ctx, seq_len=seq_len)


@dataclass
class LayerSideCache:
    raw: torch.Tensor | None  # ring [NB+2, Hk, R, dk] (None for bounds)
    comp: torch.Tensor  # [NB+2, Hk, bs/R, dk]
    hi: torch.Tensor | None
    ratio: int

    @property
    def null_block(self) -> int:
        return self.comp.shape[0] - 2

    @property
    def trash_block(self) -> int:
        return self.comp.shape[0] - 1


class QSASideCaches:
    """The indexer caches of every QSA layer, sized to a KV pool of `num_blocks` blocks."""

    def __init__(self, layers: tuple[int, ...], num_blocks: int, block_size: int, ratio: int,
                 key_heads: int, key_dim: int, dtype: torch.dtype, device: torch.device,
                 bounds: bool = False):
        if block_size % ratio:
            raise ValueError(f"block size {block_size} is not a multiple of ratio {ratio}")
        self.ratio, self.block_size = ratio, block_size
        self.key_heads, self.key_dim, self.dtype = key_heads, key_dim, dtype
        nb = num_blocks + 2
        gpb = block_size // ratio
        self._layers: dict[int, LayerSideCache] = {}
        for i in layers:
            raw = None if bounds else torch.zeros((nb, key_heads, ratio, key_dim), dtype=dtype,
                                                  device=device)
            comp = torch.zeros((nb, key_heads, gpb, key_dim), dtype=dtype, device=device)
            hi = torch.zeros_like(comp) if bounds else None
            self._layers[i] = LayerSideCache(raw, comp, hi, ratio)
        logger.info("QSA side caches: %d layers x %d blocks, %d B/token (%s)", len(layers),
                    num_blocks, self.bytes_per_token, dtype)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self._layers)

    def layer(self, idx: int) -> LayerSideCache:
        return self._layers[idx]

    @property
    def bytes_per_token(self) -> int:
        """Side-cache bytes per token slot of the pool, all QSA layers together."""
        per_block = 0
        for c in self._layers.values():
            for t in (c.raw, c.comp, c.hi):
                if t is not None:
                    per_block += t[0].numel() * t.element_size()
        return -(-per_block // self.block_size)


def side_bytes_per_token(num_qsa_layers: int, key_heads: int, key_dim: int, ratio: int,
                         block_size: int, element_bytes: int = 2, bounds: bool = False) -> int:
    """What the capacity planner must add to KVCacheSpec.side_bytes_per_token (rounded up):
    per block and layer a ring of R rows plus bs/R compressed rows, or with bounds 2 x bs/R
    bound rows and no ring."""
    rows = 2 * (block_size // ratio) if bounds else ratio + block_size // ratio
    per_block = num_qsa_layers * rows * key_heads * key_dim * element_bytes
    return -(-per_block // block_size)


def update_side_cache(side: LayerSideCache, keys: torch.Tensor, slot_mapping: torch.Tensor,
                      rows: RowInfo, compress: Compressor, bounds: bool = False) -> None:
    """Fold one step's raw keys into the layer's side cache.

    keys: [T, Hk, dk] raw keys of the step's rows (model dtype); slot_mapping int64 [T] (-1 =
    padding). Summaries (`compress`): the rows of the groups this step completes, from the
    ring and this step's keys; the ring keeps each sequence's open group. With `bounds`:
    running elementwise min (comp) / max (hi) of every group this step touches.
    """
    t_rows = keys.shape[0]
    if t_rows == 0:
        return
    r = side.ratio
    kd = keys.to(side.comp.dtype)
    slot = slot_mapping[:t_rows]
    real = rows.valid[:t_rows] & (slot >= 0)
    pos = rows.pos[:t_rows]
    ctx = rows.ctx[:t_rows]
    t = torch.arange(t_rows, device=keys.device)
    if bounds:
        _update_bounds(side, kd, slot, real, pos, ctx, rows.seq_len[:t_rows], t)
        return
    assert side.raw is not None
    bs = side.comp.shape[2] * r
    blk = torch.where(real, slot // bs, side.trash_block)
    off = torch.where(real, slot % bs, 0)
    # 1) gather each completing group's R keys (before the ring is overwritten below)
    done = real & (pos % r == r - 1)
    j = torch.arange(r, device=keys.device)
    in_step = (pos[:, None] - (r - 1) + j) >= ctx[:, None]  # [T, R]
    from_step = kd[torch.clamp(t[:, None] - (r - 1) + j, min=0)]  # [T, R, Hk, dk]
    from_ring = side.raw[blk].permute(0, 2, 1, 3)  # [T, R, Hk, dk]
    group = torch.where(in_step[:, :, None, None], from_step, from_ring)
    dst_blk = torch.where(done, blk, side.trash_block)
    dst_row = torch.where(done, off // r, 0)
    summary = compress(group.float(), pos - (r - 1))
    side.comp[dst_blk, :, dst_row] = summary.to(side.comp.dtype)
    # 2) keep the raw keys of each sequence's open group for the next step
    open_tail = real & (pos >= (rows.seq_len[:t_rows] // r) * r)
    side.raw[torch.where(open_tail, blk, side.trash_block), :, pos % r] = kd


def _update_bounds(side: LayerSideCache, kd, slot, real, pos, ctx, seq_len, t) -> None:
    """Running min/max: each group touched by the step gets min/max over its keys in this
    step, folded with its rows from earlier steps when the group began before the step.
    One writer per group: its last key in the step."""
    assert side.hi is not None
    r = side.ratio
    block_size = side.comp.shape[2] * r
    blk = torch.where(real, slot // block_size, side.trash_block)
    row = torch.where(real, (slot % block_size) // r, 0)
    j = pos % r  # index inside the group
    lo, hi = kd.clone(), kd.clone()
    for i in range(1, r):
        ok = (j >= i) & (pos - i >= ctx)  # key i steps back: same group, in this step
        prev = kd[torch.clamp(t - i, min=0)]
        lo = torch.where(ok[:, None, None], torch.minimum(lo, prev), lo)
        hi = torch.where(ok[:, None, None], torch.maximum(hi, prev), hi)
    older = ((pos - j) < ctx)[:, None, None]  # the group began in an earlier step
    lo = torch.where(older, torch.minimum(lo, side.comp[blk, :, row]), lo)
    hi = torch.where(older, torch.maximum(hi, side.hi[blk, :, row]), hi)
    last = real & ((j == r - 1) | (pos == seq_len - 1))
    dst = torch.where(last, blk, side.trash_block)
    side.comp[dst, :, row] = lo
    side.hi[dst, :, row] = hi


def mean_compressor(keys: torch.Tensor, first_pos: torch.Tensor) -> torch.Tensor:
    """Training-free "mean" summary: FP32 [n, R, Hk, dk] -> [n, Hk, dk]."""
    return keys.mean(1)


def gather_groups(comp: torch.Tensor, block_table: torch.Tensor, num_groups: int
                  ) -> torch.Tensor:
    """One sequence's first `num_groups` side rows: comp [NB+2, Hk, gpb, dk], block_table int
    [W] -> [Hk, num_groups, dk] (storage dtype)."""
    gpb = comp.shape[2]
    nblk = -(-num_groups // gpb)
    blocks = block_table[:nblk].long()
    pages = comp[blocks]  # [nblk, Hk, gpb, dk]
    hk, dk = pages.shape[1], pages.shape[3]
    return pages.permute(1, 0, 2, 3).reshape(hk, nblk * gpb, dk)[:, :num_groups]
