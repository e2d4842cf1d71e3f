"""Triton attention backend: store_kv, then decode rows through the split-K / grouped decode
kernel and multi-token rows through the chunked-prefill kernel (both in one mixed batch)."""

from __future__ import annotations

import logging

import torch

from kvcap.attention.base import AttentionBackend
from kvcap.attention.metadata import AttentionMetadata
from kvcap.kernels.common import ENV_DISABLE_ROPE_KV_WRITE, _flag
from kvcap.kernels.decode import decode_launcher
from kvcap.kernels.prefill import prefill_launcher
from kvcap.kernels.store_kv import store_kv
from kvcap.kv_cache.pool import LayerKVCache

logger = logging.getLogger(__name__)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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
        # The step's launch plans by builder (decode.decode_launcher, prefill.prefill_launcher),
        # built in its first layer and launched in every layer whose tensors match them.
        self._launchers: dict[object, tuple[tuple, object]] = {}

    def _plan(self, meta: AttentionMetadata) -> bool:
        """Whether the batch has single-token (decode) rows; computed once per metadata."""
        if meta is not self._plan_meta:
            qsl = meta.query_start_loc_cpu
            self._has_decode = any(qsl[i + 1] - qsl[i] == 1 for i in range(len(qsl) - 1))
            self._plan_meta = meta
            self._launchers.clear()
        return self._has_decode

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                meta: AttentionMetadata, softmax_scale: float, out: torch.Tensor
                ) -> torch.Tensor:
        store_kv(k, v, cache.k_cache, cache.v_cache, meta.slot_mapping, cache.k_scale,
                 cache.v_scale, fp8_mode=self.fp8_mode)
        return self.attend_stored(q, cache, meta, softmax_scale, out)

    def _launch(self, builder, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
                softmax_scale: float, out: torch.Tensor, bound: int, **kwargs) -> None:
        """Run this step's `builder` plan (decode.decode_launcher / prefill.prefill_launcher,
        `bound` its host-side length: max_seq_len / max_query_len) for this layer. The plan is
        built on first use and reused while the tensors match it: every layer of a model has the
        same shapes, so one build serves the whole step. One built outside a CUDA graph capture
        is never launched inside one, nor the reverse: its split-K buffers must come from the
        allocator the launch runs under (a graph keeps the address it recorded; a buffer from
        outside its pool would be freed and reused under it)."""
        kc, vc, ks, vs = cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale
        sig = (q.shape, q.dtype, q.stride(), q.device, out.shape, out.dtype, out.stride(),
               kc.shape, kc.dtype, kc.stride(), vc.shape, vc.dtype, vc.stride(),
               ks is None, vs is None, softmax_scale, _capturing())
        key = (builder, cache.window)  # sliding and full layers may alternate: a plan each
        got = self._launchers.get(key)
        if got is None or got[0] != sig:
            got = self._launchers[key] = (sig, builder(
                q, kc, vc, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                softmax_scale, bound, ks, vs, fp8_mode=self.fp8_mode, window=cache.window,
                **kwargs))
        if got[1] is not None:
            got[1](q, kc, vc, out, ks, vs)

    def attend_stored(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
                      softmax_scale: float, out: torch.Tensor) -> torch.Tensor:
        if self._plan(meta):
            self._launch(decode_launcher, q, cache, meta, softmax_scale, out, meta.max_seq_len)
        if meta.max_query_len > 1:
            self._launch(prefill_launcher, q, cache, meta, softmax_scale, out,
                         meta.max_query_len, skip_decode=True)
        return out
