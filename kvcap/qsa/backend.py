"""QSABackend: wraps an attention backend; QSA layers attend only to their selected tokens.

For a QSA layer, one forward: store K/V in the main cache (E4M3 quantized on write or a
float copy), update the indexer side caches (ring + completed groups), score every row's
visible groups, select (exact top-k, tie rule, expansion with the causal tail) and attend
over the selected tokens only. Dense layers, and every layer while `KVCAP_DISABLE_QSA=1`,
go straight to the inner backend (QSA layers still update their side caches then). Two paths:
  torch:  per sequence, reference scoring/selection (kvcap.qsa.selection) and masked eager
          attention (with everything selected it is the dense reference, bit for bit);
  triton: all rows at once through kvcap.kernels.qsa_score / qsa_topk / qsa_attention.
Both work for prefill, chunked prefill, decode and mixed batches (selection is per row).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcap.attention.base import AttentionBackend
from kvcap.attention.metadata import AttentionMetadata
from kvcap.attention.torch_ref import gather_kv_reference, store_kv_reference
from kvcap.errors import ConfigError
from kvcap.kv_cache.pool import LayerKVCache
from kvcap.qsa.config import QSAConfig, qsa_disabled
from kvcap.qsa.indexer import (
    Compressor,
    LayerSideCache,
    QSASideCaches,
    RowInfo,
    gather_groups,
    mean_compressor,
    update_side_cache,
)
from kvcap.qsa.selection import score_groups, select_tokens, selection_mask

logger = logging.getLogger(__name__)

SCORE_WORKSPACE_BYTES = 256 << 20  # triton path: rows are scored in chunks under this size

Probe = Callable[[int, torch.Tensor, LayerKVCache, AttentionMetadata, torch.Tensor, float], None]


@dataclass
class IndexInputs:
    """What a model with a trained indexer passes for one QSA layer's forward.

    q: [T, Hi, di] index queries (post-RoPE); k: [T, di] raw index keys (pre-norm, pre-RoPE);
    compress: FP32 keys [n, R, 1, di] + first positions [n] -> compressed keys [n, 1, di]."""

    q: torch.Tensor
    k: torch.Tensor
    compress: Compressor


def attend_masked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            mask: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """GQA attention of q [n, Hq, D] over k/v FP32 [Hkv, S, D] where query row r of head h
    sees key s iff mask[r, h', s] (mask [n, Hs, S] bool, Hs = 1 or Hkv; h' = h's KV head).
    Same operations as kvcap.attention.torch_ref.attend_reference. Returns FP32 [n, Hq, D]."""
    n, hq, d = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    # Query heads grouped by their KV head, [Hkv, group * n, D], exactly as attend_reference
    # lays them out: the same matmul shapes round the same, so a selection of every token is
    # the dense result bit for bit (per-query-head [Hq, n, D] matmuls differed in the last
    # bit at some row counts, e.g. a 3- or 4-token prompt).
    qf = q.float().reshape(n, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * n, d)
    scores = torch.matmul(qf, k.transpose(1, 2)) * softmax_scale  # [Hkv, group * n, S]
    m = mask.transpose(0, 1).repeat(1, group, 1)  # [Hs, group * n, S]; Hs = 1 broadcasts
    scores = scores.masked_fill(~m, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, v)  # [Hkv, group * n, D]
    return o.reshape(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


class QSABackend(AttentionBackend):
    """`record`: set to a dict to collect each QSA layer's selections (a list of int32
    [T, Hs, W], one per forward). `probe(layer, q, cache, meta, tokens, softmax_scale)`:
    called after every QSA forward (quality tooling, kvcap.qsa.quality)."""

    name = "qsa"

    def __init__(self, inner: AttentionBackend, config: QSAConfig, side: QSASideCaches,
                 device: torch.device):
        self.inner = inner
        self.config = config.validate()
        self.side = side
        self.layers = frozenset(side.layers)
        path = config.resolved_path(device.type)
        if path == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(f"the QSA triton path needs CUDA (or TRITON_INTERPRET=1), the "
                              f"device is {device.type}: use QSAConfig(path='auto' or 'torch')")
        self.path = path
        self.fp8_mode = getattr(inner, "fp8_mode", "auto")
        self.record: dict[int, list[torch.Tensor]] | None = None
        self.probe: Probe | None = None
        self._rows_meta: AttentionMetadata | None = None
        self._rows: RowInfo | None = None
        self._rows_key: tuple[int, bool] | None = None
        logger.info("QSA backend: %d layers %s, %s indexer, top-%d groups of %d (%d tokens), "
                    "%s path over %s", len(self.layers), sorted(self.layers), config.indexer,
                    config.topk_groups, config.compress_ratio, config.token_budget, path,
                    inner.name)

    @property
    def bounds(self) -> bool:
        return self.config.indexer == "training_free" and self.config.summary == "minmax"

    @property
    def folds_every_key(self) -> bool:
        """True when a key written at a position stays in the side caches even after that
        position is written again: the min/max bounds of an open group are running bounds
        (the ring of the mean / trained summaries is overwritten in place instead). The
        engine then must not launch a step that it may drop and run again (Engine's look-ahead
        with rows left to the host sampler): the dropped step's placeholder keys would stay in
        the bounds."""
        return self.bounds

    def _row_info(self, meta: AttentionMetadata, num_rows: int) -> RowInfo:
        """Built once per metadata object and shared by the layers of a step; rebuilt inside
        a CUDA-graph capture so that the graph recomputes it from its static buffers."""
        capturing = meta.seq_lens.is_cuda and torch.cuda.is_current_stream_capturing()
        key = (num_rows, capturing)
        if meta is not self._rows_meta or self._rows is None or key != self._rows_key:
            self._rows = RowInfo.build(meta, num_rows)
            self._rows_meta, self._rows_key = meta, key
        return self._rows

    def select(self, q: torch.Tensor, k: torch.Tensor, cache: LayerKVCache,
               meta: AttentionMetadata, index: IndexInputs | None = None,
               rows: RowInfo | None = None) -> torch.Tensor:
        """Update the layer's side caches with this step's keys and select every row's
        tokens: int32 [T, Hs, W] (-1 padded; padding rows all -1). Needs no K/V store.
        `rows`: RowInfo of `meta` if the caller built it (else built once per metadata)."""
        cfg = self.config
        t, hq, d = q.shape
        hkv = k.shape[1]
        rows = rows if rows is not None else self._row_info(meta, t)
        side = self.update(q, k, cache, meta, index, rows)
        if cfg.indexer == "trained":
            sel_q = index.q[:, None]  # [T, 1, Hi, di]
            mode, scale = "relu_sum", index.q.shape[-1] ** -0.5
        else:
            sel_q = q.view(t, hkv, hq // hkv, d)
            mode = ("bound_" if self.bounds else "dot_") + cfg.head_reduce
            scale = 1.0
        sel_q = sel_q.to(side.comp.dtype)
        if self.path == "torch":
            return self._torch_select(side, sel_q, meta, mode, scale, t)
        return self._triton_select(side, sel_q, meta, rows, mode, scale)

    def update(self, q: torch.Tensor, k: torch.Tensor, cache: LayerKVCache,
               meta: AttentionMetadata, index: IndexInputs | None = None,
               rows: RowInfo | None = None) -> LayerSideCache:
        """Fold this step's keys into the layer's side caches; returns its LayerSideCache."""
        layer = cache.layer_idx
        rows = rows if rows is not None else self._row_info(meta, q.shape[0])
        if self.config.indexer == "trained":
            if index is None:
                raise ValueError(f"layer {layer}: the trained QSA indexer needs IndexInputs "
                                 "from the model (kvcap.qsa.model)")
            keys, compress = index.k[:, None, :], index.compress
        else:
            keys, compress = k, mean_compressor
        side = self.side.layer(layer)
        update_side_cache(side, keys, meta.slot_mapping, rows, compress, bounds=self.bounds)
        return side

    def attention_mode(self) -> str:
        """"dense" while KVCAP_DISABLE_QSA is set, else "qsa" (the engine resets the prefix
        cache when it changes: cached blocks hold K/V of one mode)."""
        return "dense" if qsa_disabled() else "qsa"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                meta: AttentionMetadata, softmax_scale: float, out: torch.Tensor,
                index: IndexInputs | None = None) -> torch.Tensor:
        layer = cache.layer_idx
        if layer not in self.layers:
            return self.inner.forward(q, k, v, cache, meta, softmax_scale, out)
        if cache.window is not None:  # LLM and enable_qsa refuse such models first
            raise ValueError(f"layer {layer} slides over {cache.window} tokens: QSA selects "
                             "from the whole context and cannot serve it")
        if qsa_disabled():
            # still fold the keys in: requests in flight and prefix-cached blocks outlive the
            # switch, and once it is off their groups are scored from these rows
            self.update(q, k, cache, meta, index)
            return self.inner.forward(q, k, v, cache, meta, softmax_scale, out)
        if self.path == "torch":
            store_kv_reference(k, v, cache, meta.slot_mapping)
        else:
            from kvcap.kernels.store_kv import store_kv

            store_kv(k, v, cache.k_cache, cache.v_cache, meta.slot_mapping, cache.k_scale,
                     cache.v_scale, fp8_mode=self.fp8_mode)
        tokens = self.select(q, k, cache, meta, index)
        self.attend(q, cache, meta, tokens, softmax_scale, out)
        if self.record is not None:
            self.record.setdefault(layer, []).append(tokens)
        if self.probe is not None:
            self.probe(layer, q, cache, meta, tokens, softmax_scale)
        return out

    def attend(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
               tokens: torch.Tensor, softmax_scale: float, out: torch.Tensor,
               rows: RowInfo | None = None) -> torch.Tensor:
        """Attention of q [T, Hq, D] over each row's selected tokens [T, Hs, W] -> out."""
        if self.path == "torch":
            self._torch_attend(q, cache, meta, tokens, softmax_scale, out)
        else:
            self._triton_attend(q, cache, meta, tokens, softmax_scale, out, rows)
        return out

    def _torch_select(self, side, sel_q, meta, mode, scale, num_rows) -> torch.Tensor:
        cfg = self.config
        r = cfg.compress_ratio
        qsl = meta.query_start_loc_cpu
        tokens = torch.full((num_rows, sel_q.shape[1], cfg.width), -1, dtype=torch.int32,
                            device=sel_q.device)
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            start, end = qsl[i], qsl[i + 1]
            if end == start:
                continue
            g = seq_len // r
            lo = gather_groups(side.comp, meta.block_tables[i], g)
            hi = gather_groups(side.hi, meta.block_tables[i], g) if side.hi is not None else None
            scores = score_groups(sel_q[start:end], lo, mode, scale, hi)  # [n, Hs, G]
            pos = torch.arange(seq_len - (end - start), seq_len, device=sel_q.device)
            tokens[start:end] = select_tokens(scores, pos, seq_len, r, cfg.topk_groups,
                                              cfg.include_tail)
        return tokens

    @staticmethod
    def _torch_attend(q, cache, meta, tokens, softmax_scale, out) -> None:
        qsl = meta.query_start_loc_cpu
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            start, end = qsl[i], qsl[i + 1]
            if end == start:
                continue
            kf, vf = gather_kv_reference(cache, meta.block_tables[i], seq_len)
            mask = selection_mask(tokens[start:end], seq_len)
            res = attend_masked_reference(q[start:end], kf, vf, mask, softmax_scale)
            out[start:end] = res.to(out.dtype)

    def _triton_select(self, side, sel_q, meta, rows: RowInfo, mode, scale) -> torch.Tensor:
        from kvcap.kernels.qsa_score import qsa_score
        from kvcap.kernels.qsa_topk import qsa_topk

        cfg = self.config
        r = cfg.compress_ratio
        vis = torch.minimum((rows.pos + 1) // r, rows.seq_len // r)
        vis = torch.where(rows.valid, vis, 0).to(torch.int32)
        pos = torch.where(rows.valid, rows.pos, -1).to(torch.int32)
        num_groups = max(meta.max_seq_len // r, 1)
        t, hs = sel_q.shape[0], sel_q.shape[1]
        sel_q = sel_q.contiguous()
        tokens = torch.empty((t, hs, cfg.width), dtype=torch.int32, device=sel_q.device)
        # cap the FP32 score workspace (long prefill chunks x many groups)
        step = max(1, min(t, SCORE_WORKSPACE_BYTES // (4 * hs * num_groups)))
        for lo in range(0, t, step):
            hi = min(t, lo + step)
            scores = qsa_score(sel_q[lo:hi], side.comp, side.hi, meta.block_tables,
                               rows.seq[lo:hi], vis[lo:hi], num_groups, mode, scale)
            qsa_topk(scores, vis[lo:hi], pos[lo:hi], cfg.topk_groups, r, cfg.include_tail,
                     out=tokens[lo:hi])
        return tokens

    def _triton_attend(self, q, cache, meta, tokens, softmax_scale, out, rows=None) -> None:
        from kvcap.kernels.qsa_attention import qsa_sparse_attention

        cfg = self.config
        r, k = cfg.compress_ratio, cfg.topk_groups
        rows = rows if rows is not None else self._row_info(meta, q.shape[0])
        vis = torch.minimum((rows.pos + 1) // r, rows.seq_len // r)
        counts = torch.clamp(vis, max=k) * r
        if cfg.include_tail:
            counts = counts + torch.clamp(rows.pos - vis * r + 1, min=0)
        counts = torch.where(rows.valid, counts, -1).to(torch.int32)
        qsa_sparse_attention(q, cache.k_cache, cache.v_cache, out, tokens, counts, rows.seq,
                             meta.block_tables, softmax_scale, cache.k_scale, cache.v_scale,
                             fp8_mode=self.fp8_mode)
