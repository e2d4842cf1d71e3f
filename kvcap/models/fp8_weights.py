"""FP8 (E4M3) weight checkpoints, dequantized as they load.

kvcap computes in 16 bits and quantizes only the KV cache, so a checkpoint whose linear weights
are stored in FP8 -- compressed-tensors `float-quantized` (per-tensor, per-channel or block
scales in `weight_scale`), transformers' fine-grained FP8 (`quant_method: fp8`, block scales
in `weight_scale_inv`) or FBGEMM FP8 (per-channel `weight_scale`) -- loads with each weight
multiplied back by its scale: W = w_e4m3 * s, s broadcast over its tensor, row or block. The
activation scales these formats carry (`input_scale`, `input_scale_ub`) are for FP8 matmuls
kvcap does not run, and are dropped. What is not FP8 (norms, embeddings, an `ignore`d lm_head)
passes through unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvcap.errors import ConfigError, ModelLoadError

logger = logging.getLogger(__name__)

WEIGHT_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
DROPPED_SUFFIXES = (".input_scale", ".input_scale_ub")


@dataclass(frozen=True)
class FP8Weights:
    """How a checkpoint stores FP8 weights: its method and scale block (rows, columns) where
    the scales are per block."""

    method: str
    block: tuple[int, int] | None = None

    def describe(self) -> str:
        where = f"{self.block[0]} x {self.block[1]} blocks" if self.block else "tensor or row"
        return f"FP8 weights ({self.method}, scales per {where})"


def read_weight_quant(qc: Any) -> FP8Weights | None:
    """The weight format a config.json `quantization_config` declares: None for unquantized
    weights (no block, or only a KV-cache scheme: vLLM-style FP8-KV checkpoints and kvcap's own
    overlays), FP8Weights for the FP8 formats above; anything else (AWQ, GPTQ, INT4/INT8
    groups, bitsandbytes ...) is refused by name rather than left to fail on its first packed
    tensor."""
    if not isinstance(qc, dict):
        return None
    method = qc.get("quant_method", "?")
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        if not groups:
            return None
        blocks = {_compressed_tensors_group(name, g) for name, g in groups.items()}
        if len(blocks) > 1:
            raise ConfigError(f"compressed-tensors config_groups use different weight blocks "
                              f"{sorted(map(str, blocks))}: not supported")
        return FP8Weights(method, blocks.pop())
    if method == "fp8":
        block = qc.get("weight_block_size")
        return FP8Weights(method, _block(block, "weight_block_size") if block else None)
    if method == "fbgemm_fp8":
        return FP8Weights(method)
    raise ConfigError(f"the checkpoint's weights are quantized (quantization_config quant_method "
                      f"{method!r}): kvcap loads FP32/FP16/BF16 weights and FP8 (E4M3) weights "
                      "(compressed-tensors float, quant_method fp8 or fbgemm_fp8); use the "
                      "unquantized checkpoint")


def _compressed_tensors_group(name: str, group: Any) -> tuple[int, int] | None:
    w = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(w, dict):
        raise ConfigError(f"compressed-tensors config_groups.{name} has no `weights` scheme")
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ConfigError(f"compressed-tensors config_groups.{name}: {w.get('num_bits')}-bit "
                          f"{w.get('type')} weights; kvcap loads only 8-bit float (FP8 E4M3) "
                          "weight groups -- use the unquantized checkpoint")
    strategy = w.get("strategy", "tensor")
    if strategy in ("tensor", "channel"):
        return None
    if strategy == "block":
        return _block(w.get("block_structure"), f"config_groups.{name}.weights.block_structure")
    raise ConfigError(f"compressed-tensors config_groups.{name}: weight strategy {strategy!r} is "
                      "not supported (tensor, channel or block)")


def _block(value: Any, what: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and v > 0 for v in value)):
        raise ConfigError(f"quantization_config {what} {value!r} is not two positive integers")
    return int(value[0]), int(value[1])


def dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None) -> torch.Tensor:
    """FP32 w * s for an E4M3 weight [out, in] and its scale: one value, one per row
    ([out] or [out, 1]), or one per `block` ([ceil(out / b0), ceil(in / b1)])."""
    if scale.dtype == torch.uint8:
        raise ModelLoadError(f"{name}: uint8 (E8M0) weight scales are not supported")
    out, cols = weight.shape
    w = weight.float()
    s = scale.float()
    grid = None if block is None else (-(-out // block[0]), -(-cols // block[1]))
    if grid is not None and s.dim() == 2 and tuple(s.shape) == grid:
        s = s.repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :cols]
        return w * s
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == out and s.shape[0] == out:
        return w * s.reshape(out, 1)
    raise ModelLoadError(f"{name}: scale of shape {tuple(scale.shape)} fits neither the tensor, "
                         f"its {out} rows nor {block} blocks of its {out} x {cols} weight")


def dequantized(tensors: Iterable[tuple[str, torch.Tensor]], fmt: FP8Weights,
                device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) stream with every E4M3 weight replaced by its FP32
    dequantized value (held until its scale arrives, or the scale until its weight) and the
    scale and activation-scale tensors taken out. With `device` (the model's) the FP8 bytes
    travel there and are multiplied out there: a GPU does it faster than the host, and the
    copy moves one byte a value instead of four."""
    # module prefix -> what has come of its pair: "weight" (E4M3) and "scale" (name, tensor)
    pending: dict[str, dict[str, Any]] = {}
    count = 0
    for name, tensor in tensors:
        if name.endswith(DROPPED_SUFFIXES):
            continue
        suffix = next((s for s in WEIGHT_SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            prefix, part, tensor = name[: -len(suffix)], "scale", (name, tensor)
        elif tensor.dtype == torch.float8_e4m3fn and name.endswith(".weight"):
            prefix, part = name[: -len(".weight")], "weight"
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ModelLoadError(f"{name}: an FP8 ({tensor.dtype}) tensor kvcap cannot dequantize")
        else:
            yield name, tensor
            continue
        pair = pending.setdefault(prefix, {})
        pair[part] = tensor
        if len(pair) == 2:
            del pending[prefix]
            (scale_name, scale), weight = pair["scale"], pair["weight"]
            if device is not None:  # one byte a value over the copy, the multiply on the GPU
                weight, scale = weight.to(device), scale.to(device)
            yield f"{prefix}.weight", dequantize(scale_name, weight, scale, fmt.block)
            count += 1
    lone_weights = [p for p, pair in pending.items() if "weight" in pair]
    if lone_weights:
        raise ModelLoadError(f"{len(lone_weights)} FP8 weights have no weight_scale in the "
                             f"checkpoint, e.g. {lone_weights[0]}.weight")
    if pending:
        raise ModelLoadError(f"{len(pending)} weight scales have no FP8 weight in the "
                             f"checkpoint, e.g. {next(iter(pending))}")
    logger.info("%d weights dequantized from %s", count, fmt.describe())
