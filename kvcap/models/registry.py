"""Build a model for a ModelSpec on a device and dtype, then fill it from a checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvcap.config import ModelSpec
from kvcap.models.fp8_linear import reserve_scratch
from kvcap.models.fp8_weights import dequantized, fp8_tensors
from kvcap.models.llama import LlamaModel, rope_inv_freq
from kvcap.models.loader import iter_safetensors
from kvcap.models.phi3 import split_fused
from kvcap.models.weights import dummy_checkpoint, init_dummy_weights, load_weights

if TYPE_CHECKING:
    from kvcap.distributed.layers import ModelParallel

logger = logging.getLogger(__name__)


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                tp: ModelParallel | None = None, keep_fp8: bool = False) -> LlamaModel:
    """Allocate parameters directly on `device` in `dtype` (no wasted random init); with `tp`,
    only this tensor-parallel rank's shard; with `keep_fp8`, the linears of an FP8 checkpoint
    in FP8 (kvcap.models.fp8_linear)."""
    with torch.device("meta"):
        model = LlamaModel(spec, tp, spec.fp8_weights if keep_fp8 else None)
    model = model.to_empty(device=device).to(dtype)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    inv, _ = rope_inv_freq(spec)  # non-persistent buffer: recompute after to_empty
    model.rotary.inv_freq = inv.to(device)
    return model.eval()


def load_model(spec: ModelSpec, model_dir: Path | None, device: torch.device,
               dtype: torch.dtype, dummy_seed: int = 0, tp: ModelParallel | None = None,
               keep_fp8: bool = False) -> tuple[LlamaModel, dict[str, torch.Tensor]]:
    """Returns the model and the K/V scale tensors found in the checkpoint (for the gate).
    `keep_fp8`: an FP8 checkpoint's linear weights stay FP8 (kvcap.models.fp8_linear
    .resolve_keep decides), else they are dequantized to `dtype` as they load."""
    keep_fp8 = keep_fp8 and spec.fp8_weights is not None
    model = build_model(spec, device, dtype, tp, keep_fp8)
    where = "" if tp is None else f", tensor-parallel rank {tp.shard.rank}/{tp.shard.world}"
    if keep_fp8:
        assert spec.fp8_weights is not None
        gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        scratch = reserve_scratch(model, dtype) / 2**30
        logger.info("%s: kept in FP8 on %s (%.2f GiB of weights, a %.2f GiB buffer to "
                    "dequantize one for large steps; activations %s)",
                    spec.fp8_weights.describe(), device, gib, scratch, dtype)
    if model_dir is None:
        if tp is None:
            init_dummy_weights(model, dummy_seed)
        else:  # the same random model as TP1, sliced
            load_weights(model, dummy_checkpoint(spec, device, dtype, dummy_seed, keep_fp8))
        logger.info("model: %s with random (dummy) weights, %s%s", spec.architecture, dtype,
                    where)
        return model, {}
    tensors = iter_safetensors(model_dir)
    if keep_fp8:
        tensors = fp8_tensors(tensors, spec.fp8_weights, device)
    elif spec.fp8_weights is not None:
        logger.info("%s: dequantized to %s as they load (the FP8 checkpoint saves disk, not "
                    "memory; fp8_weights='keep' keeps them FP8)", spec.fp8_weights.describe(),
                    dtype)
        tensors = dequantized(tensors, spec.fp8_weights, device)
    if spec.architecture == "phi3":
        tensors = split_fused(tensors, spec)
    scales = load_weights(model, tensors)
    logger.info("model: %s from %s, %s, %d scale tensors in checkpoint%s", spec.architecture,
                model_dir, dtype, len(scales), where)
    return model, scales
