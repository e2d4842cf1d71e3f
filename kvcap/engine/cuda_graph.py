"""CUDA graphs for decode-only steps.

One graph per (batch bucket, context class). Inputs live in static buffers; a real batch of B
sequences is padded up to its bucket with rows that read the pool's null block (all zeros)
and write nowhere (slot -1). Scales are device tensors, so graphs capture them by address.
The split-K count is a launch-time choice that is correct for any length; the context class
only picks a count suited to the batch's longest sequence. `KVCAP_ENFORCE_EAGER=1` (or
`enforce_eager=True`) turns graphs off.
"""

from __future__ import annotations

import logging
import os

import torch
from tqdm.auto import tqdm

from kvcap.attention.metadata import AttentionMetadata
from kvcap.models.llama import ForwardContext

logger = logging.getLogger(__name__)


def graphs_disabled() -> bool:
    return os.environ.get("KVCAP_ENFORCE_EAGER", "0") == "1"


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, model, backend, pool, device: torch.device, max_num_seqs: int,
                 max_model_len: int):
        self.model, self.backend, self.pool, self.device = model, backend, pool, device
        self.buckets = batch_buckets(max_num_seqs)
        self.classes = sorted({c for c in (2048, 16384) if c < max_model_len} | {max_model_len})
        self.block_size = pool.spec.block_size
        width = -(-max_model_len // self.block_size)
        n = self.buckets[-1]
        z = lambda *shape, dt: torch.zeros(shape, dtype=dt, device=device)
        self.input_ids = z(n, dt=torch.int64)
        self.positions = z(n, dt=torch.int64)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, width), pool.null_block, dtype=torch.int32,
                                       device=device)
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool_handle = None

    def _meta(self, b: int, ctx_class: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            context_lens=self.seq_lens[:b] - 1,
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu=[1] * b,
            max_query_len=1,
            max_seq_len=ctx_class,
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        keys = [(b, c) for b in reversed(self.buckets) for c in self.classes]
        for b, c in tqdm(keys, desc="capturing decode CUDA graphs"):
            ctx = ForwardContext(self.backend, self.pool, self._meta(b, c), None)
            args = (self.input_ids[:b], self.positions[:b], ctx)
            self.model(*args)  # warm-up: compile kernels for this shape outside the graph
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool_handle):
                self.hidden[(b, c)] = self.model(*args)
            if self.pool_handle is None:
                self.pool_handle = graph.pool()
            self.graphs[(b, c)] = graph
        torch.cuda.synchronize(self.device)
        logger.info("decode CUDA graphs: batch buckets %s x context classes %s", self.buckets,
                    self.classes)

    def context_class(self, max_seq_len: int) -> int:
        """The split-count hint both paths use, so eager and graph steps reduce alike."""
        return next((c for c in self.classes if c >= max_seq_len), max_seq_len)

    def can_run(self, num_seqs: int, max_seq_len: int) -> bool:
        return num_seqs <= self.buckets[-1] and max_seq_len <= self.classes[-1]

    def run(self, input_ids: list[int], positions: list[int], tables: list[list[int]]
            ) -> torch.Tensor:
        """Replay for a decode-only batch; returns hidden states [B, hidden] (a view)."""
        return self.replay(self.prepare(input_ids, positions, tables), len(input_ids))

    def replay(self, key: tuple[int, int], b: int) -> torch.Tensor:
        self.graphs[key].replay()
        return self.hidden[key][:b]

    def prepare(self, input_ids: list[int], positions: list[int], tables: list[list[int]]
                ) -> tuple[int, int]:
        """Fill the static input buffers for a decode-only batch; returns the graph's key."""
        b = len(input_ids)
        bucket = next(s for s in self.buckets if s >= b)
        seq_lens = [p + 1 for p in positions]
        ctx_class = self.context_class(max(seq_lens))
        bs = self.block_size
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
        width = max(len(t) for t in tables)
        null = self.pool.null_block
        table = torch.tensor([t + [null] * (width - len(t)) for t in tables]
                             + [[null] * width] * (bucket - b), dtype=torch.int32)
        pad = bucket - b
        host = torch.tensor([input_ids + [0] * pad, positions + [0] * pad,
                             slots + [-1] * pad, seq_lens + [1] * pad], dtype=torch.int64)
        self.input_ids[:bucket].copy_(host[0], non_blocking=True)
        self.positions[:bucket].copy_(host[1], non_blocking=True)
        self.slot_mapping[:bucket].copy_(host[2], non_blocking=True)
        self.seq_lens[:bucket].copy_(host[3].to(torch.int32), non_blocking=True)
        self.block_tables[:bucket, :width].copy_(table, non_blocking=True)
        self.block_tables[:bucket, width:].fill_(self.pool.null_block)
        return bucket, ctx_class
