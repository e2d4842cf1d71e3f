"""QSA against a deliberately naive reference written from SYSTEM.md §6 alone (plain Python
loops, no code shared with kvcap.qsa): the selection rule through the torch reference, the
Triton top-k (one and two stages) and both QSABackend paths (mixed chunked-prefill + decode
batches of different lengths, padding rows), and the trained compressed-cache rows
(mean of 4 FP16 keys, RMS-normalised, RoPE at the group's first position)."""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # never on a GPU box: it would reach its GPU tests too
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcap.qsa.backend import IndexInputs  # noqa: E402
from kvcap.qsa.config import QSAConfig  # noqa: E402
from kvcap.qsa.indexer import RowInfo, update_side_cache  # noqa: E402
from kvcap.qsa.model import Indexer, RefShape  # noqa: E402
from kvcap.qsa.selection import select_tokens  # noqa: E402
from kvcap.qsa.synthetic import make_backend, make_cache, step_meta  # noqa: E402

R = 4  # compress_ratio of the contract
# CPU tensors: the Triton cases run only under the interpreter (as tests/test_qsa_kernels.py)
triton_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU-interpreter tests (TRITON_INTERPRET=1)")


# ---------------------------------------------------------------- naive reference (§6)
def naive_select(scores: list[float], pos: int, seq_len: int, k: int) -> list[int]:
    """visible = min((pos+1)//4, seq_len//4); repeatedly take the best remaining group
    (strictly higher score wins, so the first = lowest index keeps a tie); expand the kept
    groups in ascending order to 4 tokens each, then the open tail 4*visible..pos; pad -1
    to width 4k + 3."""
    visible = min((pos + 1) // R, seq_len // R)
    kept: list[int] = []
    remaining = list(range(visible))
    while remaining and len(kept) < k:
        best = remaining[0]
        for g in remaining:
            if scores[g] > scores[best]:
                best = g
        kept.append(best)
        remaining.remove(best)
    out: list[int] = []
    for g in sorted(kept):
        out += [R * g + j for j in range(R)]
    tail = list(range(R * visible, pos + 1))
    assert 0 <= len(tail) <= R - 1
    out += tail
    return out + [-1] * (k * R + R - 1 - len(out))


def naive_relu_score(qs: list[list[float]], key: list[float], d_index: int) -> float:
    """sum_h ReLU(q_h . k_c) / sqrt(d_index)."""
    tot = 0.0
    for q in qs:
        dot = 0.0
        for a, b in zip(q, key, strict=True):
            dot += a * b
        tot += max(dot, 0.0)
    return tot / math.sqrt(d_index)


def naive_group_mean(keys: list[list[float]], g: int) -> list[float]:
    return [sum(keys[R * g + j][d] for j in range(R)) / R for d in range(len(keys[0]))]


# ---------------------------------------------------------------- selection functions
def _edge_rows(rng: random.Random, k: int, n: int):
    """(scores, pos, seq_len): seq_len any residue mod 4, pos at group boundaries, visible
    below / at / just above / well above k, integer scores (ties), all-zero rows (ReLU zero
    everywhere), -0.0 next to +0.0."""
    rows = []
    for i in range(n):
        kind = i % 6
        if kind == 0:  # fewer visible groups than the budget
            vis_target = rng.randint(0, k - 1)
        elif kind == 1:  # exactly the budget
            vis_target = k
        elif kind == 2:  # one more than the budget
            vis_target = k + 1
        else:
            vis_target = rng.randint(k + 2, 4 * k + 7)
        pos = R * vis_target - 1 + rng.randint(0, R - 1)  # 0..3 tail tokens
        pos = max(pos, 0)
        seq_len = pos + 1 + rng.randint(0, 6)  # later rows of the same step
        g = seq_len // R
        if kind == 3:
            sc = [0.0] * g  # ReLU zero everywhere: lowest indices win
        elif kind == 4:
            sc = [rng.choice([0.0, -0.0, 1.0]) for _ in range(g)]
        else:
            sc = [float(rng.randint(-2, 2)) for _ in range(g)]
        rows.append((sc, pos, seq_len))
    return rows


@pytest.mark.parametrize("k", [1, 3, 5])
def test_select_tokens_matches_naive(k):
    rng = random.Random(10 + k)
    for sc, pos, seq_len in _edge_rows(rng, k, 120):
        got = select_tokens(torch.tensor(sc, dtype=torch.float32).reshape(1, 1, -1),
                            torch.tensor([pos]), seq_len, R, k)
        assert got.shape == (1, 1, k * R + R - 1)
        assert got[0, 0].tolist() == naive_select(sc, pos, seq_len, k), (sc, pos, seq_len)


@triton_only
@pytest.mark.parametrize("k,chunk", [(3, None), (5, None), (3, 8), (5, 16)])
def test_triton_topk_matches_naive(k, chunk):
    """All rows of one call (different positions and lengths); groups past a row's visible
    count hold huge scores that must never be picked; a padding row gives only -1."""
    from kvcap.kernels.qsa_topk import qsa_topk

    rng = random.Random(20 + k)
    rows = _edge_rows(rng, k, 30)
    gmax = max(len(sc) for sc, _, _ in rows) + 3
    scores = torch.full((len(rows) + 1, 1, gmax), 1e30)
    vis, pos = [], []
    for i, (sc, p, s) in enumerate(rows):
        v = min((p + 1) // R, s // R)
        scores[i, 0, :v] = torch.tensor(sc[:v])
        vis.append(v)
        pos.append(p)
    vis.append(0)
    pos.append(-1)  # padding row
    out = qsa_topk(scores, torch.tensor(vis, dtype=torch.int32),
                   torch.tensor(pos, dtype=torch.int32), k, R, chunk=chunk)
    for i, (sc, p, s) in enumerate(rows):
        assert out[i, 0].tolist() == naive_select(sc, p, s, k), (sc, p, s)
    assert out[-1, 0].tolist() == [-1] * (k * R + R - 1)


# ---------------------------------------------------------------- whole backend selection
def _schedule():
    """Four sequences of different lengths: chunked prefill with chunks that are not
    multiples of 4, decode rows next to prefill rows, a sequence that sits a step out."""
    return [[7, 3, 13, 2], [6, 1, 0, 9], [11, 1, 5, 1], [1, 1, 1, 6], [2, 1, 0, 1]]


@pytest.mark.parametrize("path", ["torch", pytest.param("triton", marks=triton_only)])
@pytest.mark.parametrize("k", [2, 5])
def test_backend_selection_matches_naive(path, k):
    """Trained indexer (relu_sum): every row of every step against the naive rule with the
    naive scores of naive group means. Integer keys make every score exact in any order,
    sequence 2 has negative queries and positive keys (all scores ReLU zero)."""
    gen = torch.Generator().manual_seed(30 + k)
    bs, nb, hi_, di = 8, 24, 3, 16
    sched = _schedule()
    final = [sum(s[i] for s in sched) for i in range(4)]
    perm = torch.randperm(nb, generator=gen).tolist()
    tables, at = [], 0
    for n in final:  # distinct, non-contiguous blocks
        need = -(-n // bs)
        tables.append(perm[at:at + need])
        at += need
    cfg = QSAConfig(layer_rule="explicit", layers=(0,), topk_groups=k, indexer="trained",
                    path=path)
    be = make_backend(cfg, nb, bs, 1, di)
    cache = make_cache(nb, 1, bs, 16, "fp16")
    all_k: list[list[list[float]]] = [[] for _ in final]
    done = [0] * 4
    for step_i, chunk in enumerate(sched):
        qlens, slens, tabs, ids = [], [], [], []
        for i, n in enumerate(chunk):
            if n:
                qlens.append(n)
                slens.append(done[i] + n)
                tabs.append(tables[i])
                ids.append(i)
        pad = 2 if step_i % 2 else 0
        meta = step_meta(qlens, slens, tabs, bs, "cpu", pad_rows=pad)
        iq_rows, ik_rows, row_of = [], [], []
        for i, n in zip(ids, qlens, strict=True):
            for p in range(done[i], done[i] + n):
                if i == 2:
                    q = -torch.randint(0, 3, (hi_, di), generator=gen).float()
                    kk = torch.randint(0, 3, (di,), generator=gen).float()
                else:
                    q = torch.randint(-1, 2, (hi_, di), generator=gen).float()
                    kk = torch.randint(-1, 2, (di,), generator=gen).float()
                iq_rows.append(q)
                ik_rows.append(kk)
                all_k[i].append(kk.tolist())
                row_of.append((i, p))
            done[i] += n
        for _ in range(pad):
            iq_rows.append(torch.full((hi_, di), float("nan")))
            ik_rows.append(torch.full((di,), float("nan")))
        iq, ik = torch.stack(iq_rows).half(), torch.stack(ik_rows).half()
        t = iq.shape[0]
        q = torch.zeros(t, 2, 16, dtype=torch.float16)
        kv = torch.zeros(t, 1, 16, dtype=torch.float16)
        tok = be.select(q, kv, cache, meta, IndexInputs(iq, ik, _plain_mean))
        assert tok.shape == (t, 1, k * R + R - 1)
        for r, (i, p) in enumerate(row_of):
            seq_len = done[i]
            groups = [naive_group_mean(all_k[i], g) for g in range(seq_len // R)]
            qs = iq[r].float().tolist()
            sc = [naive_relu_score(qs, key, di) for key in groups]
            assert tok[r, 0].tolist() == naive_select(sc, p, seq_len, k), (step_i, i, p)
        assert bool((tok[len(row_of):] == -1).all())


def _plain_mean(keys: torch.Tensor, first_pos: torch.Tensor) -> torch.Tensor:
    return keys.mean(1)


# ---------------------------------------------------------------- compressed-cache rows
def _naive_compress(keys4: list[list[float]], first: int, weight: list[float], eps: float,
                    rotary_dim: int, theta: float) -> list[float]:
    """mean of the 4 keys, RMS-normalised (times the k_norm weight), then RoPE (rotate-half
    layout on the first rotary_dim dims) at the group's first position."""
    d = len(keys4[0])
    mean = [sum(k[i] for k in keys4) / R for i in range(d)]
    rms = math.sqrt(sum(x * x for x in mean) / d + eps)
    x = [mean[i] / rms * weight[i] for i in range(d)]
    half = rotary_dim // 2
    out = list(x)
    for i in range(half):
        ang = first * theta ** (-(2 * i) / rotary_dim)
        c, s = math.cos(ang), math.sin(ang)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def test_compressed_rows_match_naive():
    """Trained indexer's compressed cache after chunked steps over a batch: every complete
    group's row equals the naive construction at FP16 storage precision; the index query
    RoPE and the compressed-key RoPE agree (q . k_c depends on position differences only)."""
    shape = RefShape(hidden_size=16, index_heads=2, index_dim=32, rotary_dim=16,
                     rope_theta=10_000.0)
    torch.manual_seed(0)
    idx = Indexer(shape)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        idx.k_norm.weight.copy_(torch.rand(32, generator=gen) + 0.5)
    bs, nb, di = 16, 12, 32
    comp = torch.zeros(nb + 2, 1, bs // R, di, dtype=torch.float16)
    raw = torch.zeros(nb + 2, 1, R, di, dtype=torch.float16)
    from kvcap.qsa.indexer import LayerSideCache

    side = LayerSideCache(raw, comp, None, R)
    tables = [[3, 9, 0], [7, 1], [5, 11, 2, 4]]
    sched = [[6, 9, 30], [5, 2, 0], [1, 7, 23], [10, 1, 1]]
    final = [sum(s[i] for s in sched) for i in range(3)]
    keys = [torch.randn(n, di, generator=gen) * 3 for n in final]
    done = [0, 0, 0]
    for chunk in sched:
        qlens = [n for n in chunk if n]
        ids = [i for i, n in enumerate(chunk) if n]
        slens = [done[i] + chunk[i] for i in ids]
        meta = step_meta(qlens, slens, [tables[i] for i in ids], bs, "cpu", pad_rows=1)
        ks = torch.cat([keys[i][done[i]:done[i] + chunk[i]] for i in ids]
                       + [torch.full((1, di), float("nan"))])
        with torch.no_grad():
            update_side_cache(side, ks[:, None, :], meta.slot_mapping,
                              RowInfo.build(meta, ks.shape[0]), idx.compress)
        for i in ids:
            done[i] += chunk[i]
    w = idx.k_norm.weight.tolist()
    for i, n in enumerate(final):
        kh = keys[i].half().float().tolist()  # the raw cache is FP16
        for g in range(n // R):
            want = _naive_compress(kh[R * g:R * g + R], R * g, w, shape.rms_norm_eps,
                                   shape.rotary_dim, shape.rope_theta)
            blk, row = tables[i][R * g // bs], g % (bs // R)
            got = comp[blk, 0, row].float()
            torch.testing.assert_close(got, torch.tensor(want).half().float(),
                                       rtol=2e-3, atol=2e-3)
        if n % R:  # the open group has no compressed row yet
            g = n // R
            assert bool((comp[tables[i][R * g // bs], 0, g % (bs // R)] == 0).all())
    # RoPE consistency: q rotated at p, k_c rotated at its first position f -> the score
    # depends on p - f only (shift both by 8 positions, same score)
    from kvcap.qsa.model import partial_rope, rope_tables

    qv = torch.randn(1, 1, di, generator=gen)
    kv = torch.randn(1, R, 1, di, generator=gen)

    def score(p, f):
        cq, sq = rope_tables(torch.tensor([p]), shape.rotary_dim, shape.rope_theta)
        with torch.no_grad():
            kc = idx.compress(kv, torch.tensor([f]))
        return float((partial_rope(qv, cq, sq) * kc).sum())

    assert abs(score(13, 4) - score(21, 12)) < 1e-3
