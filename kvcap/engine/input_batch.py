"""Host-side step inputs without per-step Python loops over tokens or blocks.

`BlockTableRows` mirrors block tables in a persistent numpy array, one row per block-id list.
A request's `block_ids` list only ever grows by `append` (the BlockManager replaces the list
when it frees or re-admits a request), so each step copies only the blocks appended since the
last step; a list never seen before gets a fresh row. Lists are recognised by identity (the row
keeps a reference, so an id is never reused while its row lives); a list that shrank is
rewritten whole. Rows of lists no longer scheduled are recycled when the rows run out.

`StagingBuffer` is one host buffer (pinned on CUDA) per dtype that a step packs its small
inputs into, so they travel in one non_blocking copy; an event guards the buffer against being
rewritten before the previous step's copy has read it.
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch


class BlockTableRows:
    def __init__(self, pad: int, num_rows: int = 256, width: int = 64):
        self.pad = pad
        self.table = np.full((num_rows, width), pad, dtype=np.int32)
        self._row_of: dict[int, int] = {}  # id(list) -> row
        self._lists: list[list[int] | None] = [None] * num_rows
        self._written = [0] * num_rows
        self._free = list(range(num_rows - 1, -1, -1))

    def _grow_width(self, need: int) -> None:
        width = self.table.shape[1]
        while width < need:
            width *= 2
        grown = np.full((self.table.shape[0], width), self.pad, dtype=np.int32)
        grown[:, : self.table.shape[1]] = self.table
        self.table = grown

    def _new_row(self, ids: list[int], keep: list[int]) -> int:
        if not self._free:
            self._recycle(set(keep))
        r = self._free.pop()
        self._row_of[id(ids)] = r
        self._lists[r] = ids
        return r

    def _recycle(self, keep: set[int]) -> None:
        """Free every row not used by the step being built; grow if that frees nothing."""
        for key, r in list(self._row_of.items()):
            if r not in keep:
                del self._row_of[key]
                self._release(r)
        if not self._free:
            n = self.table.shape[0]
            self.table = np.concatenate([self.table, np.full_like(self.table, self.pad)])
            self._lists += [None] * n
            self._written += [0] * n
            self._free = list(range(2 * n - 1, n - 1, -1))

    def _release(self, r: int) -> None:
        self.table[r, : self._written[r]] = self.pad
        self._lists[r] = None
        self._written[r] = 0
        self._free.append(r)

    def rows_for(self, tables: list[list[int]]) -> list[int]:
        """The row mirroring each block-id list, brought up to date."""
        rows: list[int] = []
        row_of, lists, written, table = self._row_of, self._lists, self._written, self.table
        for ids in tables:
            r = row_of.get(id(ids))
            if r is None or lists[r] is not ids:
                r = self._new_row(ids, rows)
                table = self.table
            n, w = len(ids), written[r]
            if n != w:
                if n > table.shape[1]:
                    self._grow_width(n)
                    table = self.table
                if n > w:
                    table[r, w:n] = ids[w:n]
                else:  # not append-only after all: rewrite the row
                    table[r, :n] = ids
                    table[r, n:w] = self.pad
                written[r] = n
            rows.append(r)
        return rows

    def gather(self, rows: list[int], width: int, out: np.ndarray) -> None:
        """out[i, :width] = row rows[i] (padded with `pad` past its length)."""
        if width > self.table.shape[1]:
            self._grow_width(width)
        np.take(self.table[:, :width], rows, axis=0, out=out)


class StagingBuffer:
    """A reusable host buffer for one step's small inputs of one dtype."""

    def __init__(self, dtype: torch.dtype, device: torch.device, numel: int = 4096):
        self.dtype, self.device = dtype, device
        self.pinned = device.type == "cuda"
        self._event = torch.cuda.Event() if self.pinned else None
        self._pending = False
        self._alloc(numel)

    def _alloc(self, numel: int) -> None:
        self.host = torch.empty(numel, dtype=self.dtype, pin_memory=self.pinned)
        self.np = self.host.numpy()

    def reserve(self, numel: int) -> np.ndarray:
        """The host buffer as numpy (at least numel long), safe to overwrite now."""
        if self._pending:
            self._event.synchronize()  # the previous copy out of it has finished
            self._pending = False
        if numel > self.np.shape[0]:
            self._alloc(max(numel, 2 * self.np.shape[0]))
        return self.np

    def record(self) -> None:
        """Mark the copies queued so far as readers of the buffer (CUDA)."""
        if self.pinned:
            self._event.record()
            self._pending = True

    def to_device(self, numel: int) -> torch.Tensor:
        """A device tensor holding host[:numel] (a private copy, also on CPU)."""
        src = self.host[:numel]
        if not self.pinned:
            return src.clone()
        out = src.to(self.device, non_blocking=True)
        self.record()
        return out

    def copy_to(self, dst: torch.Tensor, numel: int) -> None:
        """dst (contiguous, numel elements) <- host[:numel], asynchronously on CUDA."""
        dst.view(-1).copy_(self.host[:numel], non_blocking=True)
        self.record()


def _align(n: int, a: int = 4) -> int:
    return -(-n // a) * a


class EagerInputs:
    """Builds the eager path's input ids, positions and AttentionMetadata in two copies."""

    def __init__(self, device: torch.device, block_size: int):
        self.device, self.block_size = device, block_size
        self.rows = BlockTableRows(pad=-1)
        self.buf64 = StagingBuffer(torch.int64, device)
        self.buf32 = StagingBuffer(torch.int32, device)

    def build(self, plan, pad_to: int | None = None):
        """(input ids, positions, metadata) of the plan's rows; with `pad_to`, the ids,
        positions and slot mapping run to that many rows (token 0 at position 0, slot -1:
        rows every kernel skips or computes for nothing), as piecewise CUDA graphs take them."""
        from kvcap.attention.metadata import AttentionMetadata

        qlens, seqs, tables, positions = plan.query_lens, plan.seq_lens, plan.tables, \
            plan.positions
        b, n, bs = len(qlens), len(plan.ids), self.block_size
        t = n if pad_to is None else pad_to
        if t < n:
            raise ValueError(f"pad_to={pad_to} is less than the step's {n} rows")
        rows = self.rows.rows_for(tables)
        # A multiple of 16 columns (padded with -1): Triton compiles a kernel variant per
        # divisibility of each integer argument by 16, and the block table's row stride is one,
        # so a width that flipped between steps compiled the attention kernels again inside a
        # request (the likely cause of up to 1.5 s of extra TTFT on the H200 when a long prompt
        # followed short ones; docs/kernels.md, "Twelfth change").
        width = _align(max(max(map(len, tables), default=1), 1), 16)
        # int32: query_start_loc | seq_lens | context_lens | block_tables (16-byte aligned)
        qsl = [0, *accumulate(qlens)]
        o_seq = _align(b + 1)
        o_ctx = o_seq + _align(b)
        o_tab = o_ctx + _align(b)
        h32 = self.buf32.reserve(o_tab + b * width)
        h32[:o_tab] = (qsl + [0] * (o_seq - b - 1) + seqs + [0] * (o_ctx - o_seq - b)
                       + [s - q for s, q in zip(seqs, qlens, strict=True)]
                       + [0] * (o_tab - o_ctx - b))
        tab = h32[o_tab:o_tab + b * width].reshape(b, width)
        self.rows.gather(rows, width, tab)
        # int64: ids | positions | slots, each `a` long (ids and positions padded with 0,
        # slots with -1)
        a = _align(t, 2)
        h64 = self.buf64.reserve(3 * a)
        if n == b:  # decode only: one token per sequence, slots straight from the lists
            h64[:2 * a + n] = (plan.ids + [0] * (a - n) + positions + [0] * (a - n)
                               + [ids[p // bs] * bs + p % bs
                                  for ids, p in zip(tables, positions, strict=True)])
        else:
            h64[:n] = plan.ids
            h64[n:a] = 0
            pos = h64[a:a + n]
            pos[:] = positions
            h64[a + n:2 * a] = 0
            seq_of = np.repeat(np.arange(b), qlens)
            blocks = tab[seq_of, pos // bs].astype(np.int64)
            np.add(blocks * bs, pos % bs, out=h64[2 * a:2 * a + n])
        h64[2 * a + n:3 * a] = -1
        d64 = self.buf64.to_device(3 * a)
        d32 = self.buf32.to_device(o_tab + b * width)
        meta = AttentionMetadata(
            query_start_loc=d32[: b + 1],
            seq_lens=d32[o_seq:o_seq + b],
            context_lens=d32[o_ctx:o_ctx + b],
            block_tables=d32[o_tab:].view(b, width),
            slot_mapping=d64[2 * a:2 * a + t],
            query_start_loc_cpu=qsl,
            seq_lens_cpu=list(seqs),
            max_query_len=max(qlens, default=0),
            max_seq_len=max(seqs, default=0),
            block_size=bs,
        )
        return d64[:t], d64[a:a + t], meta
