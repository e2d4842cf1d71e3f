"""Seeded randomized differential tests of the attention kernels.

Each seed draws one small case over the dimensions users hit -- head_dim 16-256, GQA ratios
1 / 2 / 3 / 4 / 7 / 8 / 16, every power-of-two block size up to 128, contexts at block
boundaries (1, bs - 1, bs, bs + 1, multiples), chunked prefill after a cached prefix with
partial last blocks, padding rows (slot -1), block tables padded with -1, sliding windows,
FP16 / BF16 / FP32 queries over 16-bit, FP32 and E4M3 caches (per-layer scales from 0.035 to
30, both decoders and the mixed ones), strided q / k / v, batch rows of very different
lengths -- and random launch knobs (route, split count, tile, word route, folded merge, FP16
dots), and checks the decode kernel, the prefill kernel, the Triton backend and the torch twin
row by row against the float64 computation of test_kernels_cases.dense_expected (E4M3 values
decoded by torch.float8_e4m3fn), with unused and out-of-window cache memory poisoned.
Under TRITON_INTERPRET=1 on CPU, compiled on a GPU.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_kernels_cases import (  # noqa: E402
    SENTINEL,
    dense_expected,
    kernel_device,
    make_case,
    needs_kernels,
    store_new_kv,
    twin_output,
)

from kvcap.attention.triton_backend import TritonBackend  # noqa: E402
from kvcap.kernels.common import has_native_fp8  # noqa: E402
from kvcap.kernels.decode import paged_decode  # noqa: E402
from kvcap.kernels.prefill import paged_prefill  # noqa: E402

DEV = kernel_device()
pytestmark = needs_kernels()
NATIVE = has_native_fp8(torch.device(DEV))
# Row-wise relative error bounds: the coarser of the query's and the cache's.
_Q_TOL = {torch.float32: 2e-4, torch.float16: 6e-3, torch.bfloat16: 4e-2}
_KV_TOL = {"fp32": 2e-4, "fp16": 6e-3, "bf16": 4e-2, "fp8_e4m3": 6e-3}
_Q_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _length(rng: random.Random, bs: int) -> int:
    """A length at or next to a block boundary, or a random one."""
    return min(rng.choice([1, max(bs - 1, 1), bs, bs + 1, 2 * bs - 1, 2 * bs, 3 * bs + 1,
                           rng.randint(1, 70)]), 70)


def draw(seed: int) -> dict:
    """make_case's arguments for one random case."""
    rng = random.Random(seed)
    d = rng.choice([16, 32, 64, 64, 128, 128, 256])
    hkv = rng.choice([1, 1, 2, 3])
    bs = rng.choice([1, 2, 4, 8, 16, 16, 32, 64, 128])
    kv = rng.choice(["fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e4m3", "fp8_e4m3"])
    if kv == "fp8_e4m3":
        dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32])
    else:
        dtype = _Q_DTYPE[kv]
    seqs = []
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.5:  # a decode row
            seqs.append((_length(rng, bs) - rng.randint(0, 1), 1))
        else:  # a chunk, with or without a cached prefix
            ctx = rng.choice([0, _length(rng, bs), _length(rng, bs) - 1])
            n = rng.choice([2, 3, max(bs - 1, 2), bs + 1, rng.randint(2, 20)])
            seqs.append((ctx, min(n, 20)))
    window = rng.choice([1, 2, bs, bs + 1, rng.randint(1, 40)]) if rng.random() < 0.3 else None
    return dict(seqs=seqs, hq=hkv * rng.choice([1, 2, 3, 4, 7, 8, 16]), hkv=hkv, d=d,
                block_size=bs, kv_dtype=kv, dtype=dtype, pad_rows=rng.randint(0, 3),
                seed=rng.randint(0, 10**6), k_scale=10 ** rng.uniform(-1.45, 1.5),
                v_scale=10 ** rng.uniform(-1.9, 1.5), window=window,
                extra_blocks=rng.randint(0, 4), device=DEV)


def _strided(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    """t, or a view of it inside a NaN-filled wider buffer (rows of a fused projection)."""
    if rng.random() < 0.3:
        big = torch.full((t.shape[0], t.shape[1] + 3, t.shape[2]), float("nan"),
                         dtype=t.dtype, device=t.device)
        big[:, 1:1 + t.shape[1]] = t
        return big[:, 1:1 + t.shape[1]]
    return t


def _case(rng: random.Random, p: dict):
    case = make_case(**p)
    case.q, case.k, case.v = (_strided(rng, t) for t in (case.q, case.k, case.v))
    return case


def _check_rows(case, out: torch.Tensor, exp: torch.Tensor, p: dict, rows=None,
                what: str = "") -> None:
    """Padding rows untouched; rows `rows` (all by default) finite and each (token, head)
    row within the tolerance of the float64 result."""
    nt = case.meta.num_tokens
    assert (out[nt:] == SENTINEL).all(), f"{what}: padding rows were written"
    rows = list(range(nt)) if rows is None else rows
    got, want = out[rows].double(), exp[rows]
    assert torch.isfinite(got).all(), f"{what}: a poisoned position was read"
    den = want.norm(dim=-1).clamp_min(0.05 * want.shape[-1] ** 0.5)
    err = ((got - want).norm(dim=-1) / den).max().item() if rows else 0.0
    assert err < max(_Q_TOL[p["dtype"]], _KV_TOL[p["kv_dtype"]]), f"{what}: row error {err:.3g}"


@pytest.mark.parametrize("seed", range(44))
def test_random_cases(seed):
    p = draw(seed)
    rng = random.Random(-1 - seed)
    fp8 = p["kv_dtype"] == "fp8_e4m3"
    modes = ["auto", "software"] + (["native", "native-k", "native-v"] if NATIVE else [])
    case = _case(rng, p)
    exp = dense_expected(case)
    _check_rows(case, twin_output(case), exp, p, what="twin")

    qsl = case.meta.query_start_loc_cpu
    decode_rows = [qsl[i] for i, (_, n) in enumerate(p["seqs"]) if n == 1]
    if decode_rows:
        knobs = dict(grouped=rng.choice([True, True, False]),
                     num_splits=rng.choice([None, 1, 2, 3, 5, 8]),
                     block_n=rng.choice([None, 16, 32, 64]), fold=rng.random() < 0.3)
        if fp8:
            knobs["fp8_mode"] = rng.choice(modes)
            if knobs["grouped"] and p["d"] >= 64:
                knobs["words"] = rng.choice([None, True, False])
        c = _case(rng, p)
        store_new_kv(c)
        m, out = c.meta, c.out_buffer()
        hint = rng.choice([m.max_seq_len, 1, 2048])  # any split-count hint is correct
        paged_decode(c.q, c.cache.k_cache, c.cache.v_cache, out, m.block_tables, m.seq_lens,
                     m.query_start_loc, c.softmax_scale, hint, c.cache.k_scale,
                     c.cache.v_scale, window=c.cache.window, **knobs)
        _check_rows(c, out, exp, p, decode_rows, f"decode {knobs}")

    c = _case(rng, p)
    store_new_kv(c)
    m, out = c.meta, c.out_buffer()
    knobs = dict(block_m=rng.choice([None, 16, 32, 64]), block_n=rng.choice([None, 16, 32]))
    if fp8:
        knobs["fp8_mode"] = rng.choice(modes)
    paged_prefill(c.q, c.cache.k_cache, c.cache.v_cache, out, m.block_tables, m.seq_lens,
                  m.query_start_loc, c.softmax_scale, m.max_query_len, c.cache.k_scale,
                  c.cache.v_scale, skip_decode=False, window=c.cache.window, **knobs)
    _check_rows(c, out, exp, p, what=f"prefill {knobs}")

    c = _case(rng, p)
    out = c.out_buffer()
    mode = rng.choice(modes) if fp8 else "auto"
    TritonBackend(mode).forward(c.q, c.k, c.v, c.cache, c.meta, c.softmax_scale, out)
    _check_rows(c, out, exp, p, what=f"backend {mode}")


@pytest.mark.skipif(not NATIVE, reason="the mixed E4M3 decoders need the SM89+ conversion")
@pytest.mark.parametrize("mode", ["native-k", "native-v"])
def test_mixed_decoder_modes_serve_prefill_rows(mode):
    """A backend built with a mixed decoder mode (K and V on different E4M3 decoders, which
    only the decode kernel has) runs its prefill rows too: the prefill and QSA kernels read
    both natively. They raised ValueError("fp8_mode must be auto|native|software").
    """
    p = dict(seqs=[(0, 7), (20, 1), (13, 5), (33, 1), (16, 19)], hq=8, hkv=2, d=64,
             kv_dtype="fp8_e4m3", dtype=torch.float16, pad_rows=2, seed=17, device=DEV)
    case = make_case(**p)
    exp = dense_expected(case)
    out = case.out_buffer()
    TritonBackend(mode).forward(case.q, case.k, case.v, case.cache, case.meta,
                                case.softmax_scale, out)
    _check_rows(case, out, exp, p, what=f"backend {mode}")
    c = make_case(**p)
    store_new_kv(c)
    m, alone = c.meta, c.out_buffer()
    paged_prefill(c.q, c.cache.k_cache, c.cache.v_cache, alone, m.block_tables, m.seq_lens,
                  m.query_start_loc, c.softmax_scale, m.max_query_len, c.cache.k_scale,
                  c.cache.v_scale, fp8_mode=mode, skip_decode=False)
    _check_rows(c, alone, exp, p, what=f"prefill {mode}")
    native = c.out_buffer()
    paged_prefill(c.q, c.cache.k_cache, c.cache.v_cache, native, m.block_tables, m.seq_lens,
                  m.query_start_loc, c.softmax_scale, m.max_query_len, c.cache.k_scale,
                  c.cache.v_scale, fp8_mode="native", skip_decode=False)
    assert torch.equal(alone, native)
