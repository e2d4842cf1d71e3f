"""FP8 (E4M3) weight checkpoints: each weight paired with its scale as they load.

A checkpoint whose linear weights are stored in FP8 -- compressed-tensors `float-quantized`
(per-tensor, per-channel or block scales in `weight_scale`), transformers' fine-grained FP8
(`quant_method: fp8`, block scales in `weight_scale_inv`) or FBGEMM FP8 (per-channel
`weight_scale`) -- streams in as FP8Tensor pairs (`fp8_tensors`): multiplied back to
W = w_e4m3 * s (`dequantized`: fp8_weights "dequantize", and "auto" on a CPU or a GPU below
compute capability 8.0), s broadcast over its tensor, row or block, or kept in FP8 by
kvcap.models.fp8_linear (fp8_weights "keep", and "auto", the default, on other CUDA GPUs).
The activation scales these formats carry (`input_scale`, `input_scale_ub`, transformers'
`activation_scale`) are for FP8 x FP8 matmuls kvcap does not run (its activations stay
16-bit), and are dropped. What is not FP8
(norms, embeddings, an `ignore`d lm_head) passes through unchanged.
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
# (`activation_scale`: transformers' fine-grained FP8 name for a static input scale, which
# failed the load as an unexpected tensor)
DROPPED_SUFFIXES = (".input_scale", ".input_scale_ub", ".activation_scale")
# (with ROCm's FNUZ forms, which safetensors also stores: else they passed for 16-bit weights,
# cast without their scales, and the load ended on "scales have no FP8 weight")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
              torch.float8_e5m2fnuz)


@dataclass(frozen=True)
class FP8Weights:
    """How a checkpoint stores FP8 weights: its method and scale block (rows, columns) where
    the scales are per block."""

    method: str
    block: tuple[int, int] | None = None
    # modules the config leaves unquantized besides the LM head (compressed-tensors `ignore`,
    # transformers' `modules_to_not_convert`): a model keeping FP8 cannot hold their 16-bit
    # weights in its FP8 layers
    unquantized: tuple[str, ...] = ()

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
        # Targets other than every Linear (e.g. only "re:.*mlp.*") leave the other linear
        # layers 16-bit with no `ignore` entry: "auto" kept FP8 on a GPU and the load failed on
        # the first 16-bit weight. kvcap does not resolve regexes / class names against its
        # modules, so any other targets count as unquantized modules (auto dequantizes, "keep"
        # is refused naming them), listed first so the refusal names the targets.
        targets = sorted({str(t) for g in groups.values()
                          for t in (g.get("targets") or ()) if str(t) not in ("Linear", "re:.*")})
        partial = (f"Linear modules outside config_groups targets {targets}",) if targets else ()
        return FP8Weights(method, blocks.pop(), partial + _unquantized(qc.get("ignore")))
    if method == "fp8":
        block = qc.get("weight_block_size")
        # AutoFP8 / vLLM-style configs name them `ignored_layers` (transformers reads it as an
        # alias): without it "auto" kept FP8 and failed on their 16-bit weights at load
        skip = [n for key in ("modules_to_not_convert", "ignored_layers")
                if isinstance(qc.get(key), (list, tuple)) for n in qc[key]]
        return FP8Weights(method, _block(block, "weight_block_size") if block else None,
                          _unquantized(skip))
    if method == "fbgemm_fp8":
        return FP8Weights(method, None, _unquantized(qc.get("modules_to_not_convert")))
    raise ConfigError(f"the checkpoint's weights are quantized (quantization_config quant_method "
                      f"{method!r}): kvcap loads FP32/FP16/BF16 weights and FP8 (E4M3) weights "
                      "(compressed-tensors float, quant_method fp8 or fbgemm_fp8); use the "
                      "unquantized checkpoint")


def _unquantized(names: Any) -> tuple[str, ...]:
    """The config's unquantized-module list without the LM head (16-bit in kvcap either way)."""
    if not isinstance(names, (list, tuple)):
        return ()
    return tuple(str(n) for n in names if str(n) not in ("lm_head", "re:.*lm_head", "re:lm_head"))


def _compressed_tensors_group(name: str, group: Any) -> tuple[int, int] | None:
    w = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(w, dict):
        raise ConfigError(f"compressed-tensors config_groups.{name} has no `weights` scheme")
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ConfigError(f"compressed-tensors config_groups.{name}: {w.get('num_bits')}-bit "
                          f"{w.get('type')} weights; kvcap loads only 8-bit float (FP8 E4M3) "
                          "weight groups -- use the unquantized checkpoint")
    # `symmetric: false` stores a weight_zero_point per scale, W = (w - z) * s, which kvcap
    # does not compute: refused here, not after streaming as an "unexpected tensor"
    if w.get("symmetric", True) is not True:
        raise ConfigError(f"compressed-tensors config_groups.{name}: asymmetric FP8 weights "
                          f"(symmetric {w.get('symmetric')!r}, with weight_zero_point tensors); "
                          "kvcap loads only symmetric FP8 weights -- use the unquantized "
                          "checkpoint")
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


def _scale_kind(name: str, scale: torch.Tensor, shape: tuple[int, int],
                block: tuple[int, int] | None) -> str:
    """How a scale covers its [out, in] weight: "tensor" (one value), "row" (one per row) or
    "block" (one per `block`); a misshaped scale is an error naming the scale tensor."""
    if scale.dtype == torch.uint8:
        raise ModelLoadError(f"{name}: uint8 (E8M0) weight scales are not supported")
    out, cols = shape
    grid = None if block is None else (-(-out // block[0]), -(-cols // block[1]))
    if grid is not None and scale.dim() == 2 and tuple(scale.shape) == grid:
        return "block"
    if scale.numel() == 1:
        return "tensor"
    if scale.numel() == out and scale.shape[0] == out:
        return "row"
    raise ModelLoadError(f"{name}: scale of shape {tuple(scale.shape)} fits neither the tensor, "
                         f"its {out} rows nor {block} blocks of its {out} x {cols} weight")


def expand_scale(scale: torch.Tensor, row_block: int, k_group: int,
                 shape: tuple[int, int]) -> torch.Tensor:
    """Group scales [ceil(out / row_block), ceil(in / k_group)] -> one per element of an
    [out, in] weight (the last groups cut at the weight's edges)."""
    out, cols = shape
    return scale.repeat_interleave(row_block, 0)[:out].repeat_interleave(k_group, 1)[:, :cols]


def dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None) -> torch.Tensor:
    """FP32 w * s for an E4M3 weight [out, in] and its scale: one value, one per row
    ([out] or [out, 1]), or one per `block` ([ceil(out / b0), ceil(in / b1)])."""
    out, cols = weight.shape
    kind = _scale_kind(name, scale, (out, cols), block)
    w = weight.float()
    s = scale.float()
    if kind == "block":
        assert block is not None
        return w * expand_scale(s, block[0], block[1], (out, cols))
    if kind == "tensor":
        return w * s.reshape(())
    return w * s.reshape(out, 1)


@dataclass
class FP8Tensor:
    """An E4M3 checkpoint weight [out, in] with its scale, as the checkpoint gives them (`name`:
    the scale tensor's, for errors). It slices along its rows like a tensor (fused q/k/v and
    gate/up tensors split, tensor-parallel rows), its scale rows with it."""

    weight: torch.Tensor
    scale: torch.Tensor
    name: str
    block: tuple[int, int] | None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dim(self) -> int:
        return self.weight.dim()

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.name, self.weight, self.scale, self.block)

    def _kind(self) -> str:
        return _scale_kind(self.name, self.scale, tuple(self.weight.shape), self.block)

    def narrow(self, dim: int, start: int, length: int) -> FP8Tensor:
        kind, w = self._kind(), self.weight.narrow(dim, start, length)
        if dim == 1:  # a tensor-parallel rank's input columns
            if kind != "block" or self.scale.shape[1] == 1:  # one scale along K
                return FP8Tensor(w, self.scale, self.name, self.block)
            assert self.block is not None
            b1 = self.block[1]
            if start % b1:
                raise ModelLoadError(f"{self.name}: columns {start}:{start + length} start "
                                     f"inside a {b1}-column scale block")
            cols = self.scale[:, start // b1: -(-(start + length) // b1)]
            return FP8Tensor(w, cols, self.name, self.block)
        if kind == "tensor":
            return FP8Tensor(w, self.scale, self.name, self.block)
        if kind == "row":
            return FP8Tensor(w, self.scale.reshape(-1, 1)[start:start + length], self.name, None)
        assert self.block is not None
        b0, b1 = self.block
        if start % b0 == 0:
            rows = self.scale[start // b0: -(-(start + length) // b0)]
            return FP8Tensor(w, rows, self.name, self.block)
        # a slice inside a block: one scale row per weight row, the block's along K
        per_row = self.scale.repeat_interleave(b0, 0)[start:start + length]
        return FP8Tensor(w, per_row, self.name, (1, b1))

    def split(self, sizes: list[int]) -> list[FP8Tensor]:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.narrow(0, a, n) for a, n in zip(starts, sizes, strict=True)]

    def grouped(self, row_block: int, k_group: int, where: str) -> torch.Tensor:
        """The FP32 scale per (row_block x k_group) group of the weight, where the checkpoint's
        scales are constant over each group (kvcap.models.fp8_linear.layout chose them so)."""
        out, cols = self.weight.shape
        kind, s = self._kind(), self.scale.float()
        grid = (-(-out // row_block), -(-cols // k_group))
        if kind == "tensor":
            return s.reshape(1, 1).expand(grid)
        b0, b1 = (1, cols) if kind == "row" else self.block  # type: ignore[misc]
        if min(b1, cols) != k_group or (row_block != 1 and row_block != b0):
            raise ModelLoadError(f"{where}: {kind} scales in {b0} x {b1} blocks do not fit the "
                                 f"layer's {row_block} x {k_group} scale groups; load with "
                                 "fp8_weights='dequantize'")
        s = s.reshape(-1, 1) if kind == "row" else s
        return s if row_block == b0 else s.repeat_interleave(b0, 0)[:out]


def fp8_tensors(tensors: Iterable[tuple[str, torch.Tensor]], fmt: FP8Weights,
                device: torch.device | None = None
                ) -> Iterator[tuple[str, torch.Tensor | FP8Tensor]]:
    """The checkpoint's (name, tensor) stream with every E4M3 weight paired with its scale into
    an FP8Tensor (held until its scale arrives, or the scale until its weight) and the scale
    and activation-scale tensors taken out. With `device` (the model's) the FP8 bytes travel
    there, one byte a value."""
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
            # (a 1-D or 3-D one failed in _scale_kind as a bare "ValueError: ... to unpack")
            if tensor.dim() != 2:
                raise ModelLoadError(f"{name}: an FP8 weight of shape {tuple(tensor.shape)}; "
                                     "kvcap loads FP8 weights as [out, in] matrices only")
            prefix, part = name[: -len(".weight")], "weight"
        elif tensor.dtype in FP8_DTYPES:
            raise ModelLoadError(f"{name}: an FP8 ({tensor.dtype}) tensor kvcap cannot dequantize")
        else:
            yield name, tensor
            continue
        pair = pending.setdefault(prefix, {})
        pair[part] = tensor
        if len(pair) == 2:
            del pending[prefix]
            (scale_name, scale), weight = pair["scale"], pair["weight"]
            if device is not None:
                weight, scale = weight.to(device), scale.to(device)
            _scale_kind(scale_name, scale, tuple(weight.shape), fmt.block)
            yield f"{prefix}.weight", FP8Tensor(weight, scale, scale_name, fmt.block)
            count += 1
    lone_weights = [p for p, pair in pending.items() if "weight" in pair]
    if lone_weights:
        raise ModelLoadError(f"{len(lone_weights)} FP8 weights have no weight_scale in the "
                             f"checkpoint, e.g. {lone_weights[0]}.weight")
    if pending:
        raise ModelLoadError(f"{len(pending)} weight scales have no FP8 weight in the "
                             f"checkpoint, e.g. {next(iter(pending))}")
    logger.info("%d FP8 weights paired with their scales (%s)", count, fmt.describe())


def dequantized(tensors: Iterable[tuple[str, torch.Tensor]], fmt: FP8Weights,
                device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """fp8_tensors' stream with every E4M3 weight replaced by its FP32 dequantized value. With
    `device` the multiply runs there: a GPU does it faster than the host, and the copy moves
    one byte a value instead of four."""
    for name, tensor in fp8_tensors(tensors, fmt, device):
        yield name, tensor.dequantize() if isinstance(tensor, FP8Tensor) else tensor
