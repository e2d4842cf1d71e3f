"""The KV pool: one K and one V paged tensor per layer, plus per-layer scales for E4M3.

Layout per layer: [num_blocks, num_kv_heads, block_size, head_dim] ("HND"), so one block of
one KV head is a contiguous block_size x head_dim tile that kernels load in one sweep.
E4M3 caches are stored as uint8 raw bytes (works on every GPU; kernels decode in software
or by hardware conversion). Scales are FP32 device tensors [num_layers] so CUDA graphs can
capture them; a layer whose scales were not finalized by the gate refuses to run.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from kvcap.config import kv_storage_dtype
from kvcap.errors import ScaleGateError
from kvcap.kv_cache.spec import KVCacheSpec

logger = logging.getLogger(__name__)


@dataclass
class LayerKVCache:
    """One layer's view of the pool, handed to the attention backend."""

    layer_idx: int
    k_cache: torch.Tensor  # [num_blocks, Hkv, block_size, D]
    v_cache: torch.Tensor
    kv_dtype: str
    k_scale: torch.Tensor | None  # 0-dim FP32 device tensor; None for float caches
    v_scale: torch.Tensor | None
    # The layer's attention window: a query at position p sees p - window + 1 .. p (None: all
    # of 0 .. p). Backends never read a position outside it.
    window: int | None = None

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype == "fp8_e4m3"

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[2]


class KVCachePool:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = device
        dtype = kv_storage_dtype(spec.kv_dtype)
        # One extra, all-zero block that no request owns: CUDA-graph padding rows read it, so
        # padding never points at another request's (possibly garbage / NaN-coded) bytes.
        self.null_block = num_blocks
        shape = (num_blocks + 1, spec.num_kv_heads, spec.block_size, spec.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device)
                         for _ in range(spec.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device)
                         for _ in range(spec.num_layers)]
        self.is_fp8 = spec.kv_dtype == "fp8_e4m3"
        # -1.0 is the "not loaded" sentinel; the gate replaces it with validated scales.
        self.k_scales = torch.full((spec.num_layers,), -1.0, dtype=torch.float32, device=device)
        self.v_scales = torch.full((spec.num_layers,), -1.0, dtype=torch.float32, device=device)
        self.scales_finalized = not self.is_fp8
        self.scale_source: str | None = None
        gib = 2 * spec.num_layers * self.k_caches[0].numel() * self.k_caches[0].element_size()
        logger.info("KV pool: %d blocks x %d tokens = %d tokens, %s, %.3f GiB",
                    num_blocks, spec.block_size, num_blocks * spec.block_size, spec.kv_dtype,
                    gib / 2**30)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.spec.block_size

    def set_scales(self, k_scales: list[float], v_scales: list[float], source: str) -> None:
        """Install per-layer scales that the gate has already validated (re-checked here)."""
        if not self.is_fp8:
            raise ScaleGateError("K/V scales were given but the KV cache is not fp8_e4m3")
        n = self.spec.num_layers
        if len(k_scales) != n or len(v_scales) != n:
            raise ScaleGateError(f"expected {n} K and {n} V scales, got "
                                 f"{len(k_scales)} and {len(v_scales)}")
        for layer, (ks, vs) in enumerate(zip(k_scales, v_scales, strict=True)):
            for name, s in (("K", ks), ("V", vs)):
                if not (math.isfinite(s) and s > 0):
                    raise ScaleGateError(f"invalid scale {s!r}: layer {layer} {name}")
        self.k_scales.copy_(torch.tensor(k_scales, dtype=torch.float32))
        self.v_scales.copy_(torch.tensor(v_scales, dtype=torch.float32))
        self.scales_finalized = True
        self.scale_source = source

    def layer(self, layer_idx: int) -> LayerKVCache:
        if not self.scales_finalized:
            raise ScaleGateError(
                f"layer {layer_idx}: fp8_e4m3 KV scales were not finalized by the startup gate; "
                "load calibrated scales (kv_scales=PACK or a materialized checkpoint)"
            )
        return LayerKVCache(
            layer_idx=layer_idx,
            k_cache=self.k_caches[layer_idx],
            v_cache=self.v_caches[layer_idx],
            kv_dtype=self.spec.kv_dtype,
            k_scale=self.k_scales[layer_idx] if self.is_fp8 else None,
            v_scale=self.v_scales[layer_idx] if self.is_fp8 else None,
            window=self.spec.layer_windows[layer_idx] if self.spec.layer_windows else None,
        )
