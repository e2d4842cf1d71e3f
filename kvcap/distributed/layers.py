"""Tensor-parallel building blocks for the Llama-family model.

Column-parallel projections (fused QKV, fused gate/up) are plain `nn.Linear` layers holding
this rank's output rows: no communication. The layers here are the ones that talk:

- `RowParallelLinear` (o_proj, down_proj): input features split, partial products summed by an
  all-reduce; every rank ends with the full output.
- `VocabParallelEmbedding`: each rank holds a contiguous vocabulary range, looks up the ids it
  owns, zeroes the others and all-reduces (exact: one non-zero term per row).
- `ParallelLMHead`: each rank computes the logits of its vocabulary range; they are gathered
  on rank 0 (which samples) and other ranks get None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvcap.distributed.comm import Communicator
from kvcap.distributed.partition import TPShard, split_range
from kvcap.models.decode_gemm import linear
from kvcap.models.fp8_linear import FP8Linear


@dataclass(frozen=True)
class ModelParallel:
    """What a model needs to build its shard: the ranges it owns and the group to talk to."""

    shard: TPShard
    comm: Communicator


class RowParallelLinear(nn.Linear):
    """y[T, out] = all_reduce(x_local[T, in_local] @ W_local[out, in_local]^T); no bias."""

    def __init__(self, in_local: int, out_features: int, comm: Communicator,
                 kind: str | None = None):
        super().__init__(in_local, out_features, bias=False)
        self.comm = comm
        self.kind = kind  # kvcap.models.decode_gemm's rule for decode rows (None: cuBLAS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight) if self.kind is None else linear(x, self.weight, self.kind)
        return self.comm.all_reduce(y)


class RowParallelFP8Linear(FP8Linear):
    """RowParallelLinear with its weight kept in FP8 (kvcap.models.fp8_linear): this rank's
    input columns, the partial products all-reduced."""

    def __init__(self, in_local: int, out_features: int, row_block: int, k_group: int,
                 comm: Communicator):
        super().__init__(in_local, out_features, row_block, k_group)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """Rows [lo, hi) of the embedding table; ids[T] int64 -> [T, dim] (full, on every rank)."""

    def __init__(self, vocab: tuple[int, int], dim: int, comm: Communicator):
        super().__init__(vocab[1] - vocab[0], dim)
        self.lo, self.hi = vocab
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)
        local = torch.where(mine, ids - self.lo, torch.zeros_like(ids))
        x = F.embedding(local, self.weight).masked_fill(~mine.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(x)


class ParallelLMHead(nn.Module):
    """Rows [lo, hi) of the LM head (tied to the embedding shard when the model ties them).

    forward(hidden [n, hidden]) -> FP32 logits [n, vocab] on rank 0, None on other ranks.
    """

    def __init__(self, shard: TPShard, vocab_size: int, hidden: int, comm: Communicator):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard.vocab_size, hidden))
        self.widths = [b - a for a, b in (split_range(vocab_size, shard.world, r)
                                          for r in range(shard.world))]
        self.comm = comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = linear(hidden, self.weight, "lm_head")
        return self.comm.gather_columns(logits.float(), self.widths)
