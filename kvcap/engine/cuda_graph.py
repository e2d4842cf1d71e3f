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
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from kvcap.attention.metadata import AttentionMetadata
from kvcap.config import env_flag
from kvcap.engine.input_batch import BlockTableRows, StagingBuffer
from kvcap.models.llama import ForwardContext

logger = logging.getLogger(__name__)


def graphs_disabled() -> bool:
    return env_flag("KVCAP_ENFORCE_EAGER")


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


# Speculative decoding verifies K drafts as 1 + K decode rows per request; graphs cover those
# rows up to this many (or max_num_seqs, if larger), so a large max_num_seqs times K does not
# capture hundreds of buckets. Steps with more rows run eagerly, with the same tokens.
MAX_DRAFT_GRAPH_ROWS = 256


def graph_rows(max_num_seqs: int, num_speculative_tokens: int) -> int:
    """The largest decode batch (rows) the graphs are captured for."""
    rows = max_num_seqs * (1 + num_speculative_tokens)
    return max(max_num_seqs, min(rows, MAX_DRAFT_GRAPH_ROWS))


def class_boundaries() -> tuple[int, ...]:
    """Where the decode launch rules that depend on the context change (short E4M3 calls take
    the byte route up to SHORT_BYTE_ROUTE_TOKENS, wide E4M3 calls the one-wave launch up to
    WIDE_WORD_ROUTE_TOKENS), so a step gets the launch its real length would; and 16K.
    Without the 4K class, 64 sequences of 2-4K tokens ran the 16K class's two-split
    five-stage launch (docs/kernels.md, "Twenty-seventh change"). Imported here, not at the
    top: the CPU engine runs without Triton, which the kernels module needs."""
    from kvcap.kernels.decode import SHORT_BYTE_ROUTE_TOKENS, WIDE_WORD_ROUTE_TOKENS

    return SHORT_BYTE_ROUTE_TOKENS, WIDE_WORD_ROUTE_TOKENS, 16384


def context_classes(max_model_len: int) -> list[int]:
    """The context lengths decode graphs are captured for (a decode step runs the graph of the
    smallest class >= its longest sequence). Eager decode on CUDA uses the same classes for
    its split-K choice, so graph and eager runs compute the same sums (same greedy tokens)."""
    return sorted({c for c in class_boundaries() if c < max_model_len} | {max_model_len})


def context_class(classes: list[int], max_seq_len: int) -> int:
    return next((c for c in classes if c >= max_seq_len), max_seq_len)


class DecodeGraphs:
    def __init__(self, model, backend, pool, device: torch.device, max_num_seqs: int,
                 max_model_len: int):
        self.model, self.backend, self.pool, self.device = model, backend, pool, device
        self.buckets = batch_buckets(max_num_seqs)
        self.capture_s: float | None = None  # seconds capture() took
        self.classes = context_classes(max_model_len)
        self.block_size = pool.spec.block_size
        width = -(-max_model_len // self.block_size)
        n = self.buckets[-1]
        # ids | positions | slots in one buffer: one host->device copy per step.
        self._io = torch.zeros(3, n, dtype=torch.int64, device=device)
        self._io[2] = -1
        self.input_ids, self.positions, self.slot_mapping = self._io.unbind(0)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, width), pool.null_block, dtype=torch.int32,
                                       device=device)
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool_handle = None
        self._rows = BlockTableRows(pad=pool.null_block, num_rows=max(256, 4 * n))
        self._h64 = StagingBuffer(torch.int64, device, 3 * n)
        self._h32 = StagingBuffer(torch.int32, device, n + n * min(width, 256))
        self._dirty_width = 0  # columns of block_tables written so far (null beyond)

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
        start = time.perf_counter()
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
        self.capture_s = time.perf_counter() - start  # benchmarks record it (startup cost)
        logger.info("decode CUDA graphs: batch buckets %s x context classes %s, captured in "
                    "%.1f s", self.buckets, self.classes, self.capture_s)

    def context_class(self, max_seq_len: int) -> int:
        """The split-count hint both paths use, so eager and graph steps reduce alike."""
        return context_class(self.classes, max_seq_len)

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
        """Fill the static input buffers for a decode-only batch; returns the graph's key.

        Rows past the batch are padding (token 0 at position 0, slot -1, seq_len 1, null
        blocks). Three host->device copies: ids/positions/slots, seq_lens, the block tables.
        """
        b = len(input_ids)
        bucket = next(s for s in self.buckets if s >= b)
        n, bs, null = self.buckets[-1], self.block_size, self.pool.null_block
        rows = self._rows.rows_for(tables)
        width = max(map(len, tables))
        io = self._h64.reserve(3 * n)[: 3 * n].reshape(3, n)
        io[0, :b] = input_ids
        io[0, b:] = 0
        pos = io[1, :b]
        pos[:] = positions
        io[1, b:] = 0
        blocks = self._rows.table[rows, pos // bs].astype(np.int64)
        np.add(blocks * bs, pos % bs, out=io[2, :b])
        io[2, b:] = -1
        self._h64.copy_to(self._io, 3 * n)
        h32 = self._h32.reserve(n + bucket * width)
        np.add(pos, 1, out=h32[:b])
        h32[b:n] = 1
        table = h32[n:n + bucket * width].reshape(bucket, width)
        self._rows.gather(rows, width, table[:b])
        table[b:] = null
        self._h32.copy_to(self.seq_lens, n)
        self.block_tables[:bucket, :width].copy_(
            self._h32.host[n:n + bucket * width].view(bucket, width), non_blocking=True)
        self._h32.record()
        if width < self._dirty_width:
            self.block_tables[:bucket, width:self._dirty_width].fill_(null)
        self._dirty_width = max(self._dirty_width, width)
        return bucket, self.context_class(int(pos.max()) + 1)
