"""torch's own symmetric-memory all-reduce for small messages (CUDA, `KVCAP_ALLREDUCE=symm`).

Each rank allocates one symmetric buffer of MAX_BYTES (`torch.distributed._symmetric_memory.
empty` + `rendezvous` on the data group); an all-reduce copies its input into the buffer and
runs `torch.ops.symm_mem.one_shot_all_reduce` (every rank reads all peers' buffers over NVLink,
no multicast: TORCH_SYMM_MEM_DISABLE_MULTICAST=1 stays set). torch 2.11's one-shot kernel has
no FP16 instantiation (H200 run, 2026-11-29: every FP16 call fell back to NCCL), so FP16
activations are staged in an FP32 buffer: the copy casts, the sum runs in FP32 (no less exact
than NCCL's FP16 sum) and the result is cast back. Larger messages use the data group's NCCL
all-reduce. Set-up is collective and verified: one all-reduce of
known values must come out exact on every rank, else every rank falls back to NCCL with a
warning. On 2x H200 (2026-11-30) it set up and passed the self-check, but was no faster than
NCCL in a graph, so NCCL stays the default (see docs/tensor_parallel.md).
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvcap.distributed.comm import Communicator

logger = logging.getLogger(__name__)

MAX_BYTES = 1 << 20  # one-shot pays off for small messages (decode: batch x hidden x 2 bytes)
# The buffer dtype for each activation dtype (FP16 has no one-shot kernel in torch 2.11).
STAGING_DTYPE = {torch.float16: torch.float32}


class SymmAllReduce:
    def __init__(self, buffer: torch.Tensor, group_name: str, dtype: torch.dtype):
        self.buffer, self.group_name, self.dtype = buffer, group_name, dtype

    @classmethod
    def create(cls, comm: Communicator, dtype: torch.dtype) -> SymmAllReduce | None:
        """Collective. Returns None (NCCL fallback) on every rank if any rank cannot use it."""
        inst: SymmAllReduce | None = None
        error = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            name = comm.data_group.group_name
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:  # required by older torch, deprecated by newer
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    enable(name)
            elems = MAX_BYTES // torch.empty((), dtype=dtype).element_size()
            staging = STAGING_DTYPE.get(dtype, dtype)
            buf = symm_mem.empty(elems, dtype=staging, device=comm.device)
            symm_mem.rendezvous(buf, name)
            inst = cls(buf, name, dtype)
            # 4-byte-aligned sizes only: the one-shot op refuses others (H200 run, 2026-11-29:
            # a 257-element FP16 probe failed the set-up, so every rank fell back to NCCL).
            probe = torch.full((258,), float(comm.rank + 1), dtype=dtype, device=comm.device)
            got = inst(probe)
            want = comm.world * (comm.world + 1) / 2
            if not bool((got == want).all()):
                raise RuntimeError(f"self-check gave {got.float().unique().tolist()}, "
                                   f"expected {want}")
        except Exception as e:  # any failure: fall back, on every rank
            error = f"{type(e).__name__}: {e}"
        errors = comm.all_gather_object(error)
        bad = [(r, e) for r, e in enumerate(errors) if e is not None]
        if bad:
            if comm.rank == 0:
                logger.warning("symmetric-memory all-reduce unavailable (rank %d: %s); using "
                               "NCCL", bad[0][0], bad[0][1])
            return None
        if comm.rank == 0:
            logger.info("all-reduce: symmetric-memory one-shot up to %d KiB of %s (summed in "
                        "%s), NCCL above", MAX_BYTES >> 10, dtype, inst.buffer.dtype)
        return inst

    def fits(self, x: torch.Tensor) -> bool:
        """Whether the one-shot path takes x (else NCCL): the set-up dtype, contiguous, at most
        the buffer, and a staged byte size that is a multiple of 4 (torch's one-shot kernel
        requires it)."""
        return (x.is_cuda and x.dtype == self.dtype and x.is_contiguous()
                and x.numel() <= self.buffer.numel()
                and (x.numel() * self.buffer.element_size()) % 4 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        view = self.buffer[: x.numel()]
        view.copy_(x.reshape(-1))
        out = torch.ops.symm_mem.one_shot_all_reduce(view, "sum", self.group_name)
        return out.view_as(x).to(x.dtype)
