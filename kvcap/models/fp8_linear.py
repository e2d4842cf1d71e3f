"""Linear layers whose weights stay FP8 (E4M3) on the device, with their FP32 scales.

An FP8-weight checkpoint (kvcap.models.fp8_weights) is either dequantized to 16 bits as it
loads (fp8_weights "dequantize"; "auto" on the CPU and before sm_80) or kept (fp8_weights
"keep", or "auto" on CUDA sm_80+ where the layout allows): one byte a weight instead of
two -- half the weight memory, which goes to the KV cache, and half the bytes a decode step
streams. Kept weights run through
kvcap.kernels.fp8_gemm on CUDA: its streaming GEMM for up to `max_rows()` rows (decode steps),
and for larger steps (prefill chunks, compute-bound) the weight dequantized into one shared
scratch buffer and cuBLAS. On the CPU the same arithmetic runs in torch (the kernels' twin).

The scales are kept per group of `row_block` output rows x `k_group` input columns (one group
per row for per-tensor and per-channel formats, the checkpoint's blocks for block formats;
`layout`). Weight bytes and scale bits are held in integer tensors: `model.to(dtype)` converts
floating-point parameters and must leave both alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvcap.config import env_rows
from kvcap.errors import ConfigError, ModelLoadError
from kvcap.models.fp8_weights import FP8Tensor, FP8Weights, expand_scale

if TYPE_CHECKING:
    from kvcap.config import ModelSpec

logger = logging.getLogger(__name__)

MAX_ROWS_ENV = "KVCAP_FP8_GEMM_MAX_ROWS"
# kvcap.kernels.fp8_gemm.MAX_ROWS, not imported: a CPU install need not have triton.
KERNEL_MAX_ROWS = 256
FP8_WEIGHT_MODES = ("auto", "keep", "dequantize")


def max_rows() -> int:
    """Rows up to which the streaming kernel runs (KVCAP_FP8_GEMM_MAX_ROWS=N for
    measurements; 0: always dequantize + cuBLAS)."""
    return min(env_rows(MAX_ROWS_ENV, KERNEL_MAX_ROWS), KERNEL_MAX_ROWS)


def layout(fmt: FP8Weights, in_features: int, parts: Sequence[int],
           row_offsets: Sequence[int] = (), k_offset: int = 0) -> tuple[int, int]:
    """(row_block, k_group) for a linear of `in_features` inputs whose output rows are the
    checkpoint tensors `parts` (fused q/k/v, gate/up), each taken from `row_offsets` of its
    checkpoint tensor (a tensor-parallel rank's rows; 0 without TP), its inputs from column
    `k_offset`: the checkpoint's blocks where every part starts on one, else one scale row
    per output row. A rank's inputs must start on a K block."""
    if fmt.block is None:
        return 1, in_features
    b0, b1 = fmt.block
    k_group = min(b1, in_features)
    if k_group < in_features and k_group % 16:
        raise ConfigError(f"{fmt.describe()}: kvcap's FP8 GEMM needs K blocks of a multiple of "
                          f"16 columns, not {b1}; load with fp8_weights='dequantize'")
    if k_offset % b1:
        raise ConfigError(f"{fmt.describe()}: this tensor-parallel rank's inputs start at column "
                          f"{k_offset}, inside a {b1}-column scale block; load with "
                          "fp8_weights='dequantize' or use another tensor_parallel_size")
    starts = [sum(parts[:i]) for i in range(1, len(parts))] + list(row_offsets)
    return (b0 if all(a % b0 == 0 for a in starts) else 1), k_group


def keep_refusal(spec: ModelSpec, tensor_parallel_size: int) -> str | None:
    """Why `spec`'s checkpoint weights cannot stay FP8 here (None: they can)."""
    fmt = spec.fp8_weights
    if fmt is None:
        return "the checkpoint's weights are not FP8"
    if fmt.unquantized:
        return (f"the checkpoint leaves {len(fmt.unquantized)} module patterns unquantized "
                f"(e.g. {fmt.unquantized[0]!r})")
    if fmt.block is None:
        return None
    if fmt.block[1] % 16:
        return f"K blocks of {fmt.block[1]} columns (the FP8 GEMM needs a multiple of 16)"
    from kvcap.distributed.partition import plan_shard

    for rank in range(1, tensor_parallel_size):  # row-parallel inputs start on a K block
        shard = plan_shard(spec, tensor_parallel_size, rank)
        for what, col in (("o_proj", shard.q_heads[0] * spec.head_dim),
                          ("down_proj", shard.inter[0])):
            if col % fmt.block[1]:
                return (f"tensor-parallel rank {rank}'s {what} inputs start at column {col}, "
                        f"inside a {fmt.block[1]}-column scale block")
    return None


def resolve_keep(mode: str, spec: ModelSpec, device: torch.device,
                 tensor_parallel_size: int = 1) -> bool:
    """Whether an FP8 checkpoint's weights stay FP8: "keep" (an error where they cannot),
    "dequantize", or "auto" (the default: kept on CUDA GPUs with tensor-core MMA, compute
    capability 8.0+, wherever the layout allows -- measured there, 1.4-1.5x the decode speed
    of the dequantized weights at 1-16 x 1K on an H100; GPUs below run the GEMM on FMA dots,
    not measured, so auto dequantizes there and "keep" remains a choice)."""
    if mode not in FP8_WEIGHT_MODES:
        raise ConfigError(f"fp8_weights must be one of {', '.join(FP8_WEIGHT_MODES)}, got "
                          f"{mode!r}")
    if spec.fp8_weights is None or mode == "dequantize":
        return False
    refusal = keep_refusal(spec, tensor_parallel_size)
    if mode == "keep":
        if refusal is not None:
            raise ConfigError(f"fp8_weights='keep': {refusal}; use fp8_weights='dequantize'")
        return True
    if device.type != "cuda":
        return False
    if refusal is None and torch.cuda.get_device_capability(device) < (8, 0):
        refusal = "the GPU has no tensor-core MMA for the FP8 GEMM (compute capability < 8.0)"
    if refusal is not None:
        logger.info("FP8 weights dequantized to 16 bits: %s", refusal)
    return refusal is None


def large_batch_note(kept: bool, mode: str, max_num_seqs: int) -> str | None:
    """What auto's choice costs an engine that batches more than 64 sequences a step: there
    the FP8 GEMM is compute-bound and kept FP8 weights decoded the 8B shape at 0.91x / 0.85x
    the speed of the dequantized checkpoint at 128 / 256 x 1K on an H100 with per-row scales,
    0.93x / 0.80x with 128 x 128 blocks (throughput-2026-12-06h-h100-8b-fp8-weights-64-256.json).
    None where it does not apply (dequantized, chosen with "keep", or at most 64 sequences a
    step)."""
    if not kept or mode != "auto" or max_num_seqs <= 64:
        return None
    return (f"FP8 weights kept (fp8_weights='auto') with max_num_seqs={max_num_seqs}: decode "
            f"steps of more than 64 sequences measured 0.80-0.93x the speed of 16-bit weights "
            f"on an H100 (the FP8 GEMM is compute-bound there); fp8_weights='dequantize' "
            f"trades the weight memory back for that speed")


def dequantize_reference(w: torch.Tensor, scale: torch.Tensor, row_block: int,
                         k_group: int) -> torch.Tensor:
    """FP32 w * s of E4M3 bytes [N, K] and FP32 group scales: the kernels' torch twin."""
    return w.view(torch.float8_e4m3fn).float() * expand_scale(scale, row_block, k_group,
                                                              tuple(w.shape))


def reserve_scratch(model: nn.Module, dtype: torch.dtype) -> int:
    """Give the model's FP8 layers one shared buffer, sized for the largest weight, to
    dequantize into for large steps: allocated now, with the weights (so the KV pool sizing
    counts it as theirs and no step allocates it), and freed with the model. Returns its bytes
    (0 without FP8 layers on CUDA)."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear) and m.weight.is_cuda]
    if not layers:
        return 0
    numel = max(m.weight.numel() for m in layers)
    buf = torch.empty(numel, dtype=dtype, device=layers[0].weight.device)
    for m in layers:
        m.scratch = buf
    return numel * dtype.itemsize


class FP8Linear(nn.Module):
    """y = x @ (w * s)^T (+ bias), w [out, in] E4M3 bytes, s FP32 per (row_block x k_group)."""

    def __init__(self, in_features: int, out_features: int, row_block: int, k_group: int,
                 bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.row_block, self.k_group = row_block, k_group
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.uint8),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(  # FP32 bits (int32: model.to(dtype) keeps them)
            torch.empty(math.ceil(out_features / row_block), math.ceil(in_features / k_group),
                        dtype=torch.int32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # reserve_scratch's shared dequantization buffer (None: a step allocates its own)
        self.scratch: torch.Tensor | None = None

    @property
    def scale(self) -> torch.Tensor:
        return self.weight_scale.view(torch.float32)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, E4M3 "
                f"scales per {self.row_block} x {self.k_group}, bias={self.bias is not None}")

    def load_rows(self, name: str, rows: slice | None, t: FP8Tensor) -> None:
        """Write checkpoint tensor `t` into output rows `rows` (all when None): its bytes, and
        its scales regrouped into this layer's groups."""
        start = 0 if rows is None else rows.start
        n = t.weight.shape[0]
        stop = start + n
        if t.weight.shape[1] != self.in_features or stop > self.out_features:
            raise ModelLoadError(f"shape mismatch for {name}: checkpoint "
                                 f"{tuple(t.weight.shape)} vs model rows {start}:{stop} of "
                                 f"{self.out_features} x {self.in_features}")
        if start % self.row_block or (stop % self.row_block and stop != self.out_features):
            raise ModelLoadError(f"{name}: rows {start}:{stop} do not start on this layer's "
                                 f"{self.row_block}-row scale blocks")
        scale = t.grouped(self.row_block, self.k_group, name)
        self.weight[start:stop].copy_(t.weight.view(torch.uint8))
        first = start // self.row_block
        self.scale[first:first + scale.shape[0]].copy_(scale)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """w * s rounded to `dtype` ([out, in]; on CUDA a view of the shared scratch buffer)."""
        if self.weight.is_cuda:
            from kvcap.kernels import fp8_gemm

            buf = self.scratch
            if buf is None or buf.dtype != dtype:
                buf = torch.empty(self.weight.numel(), dtype=dtype, device=self.weight.device)
            out = buf[:self.weight.numel()].view(self.weight.shape)
            return fp8_gemm.dequantize_into(self.weight, self.scale, self.row_block,
                                            self.k_group, out)
        return dequantize_reference(self.weight, self.scale, self.row_block,
                                    self.k_group).to(dtype)

    def _streams(self, x: torch.Tensor) -> bool:
        """Whether x [M, in] runs the streaming kernel (else dequantize + cuBLAS / torch)."""
        return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
                and 1 <= x.shape[0] <= max_rows())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self._streams(x2):
            from kvcap.kernels import fp8_gemm

            y = fp8_gemm.fp8_linear(x2.contiguous(), self.weight, self.scale, self.row_block,
                                    self.k_group, self.bias)
        else:
            y = F.linear(x2, self.dequantized(x2.dtype), self.bias)
        return y.reshape(*lead, self.out_features)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(x @ gate^T) * (x @ up^T) of this [gate; up] layer in one kernel where x [M, in]
        streams, else None (the caller runs forward and its activation)."""
        if x.dim() != 2 or not self._streams(x) or self.bias is not None:
            return None
        from kvcap.kernels import fp8_gemm

        if not fp8_gemm.swiglu_pays(x.shape[0], self.out_features // 2, x.device):
            return None
        return fp8_gemm.fp8_linear(x.contiguous(), self.weight, self.scale, self.row_block,
                                   self.k_group, swiglu=True)


def fp8_linears(model: nn.Module) -> dict[int, FP8Linear]:
    """id(weight parameter) -> its FP8Linear, for the weight loader."""
    return {id(m.weight): m for m in model.modules() if isinstance(m, FP8Linear)}


def dummy_fp8(shape: tuple[int, int], row_block: int, k_group: int, device: torch.device,
              gen: torch.Generator, std: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP8 weights for performance runs, as (E4M3 bytes, FP32 group scales): N(0, std)
    quantized under one scale that puts the spread well inside E4M3's range (448 = 7
    standard deviations). The rare sample past 7 sigma saturates to +-448: torch's cast gave
    it a NaN byte on versions before the cast itself saturated (the supported range spans
    both)."""
    s = 7 * std / 448
    w = torch.empty(shape, device=device)
    w.normal_(0.0, std, generator=gen)
    scale = torch.full((math.ceil(shape[0] / row_block), math.ceil(shape[1] / k_group)), s,
                       device=device)
    return (w / s).clamp_(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8), scale


def init_dummy(layer: FP8Linear, gen: torch.Generator) -> None:
    w, scale = dummy_fp8(tuple(layer.weight.shape), layer.row_block, layer.k_group,
                         layer.weight.device, gen)
    layer.weight.copy_(w)
    layer.scale.copy_(scale)
    if layer.bias is not None:
        layer.bias.zero_()
