"""l2_prefetch: pull a tensor's bytes into the GPU's L2 cache without using registers or
shared memory (Hopper's bulk-copy unit, `cp.async.bulk.prefetch.L2`). An experiment, not used
by the engine.

The idea: at decode batch sizes cuBLAS reads a weight at 55-85% of the DRAM ceiling, and at
short contexts attention leaves DRAM mostly idle, so prefetching the next GEMM's weight (during
attention on a side stream, or just before the GEMM) might let the GEMM read L2. Measured on
the H200 (scripts/l2_prefetch_probe.py, docs/kernels.md "Sixteenth change"): it does not — the
GEMM after a prefetch takes as long as without one, and the prefetch costs its own time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcap.kernels.common import FP_FUSION

CHUNK_BYTES = 16384  # bytes one lane asks for (a multiple of 16)
LANES = 32


@triton.jit
def _l2_prefetch_kernel(ptr, n_bytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    lane = tl.arange(0, LANES)
    off = (tl.program_id(0) * LANES + lane).to(tl.int64) * CHUNK
    size = tl.minimum(n_bytes - off, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr + off, size], dtype=tl.int32, is_pure=False, pack=1)


def supported(device: torch.device) -> bool:
    """The bulk prefetch needs sm_90+ (Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def l2_prefetch(t: torch.Tensor) -> None:
    """Ask L2 for all of contiguous tensor `t`'s bytes (asynchronous; nothing is returned)."""
    if not t.is_contiguous():
        raise ValueError("l2_prefetch needs a contiguous tensor")
    n = t.numel() * t.element_size()
    if n % 16:
        raise ValueError("l2_prefetch needs a size that is a multiple of 16 bytes")
    flat = t.view(torch.uint8).view(-1)
    grid = (triton.cdiv(n, CHUNK_BYTES * LANES),)
    _l2_prefetch_kernel[grid](flat, n, CHUNK=CHUNK_BYTES, LANES=LANES, num_warps=1, **FP_FUSION)
