"""Per-step attention metadata, built once per engine step and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Describes one flattened batch of T new tokens from B sequences.

    Tokens of sequence i occupy rows query_start_loc[i]:query_start_loc[i+1] of q/k/v. Each
    sequence's new tokens follow its cached context: the first new token sits at position
    context_lens[i] = seq_lens[i] - query_lens[i]. Rows past query_start_loc[B] are padding
    (CUDA-graph buckets) and carry slot -1.

    Tensors live on the model's device:
      query_start_loc  int32 [B+1]
      seq_lens         int32 [B]     context + new tokens, per sequence
      context_lens     int32 [B]     tokens already in the cache before this step
      block_tables     int32 [B, max_blocks]  physical block ids, padded with -1
      slot_mapping     int64 [T]     block_id * block_size + offset for each new token, -1 = skip
    Python copies (`*_cpu`) serve the eager reference and launch heuristics without syncs.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        num_padded_tokens: int | None = None,
    ) -> AttentionMetadata:
        """Build from per-sequence lists; slots are derived from block tables and positions."""
        assert len(query_lens) == len(seq_lens) == len(block_tables)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        slots: list[int] = []
        for qlen, slen, table in zip(query_lens, seq_lens, block_tables, strict=True):
            for pos in range(slen - qlen, slen):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        total = num_padded_tokens if num_padded_tokens is not None else qsl[-1]
        slots.extend([-1] * (total - qsl[-1]))
        width = max((len(t) for t in block_tables), default=1) or 1
        bt = torch.tensor([t + [-1] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        seq_t = torch.tensor(seq_lens, dtype=torch.int32)
        ctx_t = seq_t - torch.tensor(query_lens, dtype=torch.int32)
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=seq_t.to(device),
            context_lens=ctx_t.to(device),
            block_tables=bt.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=list(seq_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
        )
