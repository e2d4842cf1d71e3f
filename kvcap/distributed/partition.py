"""How one tensor-parallel rank's share of a Llama-family model is chosen. Pure arithmetic.

Attention is split by KV-head groups: a rank owns a contiguous range of KV heads and every
query head that attends to them, so GQA grouping stays intact and no KV head is stored twice.
Shards may be uneven (SmolLM2-135M, 9 query / 3 KV heads at TP2: rank 0 owns KV heads 0-1 with
query heads 0-5, rank 1 owns KV head 2 with query heads 6-8); the row-parallel o_proj sums the
partial outputs, which does not care how many heads each rank held. With fewer KV heads than
ranks, each KV head is replicated on `world // num_kv_heads` ranks that split its query heads
(only the first replica feeds calibration statistics). The MLP intermediate dimension and the
vocabulary (embedding and LM head rows) are split in balanced contiguous ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcap.config import ModelSpec
from kvcap.errors import ConfigError


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """The `index`-th of `parts` balanced contiguous ranges of range(n) (first ones larger)."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"bad split: part {index} of {parts}")
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class TPShard:
    """One rank's ranges (half-open, in units of heads, MLP columns or vocabulary rows)."""

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]
    vocab: tuple[int, int]
    vocab_shard_max: int  # largest vocabulary shard of any rank (logits gather width)
    kv_primary: bool = True  # False on the 2nd.. replica of a replicated KV head

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def inter_size(self) -> int:
        return self.inter[1] - self.inter[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]

    @property
    def is_full(self) -> bool:
        return self.world == 1


def full_shard(spec: ModelSpec) -> TPShard:
    """The single-process 'shard': everything."""
    return plan_shard(spec, 1, 0)


def plan_shard(spec: ModelSpec, world: int, rank: int) -> TPShard:
    """Rank `rank`'s share at tensor-parallel size `world`; ConfigError when it cannot split."""
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"tensor-parallel rank {rank} of {world} is not valid")
    hq, hkv = spec.num_heads, spec.num_kv_heads
    if hkv < 1 or hq % hkv:
        raise ConfigError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    group = hq // hkv
    primary = True
    if hkv >= world:
        kv = split_range(hkv, world, rank)
        q = (kv[0] * group, kv[1] * group)
    elif world % hkv == 0 and group % (world // hkv) == 0:
        replicas = world // hkv
        head, part = divmod(rank, replicas)
        per = group // replicas
        kv = (head, head + 1)
        q = (head * group + part * per, head * group + (part + 1) * per)
        primary = part == 0
    else:
        raise ConfigError(
            f"tensor_parallel_size {world} cannot split {hq} query / {hkv} KV heads: use at "
            f"most {hkv} ranks, or a multiple of {hkv} that divides the {group} query heads "
            "of each KV head")
    if spec.intermediate_size < world or spec.vocab_size < world:
        raise ConfigError(f"the model is too small for tensor_parallel_size {world}")
    vocab_max = split_range(spec.vocab_size, world, 0)
    return TPShard(rank=rank, world=world, q_heads=q, kv_heads=kv,
                   inter=split_range(spec.intermediate_size, world, rank),
                   vocab=split_range(spec.vocab_size, world, rank),
                   vocab_shard_max=vocab_max[1] - vocab_max[0], kv_primary=primary)
