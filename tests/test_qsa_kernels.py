"""QSA Triton kernels (CPU interpreter) against the torch reference: scoring, exact top-k with
the tie rule (identical indices), sparse paged attention (FP16 / E4M3 native / software), and
the whole QSABackend triton path against its torch path on a mixed prefill + decode batch."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # never on a GPU box: it would reach its GPU tests too
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcap.attention.torch_ref import gather_kv_reference  # noqa: E402
from kvcap.kernels.qsa_attention import qsa_sparse_attention  # noqa: E402
from kvcap.kernels.qsa_score import qsa_score  # noqa: E402
from kvcap.kernels.qsa_topk import qsa_topk  # noqa: E402
from kvcap.qsa.backend import attend_masked_reference  # noqa: E402
from kvcap.qsa.config import QSAConfig  # noqa: E402
from kvcap.qsa.indexer import gather_groups  # noqa: E402
from kvcap.qsa.selection import score_groups, select_tokens, selection_mask  # noqa: E402
from kvcap.qsa.synthetic import (  # noqa: E402
    make_backend,
    make_cache,
    make_steps,
    random_tables,
    run_steps,
)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU-interpreter tests (TRITON_INTERPRET=1)")


def _reference_tokens(scores, pos, seq_len, ratio, k):
    return torch.cat([select_tokens(scores[i:i + 1], pos[i:i + 1], int(seq_len[i]), ratio, k)
                      for i in range(scores.shape[0])])


@pytest.mark.parametrize("chunk", [None, 32])
def test_topk_identical_to_reference(chunk):
    """Integer scores (ties everywhere, -0.0 tying +0.0), one and two stages, a row seeing
    fewer groups than k, a tail of 0..3 tokens, a padding row."""
    g = torch.Generator().manual_seed(1)
    ratio, k = 4, 12
    scores = torch.randint(-3, 4, (5, 2, 100), generator=g).float()
    scores[0, 0, :7] = -0.0
    scores[3] = torch.randn(2, 100, generator=g)  # one row of distinct values
    pos = torch.tensor([2, 30, 250, 398, 301])
    seq = torch.tensor([3, 31, 260, 400, 302])
    ref = _reference_tokens(scores, pos, seq, ratio, k)
    vis = torch.minimum((pos + 1) // ratio, seq // ratio).int()
    out = qsa_topk(scores, vis, pos.int(), k, ratio, chunk=chunk)
    assert torch.equal(out, ref)
    pad = qsa_topk(scores[:1], torch.zeros(1, dtype=torch.int32),
                   torch.full((1,), -1, dtype=torch.int32), k, ratio)
    assert bool((pad == -1).all())


@pytest.mark.parametrize("mode", ["relu_sum", "dot_sum", "dot_max", "bound_sum", "bound_max"])
def test_score_kernel(mode):
    g = torch.Generator().manual_seed(2)
    bs, ratio, nb, hs, j, dk = 16, 4, 12, 2, 3, 32
    lo = torch.randn(nb + 2, hs, bs // ratio, dk, generator=g).half()
    hi = (lo.float() + torch.rand(lo.shape, generator=g)).half()
    tables = random_tables([70, 33], bs, nb, g)
    bt = torch.tensor([tables[0], tables[1] + [-1] * 2], dtype=torch.int32)
    row_seq = torch.tensor([0, 0, 1])
    vis = torch.tensor([17, 5, 8], dtype=torch.int32)
    q = torch.randn(3, hs, j, dk, generator=g).half()
    scale = 0.125
    out = qsa_score(q, lo, hi, bt, row_seq, vis, 18, mode, scale)
    for r in range(3):
        n = int(vis[r])
        keys = gather_groups(lo, bt[row_seq[r]], n)
        keys_hi = gather_groups(hi, bt[row_seq[r]], n)
        ref = score_groups(q[r:r + 1], keys, mode, scale, keys_hi)[0]
        torch.testing.assert_close(out[r, :, :n], ref, rtol=1e-5, atol=1e-4)
        assert bool(torch.isneginf(out[r, :, n:]).all())


@pytest.mark.parametrize("kv_dtype,fp8_mode,d", [("fp16", "auto", 32),
                                                 ("fp8_e4m3", "native", 64),
                                                 ("fp8_e4m3", "software", 64)])
@pytest.mark.parametrize("shared", [True, False])
def test_sparse_attention(kv_dtype, fp8_mode, d, shared):
    """Selected-token attention vs masked attention on the dequantized cache; split-K on."""
    g = torch.Generator().manual_seed(3)
    bs, ratio, k, hq, hkv = 16, 4, 5, 6, 2
    seq_lens = [61, 140, 9]
    nb = 20
    cache = make_cache(nb, hkv, bs, d, kv_dtype)
    tables = random_tables(seq_lens, bs, nb, g)
    from kvcap.attention.torch_ref import store_kv_reference
    from kvcap.qsa.synthetic import step_meta

    meta = step_meta(seq_lens, seq_lens, tables, bs, "cpu")
    kk = torch.randn(sum(seq_lens), hkv, d, generator=g).half()
    store_kv_reference(kk * 3, torch.randn(kk.shape, generator=g).half(), cache,
                       meta.slot_mapping)
    rows = [(0, 60), (1, 139), (1, 100), (2, 8), (-1, -1)]  # (sequence, position); padding
    hs = 1 if shared else hkv
    q = torch.randn(len(rows), hq, d, generator=g).half()
    toks = torch.full((len(rows), hs, k * ratio + ratio - 1), -1, dtype=torch.int32)
    for r, (s, p) in enumerate(rows[:-1]):
        sc = torch.randn(1, hs, seq_lens[s] // ratio, generator=g)
        toks[r] = select_tokens(sc, torch.tensor([p]), seq_lens[s], ratio, k)[0]
    counts = torch.tensor([int((toks[r, 0] >= 0).sum()) for r in range(len(rows) - 1)] + [-1],
                          dtype=torch.int32)
    row_seq = torch.tensor([max(s, 0) for s, _ in rows])
    for splits in (1, 3):
        out = torch.full_like(q, 7.0)
        qsa_sparse_attention(q, cache.k_cache, cache.v_cache, out, toks, counts, row_seq,
                             meta.block_tables, 0.125, cache.k_scale, cache.v_scale,
                             fp8_mode=fp8_mode, num_splits=splits)
        for r, (s, _) in enumerate(rows[:-1]):
            kf, vf = gather_kv_reference(cache, meta.block_tables[s], seq_lens[s])
            mask = selection_mask(toks[r:r + 1], seq_lens[s])
            ref = attend_masked_reference(q[r:r + 1], kf, vf, mask, 0.125)
            torch.testing.assert_close(out[r:r + 1].float(), ref, rtol=2e-2, atol=2e-2)
        assert bool((out[-1] == 7.0).all())


@pytest.mark.parametrize("indexer,summary,kv_dtype", [
    ("training_free", "minmax", "fp8_e4m3"),
    ("trained", "mean", "fp16"),
])
def test_backend_triton_equals_torch(indexer, summary, kv_dtype, monkeypatch):
    """Mixed batch after a chunked prefill: identical selections (integer q/k make every
    score exact in any order), outputs within the E4M3 / FP16 tolerance, padding untouched.
    A tiny score workspace makes the triton path score and select rows in several chunks."""
    import kvcap.qsa.backend as qsa_backend

    monkeypatch.setattr(qsa_backend, "SCORE_WORKSPACE_BYTES", 4 * 2 * 8 * 7)
    g = torch.Generator().manual_seed(4)
    bs, nb, hq, hkv, d = 16, 24, 6, 2, 64
    cfg = QSAConfig(layer_rule="explicit", layers=(0,), topk_groups=3, indexer=indexer,
                    summary=summary)
    trained = indexer == "trained"
    key_heads, key_dim = (1, 32) if trained else (hkv, d)
    chunks = [[20, 27, 9], [1, 4, 1]]
    seq_final = [21, 31, 10]
    steps = make_steps(chunks, seq_final, hq, hkv, d, bs, nb, torch.float16, g,
                       index_heads=4 if trained else 0, index_dim=32, pad_rows=2)
    results = []
    for path in ("torch", "triton"):
        be = make_backend(QSAConfig(**{**cfg.__dict__, "path": path}), nb, bs, key_heads,
                          key_dim)
        cache = make_cache(nb, hkv, bs, d, kv_dtype)
        results.append(run_steps(be, cache, steps, d ** -0.5))
    for (out_t, tok_t), (out_k, tok_k) in zip(results[0], results[1], strict=True):
        assert torch.equal(tok_t, tok_k)
        assert bool((out_k[-2:] == 7.0).all())
        torch.testing.assert_close(out_k.float(), out_t.float(), rtol=2e-2, atol=2e-2)
