"""Shared builders for the attention tests (torch reference and Triton kernels).

A case is a batch of sequences, each with `ctx` cached tokens and `n` new tokens, stored in a
paged cache with random non-contiguous block tables padded with -1. Unused cache memory is
poisoned with NaN (0x7F bytes for E4M3), so a kernel that reads past a sequence or through a
padding entry fails loudly. The dense expectation is computed independently in float64 from
the full per-sequence K/V, dequantized through torch.float8_e4m3fn.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

from kvcap.attention.metadata import AttentionMetadata
from kvcap.kv_cache.pool import LayerKVCache

K_SCALE = 0.0371
V_SCALE = 0.0129
SENTINEL = 7.0
# Relative-error bounds by cache dtype, and the query dtype each cache is tested with.
TOL = {"fp32": 1e-4, "fp16": 4e-3, "bf16": 2.5e-2, "fp8_e4m3": 4e-3}
QUERY_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
               "fp8_e4m3": torch.float16}
_STORE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
          "fp8_e4m3": torch.uint8}


@dataclass
class Case:
    q: torch.Tensor  # [T_padded, Hq, D]
    k: torch.Tensor  # [T_padded, Hkv, D] new tokens
    v: torch.Tensor
    cache: LayerKVCache
    meta: AttentionMetadata
    seqs: list[tuple[int, int]]  # (ctx, n)
    full_k: list[torch.Tensor]  # per sequence [seq_len, Hkv, D] model dtype
    full_v: list[torch.Tensor]
    softmax_scale: float

    def out_buffer(self) -> torch.Tensor:
        return torch.full_like(self.q, SENTINEL)


def _fp8_ref(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8)


def _fp8_deq(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).to(torch.float8_e4m3fn).double() * scale


def make_case(seqs: list[tuple[int, int]], hq: int, hkv: int, d: int, *, block_size: int = 16,
              kv_dtype: str = "fp16", dtype: torch.dtype = torch.float16, pad_rows: int = 0,
              big_block_index: bool = False, extra_blocks: int = 5, seed: int = 0,
              device: str = "cpu", k_scale: float = K_SCALE, v_scale: float = V_SCALE,
              window: int | None = None) -> Case:
    """`window`: the layer slides over that many tokens; the cached positions no new token
    sees are poisoned like unused memory, so a kernel that reads one fails loudly."""
    g = torch.Generator().manual_seed(seed)
    bs = block_size
    need = [math.ceil((c + n) / bs) for c, n in seqs]
    total = sum(need)
    fp8 = kv_dtype == "fp8_e4m3"
    store = _STORE[kv_dtype]
    if big_block_index:
        # Block ids past 2^31 elements / block stride: int32 offsets would overflow.
        stride = hkv * bs * d
        num_blocks = (2**31) // stride + total + 8
        k_cache = torch.empty((num_blocks, hkv, bs, d), dtype=store, device=device)
        v_cache = torch.empty_like(k_cache)
        ids = (num_blocks - 1 - torch.randperm(total + 4, generator=g))[:total].tolist()
        ids[0] = 3  # one small id too
        # poison only the blocks we use (the rest stays untouched virtual memory)
        poison = 0x7F if fp8 else float("nan")
        k_cache[ids] = poison
        v_cache[ids] = poison
    else:
        num_blocks = total + extra_blocks
        k_cache = torch.empty((num_blocks, hkv, bs, d), dtype=store, device=device)
        v_cache = torch.empty_like(k_cache)
        k_cache.fill_(0x7F if fp8 else float("nan"))
        v_cache.fill_(0x7F if fp8 else float("nan"))
        ids = torch.randperm(num_blocks, generator=g)[:total].tolist()
    tables, pos = [], 0
    for nb in need:
        tables.append(ids[pos: pos + nb])
        pos += nb
    full_k, full_v, new_k, new_v, new_q = [], [], [], [], []
    for (c, n), table in zip(seqs, tables, strict=True):
        s = c + n
        fk = (torch.randn(s, hkv, d, generator=g) * 3).clamp(-15, 15).to(dtype)
        fv = (torch.randn(s, hkv, d, generator=g)).clamp(-5, 5).to(dtype)
        full_k.append(fk.to(device))
        full_v.append(fv.to(device))
        new_k.append(fk[c:])
        new_v.append(fv[c:])
        new_q.append(torch.randn(n, hq, d, generator=g).to(dtype))
        if c:
            p = torch.arange(c)
            blk = torch.tensor(table, dtype=torch.long)[p // bs].to(device)
            off = (p % bs).to(device)
            for src, dst, sc in ((fk[:c], k_cache, k_scale), (fv[:c], v_cache, v_scale)):
                vals = _fp8_ref(src, sc) if fp8 else src.to(store)
                dst[blk, :, off] = vals.to(device)
            unseen = max(c - window + 1, 0) if window else 0
            if unseen:
                for dst in (k_cache, v_cache):
                    dst[blk[:unseen], :, off[:unseen]] = 0x7F if fp8 else float("nan")
    q = torch.cat(new_q + [torch.randn(pad_rows, hq, d, generator=g).to(dtype)])
    k = torch.cat(new_k + [torch.randn(pad_rows, hkv, d, generator=g).to(dtype)])
    v = torch.cat(new_v + [torch.randn(pad_rows, hkv, d, generator=g).to(dtype)])
    meta = AttentionMetadata.build(
        query_lens=[n for _, n in seqs], seq_lens=[c + n for c, n in seqs], block_tables=tables,
        block_size=bs, device=torch.device(device), num_padded_tokens=q.shape[0])
    ks = torch.tensor(k_scale, dtype=torch.float32, device=device) if fp8 else None
    vs = torch.tensor(v_scale, dtype=torch.float32, device=device) if fp8 else None
    cache = LayerKVCache(layer_idx=0, k_cache=k_cache, v_cache=v_cache, kv_dtype=kv_dtype,
                         k_scale=ks, v_scale=vs, window=window)
    return Case(q.to(device), k.to(device), v.to(device), cache, meta, list(seqs), full_k,
                full_v, 1.0 / math.sqrt(d))


def dense_expected(case: Case) -> torch.Tensor:
    """Float64 causal attention from the full per-sequence K/V, dequantized like the cache."""
    fp8 = case.cache.is_fp8
    store = case.cache.k_cache.dtype
    outs = []
    qsl = case.meta.query_start_loc_cpu
    for i, (c, n) in enumerate(case.seqs):
        q = case.q[qsl[i]: qsl[i + 1]].double()  # [n, Hq, D]
        if fp8:
            k = _fp8_deq(case.full_k[i], case.cache.k_scale.item())
            v = _fp8_deq(case.full_v[i], case.cache.v_scale.item())
        else:
            k = case.full_k[i].to(store).double()
            v = case.full_v[i].to(store).double()
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        sc = torch.einsum("nhd,shd->hns", q, k) * case.softmax_scale
        mask = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None]
        if case.cache.window:
            mask &= torch.arange(c + n)[None, :] > (c + torch.arange(n))[:, None] - \
                case.cache.window
        sc = sc.masked_fill(~mask.to(sc.device), float("-inf"))
        outs.append(torch.einsum("hns,shd->nhd", torch.softmax(sc, -1), v))
    return torch.cat(outs) if outs else case.q.new_zeros((0,) + case.q.shape[1:]).double()


def expected_cache_bytes(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache must hold at the new tokens' slots after a store: (k, v) [n, Hkv, D]."""
    nt = case.meta.num_tokens
    if case.cache.is_fp8:
        return (_fp8_ref(case.k[:nt], case.cache.k_scale.item()),
                _fp8_ref(case.v[:nt], case.cache.v_scale.item()))
    return case.k[:nt].to(case.cache.k_cache.dtype), case.v[:nt].to(case.cache.v_cache.dtype)


def read_slots(cache_t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    bs = cache_t.shape[2]
    return cache_t[slots // bs, :, slots % bs]


def test_case_builder_tables_are_valid():
    case = make_case([(5, 3), (0, 4), (40, 1)], 4, 2, 16, pad_rows=2)
    m = case.meta
    assert m.num_tokens == 8 and case.q.shape[0] == 10
    assert m.slot_mapping[-2:].tolist() == [-1, -1]
    assert (m.block_tables[1, 1:] == -1).all()
    assert torch.isnan(case.cache.k_cache).any()  # poisoned free memory
    exp = dense_expected(case)
    assert exp.shape == (8, 4, 16) and torch.isfinite(exp).all()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def twin_output(case: Case) -> torch.Tensor:
    """The torch twin (TorchReferenceBackend: store, then attend) on a copy of the cache, so
    the kernel under test reads its own store."""
    from kvcap.attention.torch_ref import TorchReferenceBackend

    c = case.cache
    cache = LayerKVCache(0, c.k_cache.clone(), c.v_cache.clone(), c.kv_dtype, c.k_scale,
                         c.v_scale, window=c.window)
    out = case.out_buffer()
    TorchReferenceBackend().forward(case.q, case.k, case.v, cache, case.meta,
                                    case.softmax_scale, out)
    return out


def kernel_device() -> str:
    """Where the kernel tests run: the GPU, or the CPU under the Triton interpreter."""
    gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    return "cuda" if gpu else "cpu"


def needs_kernels():
    """skipif mark for kernel tests on a CPU whose triton was imported without the
    interpreter (TRITON_INTERPRET=1 must be set before triton is imported)."""
    from kvcap.kernels.decode import _decode_kernel

    return pytest.mark.skipif(
        kernel_device() == "cpu" and type(_decode_kernel).__name__ != "InterpretedFunction",
        reason="no CUDA: run with TRITON_INTERPRET=1 set before triton is imported")


def check_output(case: Case, out: torch.Tensor, kv_dtype: str,
                 twin: torch.Tensor | None = None) -> None:
    """A kernel's output: padding rows untouched, every row finite (a poisoned position read
    shows as NaN), within TOL of the float64 computation and of the torch twin's output."""
    nt = case.meta.num_tokens
    assert (out[nt:] == SENTINEL).all(), "padding rows were written"
    assert torch.isfinite(out[:nt]).all(), "a poisoned (unused or out-of-window) position was read"
    assert rel_err(out[:nt], dense_expected(case)) < TOL[kv_dtype]
    if twin is not None:
        assert rel_err(out[:nt], twin[:nt]) < TOL[kv_dtype]


def store_new_kv(case: Case) -> None:
    """The case's new tokens' K/V into its cache through the store_kv kernel."""
    from kvcap.kernels.store_kv import store_kv

    m, c = case.meta, case.cache
    store_kv(case.k, case.v, c.k_cache, c.v_cache, m.slot_mapping, c.k_scale, c.v_scale)


def run_decode(case: Case, **knobs) -> torch.Tensor:
    """store_new_kv, then paged_decode over the case (its layer's window included) with
    `knobs`; returns the output buffer."""
    from kvcap.kernels.decode import paged_decode

    store_new_kv(case)
    m, c, out = case.meta, case.cache, case.out_buffer()
    paged_decode(case.q, c.k_cache, c.v_cache, out, m.block_tables, m.seq_lens,
                 m.query_start_loc, case.softmax_scale, m.max_seq_len, c.k_scale, c.v_scale,
                 window=c.window, **knobs)
    return out
