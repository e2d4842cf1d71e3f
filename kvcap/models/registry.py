"""Build a model for a ModelSpec on a device and dtype, then fill it from a checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvcap.config import ModelSpec
from kvcap.models.llama import LlamaModel, rope_inv_freq
from kvcap.models.loader import iter_safetensors
from kvcap.models.weights import init_dummy_weights, load_weights

logger = logging.getLogger(__name__)


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    """Allocate parameters directly on `device` in `dtype` (no wasted random init)."""
    with torch.device("meta"):
        model = LlamaModel(spec)
    model = model.to_empty(device=device).to(dtype)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    inv, _ = rope_inv_freq(spec)  # non-persistent buffer: recompute after to_empty
    model.rotary.inv_freq = inv.to(device)
    return model.eval()


def load_model(spec: ModelSpec, model_dir: Path | None, device: torch.device,
               dtype: torch.dtype, dummy_seed: int = 0
               ) -> tuple[LlamaModel, dict[str, torch.Tensor]]:
    """Returns the model and the K/V scale tensors found in the checkpoint (for the gate)."""
    model = build_model(spec, device, dtype)
    if model_dir is None:
        init_dummy_weights(model, dummy_seed)
        logger.info("model: %s with random (dummy) weights, %s", spec.architecture, dtype)
        return model, {}
    scales = load_weights(model, iter_safetensors(model_dir))
    logger.info("model: %s from %s, %s, %d scale tensors in checkpoint", spec.architecture,
                model_dir, dtype, len(scales))
    return model, scales
