"""Triton attention backend: store_kv, then decode rows through the split-K / grouped decode
kernel and multi-token rows through the chunked-prefill kernel (both in one mixed batch)."""

from __future__ import annotations

import logging

import torch

from kvcap.attention.base import AttentionBackend
from kvcap.attention.metadata import AttentionMetadata
from kvcap.kernels.common import ENV_DISABLE_ROPE_KV_WRITE, _flag
from kvcap.kernels.decode import paged_decode
from kvcap.kernels.prefill import paged_prefill
from kvcap.kernels.store_kv import store_kv
from kvcap.kv_cache.pool import LayerKVCache

logger = logging.getLogger(__name__)


class TritonBackend(AttentionBackend):
    """fp8_mode: "auto" (hardware E4M3 conversion on SM89+, the exact packed software decoder
    elsewhere or with KVCAP_FORCE_SOFTWARE_FP8=1), "native" or "software"; decode also takes
    "native-k" / "native-v" (kvcap.kernels.decode.fp8_decoders)."""

    name = "triton"

    def __init__(self, fp8_mode: str = "auto"):
        self.fp8_mode = fp8_mode
        # The model's fused RoPE kernel writes K/V (one launch per layer less) unless
        # KVCAP_DISABLE_ROPE_KV_WRITE=1, which brings back store_kv here.
        self.accepts_stored_kv = not _flag(ENV_DISABLE_ROPE_KV_WRITE)
        self._plan_meta: AttentionMetadata | None = None
        self._has_decode = False

    def _plan(self, meta: AttentionMetadata) -> bool:
        """Whether the batch has single-token (decode) rows; computed once per metadata."""
        if meta is not self._plan_meta:
            qsl = meta.query_start_loc_cpu
            self._has_decode = any(qsl[i + 1] - qsl[i] == 1 for i in range(len(qsl) - 1))
            self._plan_meta = meta
        return self._has_decode

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                meta: AttentionMetadata, softmax_scale: float, out: torch.Tensor
                ) -> torch.Tensor:
        store_kv(k, v, cache.k_cache, cache.v_cache, meta.slot_mapping, cache.k_scale,
                 cache.v_scale, fp8_mode=self.fp8_mode)
        return self.attend_stored(q, cache, meta, softmax_scale, out)

    def attend_stored(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
                      softmax_scale: float, out: torch.Tensor) -> torch.Tensor:
        if self._plan(meta):
            paged_decode(q, cache.k_cache, cache.v_cache, out, meta.block_tables, meta.seq_lens,
                         meta.query_start_loc, softmax_scale, meta.max_seq_len,
                         cache.k_scale, cache.v_scale, fp8_mode=self.fp8_mode)
        if meta.max_query_len > 1:
            paged_prefill(q, cache.k_cache, cache.v_cache, out, meta.block_tables,
                          meta.seq_lens, meta.query_start_loc, softmax_scale,
                          meta.max_query_len, cache.k_scale, cache.v_scale,
                          fp8_mode=self.fp8_mode, skip_decode=True)
        return out
