"""Which linears of a decode step run kvcap's weight-streaming GEMMs instead of cuBLAS.

A decode step's linears read their whole weight for a few rows. For the row-parallel output
projection cuBLAS picks split-K plus a separate reduce kernel at these sizes, and the MLP's
gate/up GEMM is followed by a separate SiLU-and-multiply kernel; kvcap.kernels.skinny_gemm does
each in one kernel (`skinny_linear`, `skinny_swiglu`); the bias-free QKV projection joins at <= 16
rows, where the step's kernels launch as programmatic dependents (docs/kernels.md, "Twenty-second
change"). The rule here routes a linear to them
when its input has at most ROW_LIMITS[kind] rows (ROW_LIMITS_BY_GPU's on the GPUs it names:
the SXM H100 and the H200 take every kind up to 64 rows; decode batches, prefill stays on
cuBLAS), the
tensors are FP16/BF16 on a GPU of the architecture they were measured on (Hopper, SM 9.x:
docs/kernels.md "Twentieth change"), and KVCAP_DISABLE_SKINNY_GEMM is unset.
KVCAP_SKINNY_GEMM_MAX_ROWS=N replaces every row limit with N (0: never), for measurements.

The choice depends only on the row count, so an eager step and a CUDA-graph replay of the same
rows (padded to a graph bucket within the same limit) take the same kernel.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvcap.config import env_flag, env_rows

DISABLE_ENV = "KVCAP_DISABLE_SKINNY_GEMM"
MAX_ROWS_ENV = "KVCAP_SKINNY_GEMM_MAX_ROWS"

# kvcap.kernels.skinny_gemm.MAX_ROWS, not imported: a CPU install need not have triton.
SKINNY_MAX_ROWS = 64
# Rows up to which each kind beats cuBLAS end to end on the H200 (docs/kernels.md). The
# bias-free QKV projection alone took 1.02x cuBLAS's time (2026-12-01); it joins at <= 16 rows
# so that a decode step's chain of programmatic dependent launches (kernels.common.pdl_launch)
# is not broken by a cuBLAS kernel once per layer.
ROW_LIMITS = {"qkv_proj": 16, "o_proj": 32, "down_proj": 16, "swiglu": 32, "lm_head": 64}
# GPUs whose name holds a key here take its limits instead. On the H100 every linear of a step
# of up to 64 rows on these kernels, every kernel a programmatic dependent (the H100's
# kernels.common.PDL_MAX_ROWS_BY_GPU), gained 3.0% / 3.4% at the 8B's 64 x 1K (BF16 / E4M3 KV;
# docs/kernels.md, "Thirty-sixth change"); on the H200 the same switch gained 3.4% / 3.6% at
# 64 x 1K, arms alternated twice (docs/kernels.md, "Thirty-seventh change"), although there the
# fused gate/up alone had taken 1.10x cuBLAS plus the activation kernel at 64 rows.
# The PCIe and NVL H100s (other memory) keep ROW_LIMITS, unmeasured.
ROW_LIMITS_BY_GPU = {name: dict.fromkeys(ROW_LIMITS, SKINNY_MAX_ROWS)
                     for name in ("H100 80GB HBM3", "H200")}


@functools.cache
def _measured_arch(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def row_limits(gpu_name: str = "") -> dict[str, int]:
    """Each kind's row limit on a GPU of that name (ROW_LIMITS_BY_GPU's where a key is part of
    it, else ROW_LIMITS)."""
    return next((v for k, v in ROW_LIMITS_BY_GPU.items() if k in gpu_name), ROW_LIMITS)


def wants_skinny(kind: str, rows: int, gpu_name: str = "") -> bool:
    """The rule's switch and row part: `rows` rows of `kind` go to the skinny kernel (on a
    measured GPU, with FP16/BF16 operands); KVCAP_SKINNY_GEMM_MAX_ROWS replaces the limit."""
    if env_flag(DISABLE_ENV):
        return False
    limit = env_rows(MAX_ROWS_ENV, row_limits(gpu_name)[kind])
    return 1 <= rows <= min(limit, SKINNY_MAX_ROWS)


def skinny_for(x: torch.Tensor, weight: torch.Tensor, kind: str):
    """kvcap.kernels.skinny_gemm when `kind`'s GEMM of x [M, K] with weight should run there,
    else None (cuBLAS / torch ops)."""
    if (not x.is_cuda or x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16)
            or weight.dtype != x.dtype or x.stride(1) != 1 or weight.stride(1) != 1):
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if not _measured_arch(index) or not wants_skinny(kind, x.shape[0], _gpu_name(index)):
        return None
    from kvcap.kernels import skinny_gemm

    return skinny_gemm


def linear(x: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor:
    """x @ weight.T (no bias) through the skinny kernel where the rule says so, else F.linear."""
    skinny = skinny_for(x, weight, kind)
    if skinny is None:
        return F.linear(x, weight)
    return skinny.skinny_linear(x, weight)


def swiglu(x: torch.Tensor, gate_up_weight: torch.Tensor):
    """silu(x @ gate.T) * (x @ up.T) in one kernel where the rule says so, else None (the caller
    runs its GEMM and activation)."""
    skinny = skinny_for(x, gate_up_weight, "swiglu")
    return None if skinny is None else skinny.skinny_swiglu(x, gate_up_weight)


class DecodeLinear(torch.nn.Linear):
    """A bias-free nn.Linear whose decode-size calls follow the rule above for `kind`."""

    def __init__(self, in_features: int, out_features: int, kind: str):
        super().__init__(in_features, out_features, bias=False)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.kind)
