"""The attention-backend interface: one object per engine, called by every attention layer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvcap.attention.metadata import AttentionMetadata
from kvcap.kv_cache.pool import LayerKVCache


class AttentionBackend(ABC):
    """Writes the new K/V into the paged cache and computes causal attention over it.

    Implementations: `torch` (eager reference, the twin of every kernel) and `triton`.
    A QSA backend wraps one of them and narrows what each query row reads; tensor
    parallelism only changes the head counts a backend sees.
    """

    name: str = "base"
    # True when `attend_stored` exists: the model may then write K/V into the cache itself
    # (fused into its RoPE kernel, kvcap.kernels.fused_ops) and skip the backend's store.
    accepts_stored_kv: bool = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D] model dtype, post-norm, post-RoPE
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        cache: LayerKVCache,
        meta: AttentionMetadata,
        softmax_scale: float,
        out: torch.Tensor,  # [T, Hq, D] model dtype; rows of padding tokens are left untouched
    ) -> torch.Tensor:
        """Store k/v at meta.slot_mapping (quantizing for E4M3), then attend. Returns `out`."""

    def attend_stored(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
                      softmax_scale: float, out: torch.Tensor) -> torch.Tensor:
        """`forward` for a batch whose k/v the caller already wrote at meta.slot_mapping."""
        raise NotImplementedError(f"the {self.name} backend stores K/V itself (forward)")
