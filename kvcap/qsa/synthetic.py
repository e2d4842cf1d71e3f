"""Synthetic paged problems for QSA tests and benchmarks (no model): poisoned caches, random
non-contiguous block tables, step metadata and a runner that feeds steps to a backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcap.attention.metadata import AttentionMetadata
from kvcap.kv_cache.pool import LayerKVCache
from kvcap.qsa.backend import IndexInputs, QSABackend
from kvcap.qsa.config import QSAConfig
from kvcap.qsa.indexer import QSASideCaches

K_SCALE = 0.0371
V_SCALE = 0.0129


def make_cache(num_blocks: int, hkv: int, block_size: int, d: int, kv_dtype: str,
               device: torch.device | str = "cpu", layer_idx: int = 0,
               k_scale: float = K_SCALE, v_scale: float = V_SCALE,
               poison: bool = True) -> LayerKVCache:
    """A layer cache [num_blocks + 1, Hkv, bs, D] (the last block is an all-zero null block);
    the others are poisoned (NaN, or 0x7F bytes for E4M3) so stray reads show."""
    fp8 = kv_dtype == "fp8_e4m3"
    store = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
             "fp8_e4m3": torch.uint8}[kv_dtype]
    kc = torch.zeros((num_blocks + 1, hkv, block_size, d), dtype=store, device=device)
    if poison:
        kc[:num_blocks] = 0x7F if fp8 else float("nan")
    vc = kc.clone()
    ks = torch.tensor(k_scale, device=device) if fp8 else None
    vs = torch.tensor(v_scale, device=device) if fp8 else None
    return LayerKVCache(layer_idx, kc, vc, kv_dtype, ks, vs)


def random_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                  gen: torch.Generator) -> list[list[int]]:
    """Distinct random physical blocks covering each sequence."""
    need = [-(-s // block_size) for s in seq_lens]
    if sum(need) > num_blocks:
        raise ValueError(f"{sum(need)} blocks needed, {num_blocks} available")
    ids = torch.randperm(num_blocks, generator=gen)[: sum(need)].tolist()
    out, at = [], 0
    for n in need:
        out.append(ids[at:at + n])
        at += n
    return out


def step_meta(query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
              block_size: int, device: torch.device | str, pad_rows: int = 0
              ) -> AttentionMetadata:
    return AttentionMetadata.build(query_lens, seq_lens, tables, block_size,
                                   torch.device(device),
                                   num_padded_tokens=sum(query_lens) + pad_rows)


@dataclass
class Step:
    """One step's inputs: q [T, Hq, D], k/v [T, Hkv, D], optional index q [T, Hi, di] and
    raw index keys [T, di], and its metadata."""

    meta: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    iq: torch.Tensor | None = None
    ik: torch.Tensor | None = None


def make_steps(chunks: list[list[int]], seq_final: list[int], hq: int, hkv: int, d: int,
               block_size: int, num_blocks: int, dtype: torch.dtype, gen: torch.Generator,
               device: torch.device | str = "cpu", integer: bool = True,
               index_heads: int = 0, index_dim: int = 0, pad_rows: int = 0) -> list[Step]:
    """Steps feeding `chunks[s][i]` new tokens of sequence i at step s (0 = not scheduled).
    `integer`: q/k (and index q/k) take small integer values, so every score is exact in any
    summation order and ties are common (selection identity tests)."""
    tables = random_tables(seq_final, block_size, num_blocks, gen)
    done = [0] * len(seq_final)
    steps = []

    def rnd(*shape):
        if integer:
            return torch.randint(-2, 3, shape, generator=gen).to(dtype)
        return torch.randn(shape, generator=gen).to(dtype)

    for chunk in chunks:
        qlens, slens, tabs = [], [], []
        for i, n in enumerate(chunk):
            if n == 0:
                continue
            done[i] += n
            qlens.append(n)
            slens.append(done[i])
            tabs.append(tables[i])
        meta = step_meta(qlens, slens, tabs, block_size, device, pad_rows)
        t = sum(qlens) + pad_rows
        v = torch.randn((t, hkv, d), generator=gen).to(dtype)
        iq = rnd(t, index_heads, index_dim).to(device) if index_heads else None
        ik = rnd(t, index_dim).to(device) if index_heads else None
        steps.append(Step(meta, rnd(t, hq, d).to(device), rnd(t, hkv, d).to(device),
                          v.to(device), iq, ik))
    return steps


def plain_mean(keys: torch.Tensor, first_pos: torch.Tensor) -> torch.Tensor:
    """Compressor without norm/RoPE (keeps integer test keys exact)."""
    return keys.mean(1)


def run_steps(backend: QSABackend, cache: LayerKVCache, steps: list[Step],
              softmax_scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run every step through `backend`; returns (out [T, Hq, D], tokens [T, Hs, W]) per
    step (out rows of padding tokens keep the sentinel 7.0)."""
    backend.record = {}
    res = []
    for st in steps:
        out = torch.full_like(st.q, 7.0)
        index = IndexInputs(st.iq, st.ik, plain_mean) if st.iq is not None else None
        backend.forward(st.q, st.k, st.v, cache, st.meta, softmax_scale, out, index=index)
        res.append((out, backend.record[cache.layer_idx][-1].clone()))
    return res


def make_backend(config: QSAConfig, num_blocks: int, block_size: int, key_heads: int,
                 key_dim: int, device: torch.device | str = "cpu",
                 layer_idx: int = 0) -> QSABackend:
    """A QSABackend over the torch reference (or Triton) backend with fresh side caches."""
    from kvcap.attention.torch_ref import TorchReferenceBackend

    dev = torch.device(device)
    dtype = torch.float16 if config.side_dtype == "fp16" else torch.bfloat16
    side = QSASideCaches((layer_idx,), num_blocks, block_size, config.compress_ratio,
                         key_heads, key_dim, dtype, dev,
                         bounds=config.indexer == "training_free" and config.summary == "minmax")
    return QSABackend(TorchReferenceBackend(), config, side, dev)
