"""Build a model for a ModelSpec on a device and dtype, then fill it from a checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvcap.config import ModelSpec
from kvcap.models.fp8_weights import dequantized
from kvcap.models.llama import LlamaModel, rope_inv_freq
from kvcap.models.loader import iter_safetensors
from kvcap.models.phi3 import split_fused
from kvcap.models.weights import dummy_checkpoint, init_dummy_weights, load_weights

if TYPE_CHECKING:
    from kvcap.distributed.layers import ModelParallel

logger = logging.getLogger(__name__)


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                tp: ModelParallel | None = None) -> LlamaModel:
    """Allocate parameters directly on `device` in `dtype` (no wasted random init); with `tp`,
    only this tensor-parallel rank's shard."""
    with torch.device("meta"):
        model = LlamaModel(spec, tp)
    model = model.to_empty(device=device).to(dtype)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    inv, _ = rope_inv_freq(spec)  # non-persistent buffer: recompute after to_empty
    model.rotary.inv_freq = inv.to(device)
    return model.eval()


def load_model(spec: ModelSpec, model_dir: Path | None, device: torch.device,
               dtype: torch.dtype, dummy_seed: int = 0, tp: ModelParallel | None = None
               ) -> tuple[LlamaModel, dict[str, torch.Tensor]]:
    """Returns the model and the K/V scale tensors found in the checkpoint (for the gate)."""
    model = build_model(spec, device, dtype, tp)
    where = "" if tp is None else f", tensor-parallel rank {tp.shard.rank}/{tp.shard.world}"
    if model_dir is None:
        if tp is None:
            init_dummy_weights(model, dummy_seed)
        else:  # the same random model as TP1, sliced
            load_weights(model, dummy_checkpoint(spec, device, dtype, dummy_seed))
        logger.info("model: %s with random (dummy) weights, %s%s", spec.architecture, dtype,
                    where)
        return model, {}
    tensors = iter_safetensors(model_dir)
    if spec.fp8_weights is not None:
        logger.info("%s: dequantized to %s as they load (kvcap computes in 16 bits; the FP8 "
                    "checkpoint saves disk, not GPU memory)", spec.fp8_weights.describe(), dtype)
        tensors = dequantized(tensors, spec.fp8_weights, device)
    if spec.architecture == "phi3":
        tensors = split_fused(tensors, spec)
    scales = load_weights(model, tensors)
    logger.info("model: %s from %s, %s, %d scale tensors in checkpoint%s", spec.architecture,
                model_dir, dtype, len(scales), where)
    return model, scales
