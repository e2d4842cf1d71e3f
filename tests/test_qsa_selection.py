"""QSA torch reference: selection against a brute-force Python model of SYSTEM.md §6 (ties,
visible rule, tail group, -1 padding), score modes, side-cache updates, configuration."""

from __future__ import annotations

import random

import pytest
import torch

from kvcap.errors import ConfigError
from kvcap.qsa.config import ENV_DISABLE_QSA, QSAConfig, qsa_disabled
from kvcap.qsa.indexer import LayerSideCache, RowInfo, mean_compressor, update_side_cache
from kvcap.qsa.selection import score_groups, select_tokens, visible_groups
from kvcap.qsa.synthetic import step_meta


def _brute(scores: list[float], pos: int, seq_len: int, ratio: int, k: int,
           tail: bool) -> list[int]:
    vis = min((pos + 1) // ratio, seq_len // ratio)
    chosen = sorted(range(vis), key=lambda g: (-scores[g], g))[:k]
    toks = [g * ratio + j for g in sorted(chosen) for j in range(ratio)]
    if tail:
        toks += list(range(vis * ratio, pos + 1))
    width = k * ratio + (ratio - 1 if tail else 0)
    return toks + [-1] * (width - len(toks))


@pytest.mark.parametrize("ratio,k,tail", [(4, 5, True), (4, 1, True), (2, 7, False),
                                          (8, 3, True), (1, 4, True)])
def test_selection_matches_brute_force(ratio, k, tail):
    rng = random.Random(ratio * 100 + k)
    rows, ref = [], []
    for _ in range(40):
        seq_len = rng.randint(1, 90)
        pos = rng.randint(max(0, seq_len - 8), seq_len - 1)
        g = seq_len // ratio
        sc = [float(rng.randint(-2, 2)) for _ in range(g)]  # ties everywhere
        rows.append((sc, pos, seq_len))
        ref.append(_brute(sc, pos, seq_len, ratio, k, tail))
    for (sc, pos, seq_len), want in zip(rows, ref, strict=True):
        scores = torch.tensor(sc, dtype=torch.float32).reshape(1, 1, -1)
        got = select_tokens(scores, torch.tensor([pos]), seq_len, ratio, k, tail)
        assert got.dtype == torch.int32
        assert got[0, 0].tolist() == want


def test_visible_rule_and_tail():
    # the group ending at pos is complete (visible); the one pos sits inside is the tail
    pos = torch.tensor([7, 8, 10, 11, 2, 20])
    seq = torch.tensor([8, 9, 11, 12, 3, 13])  # last row: seq_len bounds visibility
    assert visible_groups(pos, seq, 4).tolist() == [2, 2, 2, 3, 0, 3]
    scores = torch.zeros(1, 1, 3)
    t = select_tokens(scores, torch.tensor([10]), 11, 4, 8)[0, 0].tolist()
    assert t[:11] == list(range(11)) and set(t[11:]) == {-1} and len(t) == 35
    t = select_tokens(scores, torch.tensor([11]), 12, 4, 2)[0, 0].tolist()
    assert t == list(range(8)) + [-1] * 3  # complete group, no tail
    t = select_tokens(torch.zeros(1, 1, 0), torch.tensor([2]), 3, 4, 2)[0, 0].tolist()
    assert t == [0, 1, 2] + [-1] * 8  # nothing complete: the tail only


def test_per_head_selection_independent():
    scores = torch.tensor([[[1.0, 5.0, 3.0], [4.0, 0.0, 4.0]]])
    t = select_tokens(scores, torch.tensor([12]), 13, 4, 1)
    assert t[0, 0, :5].tolist() == [4, 5, 6, 7, 12]
    assert t[0, 1, :5].tolist() == [0, 1, 2, 3, 12]  # tie 4.0 vs 4.0: lower group wins


@pytest.mark.parametrize("mode", ["relu_sum", "dot_sum", "dot_max", "bound_sum", "bound_max"])
def test_score_modes(mode):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 4, 8, generator=g)
    lo = torch.randn(2, 5, 8, generator=g)
    hi = lo + torch.rand(2, 5, 8, generator=g)
    got = score_groups(q, lo, mode, 0.5, hi)
    for n in range(3):
        for h in range(2):
            for gi in range(5):
                if mode.startswith("bound"):
                    per = [torch.maximum(q[n, h, j] * lo[h, gi], q[n, h, j] * hi[h, gi]).sum()
                           for j in range(4)]
                else:
                    per = [q[n, h, j] @ lo[h, gi] for j in range(4)]
                per = torch.stack(per)
                want = {"relu_sum": per.relu().sum() * 0.5, "dot_sum": per.sum(),
                        "dot_max": per.max(), "bound_sum": per.sum(),
                        "bound_max": per.max()}[mode]
                assert abs(float(got[n, h, gi] - want)) < 1e-4


def _side(nb, hk, dk, bs=16, r=4, bounds=False):
    raw = None if bounds else torch.zeros(nb + 2, hk, r, dk, dtype=torch.float16)
    comp = torch.zeros(nb + 2, hk, bs // r, dk, dtype=torch.float16)
    return LayerSideCache(raw, comp, torch.zeros_like(comp) if bounds else None, r)


@pytest.mark.parametrize("bounds", [False, True])
def test_side_cache_chunked_equals_one_shot(bounds):
    """Groups straddling step boundaries (ring) give the same rows as a one-shot prefill, and
    each complete group's row is the mean (or min/max) of its 4 keys in FP16."""
    g = torch.Generator().manual_seed(1)
    n, hk, dk, bs = 45, 2, 8, 16
    keys = torch.randn(n, hk, dk, generator=g)
    table = [5, 2, 7]
    one = _side(8, hk, dk, bounds=bounds)
    meta = step_meta([n], [n], [table], bs, "cpu", pad_rows=2)
    kp = torch.cat([keys, torch.full((2, hk, dk), float("nan"))])
    update_side_cache(one, kp, meta.slot_mapping, RowInfo.build(meta, n + 2),
                      mean_compressor, bounds)
    chunked = _side(8, hk, dk, bounds=bounds)
    done = 0
    for c in (3, 6, 1, 1, 13, 21):
        meta = step_meta([c], [done + c], [table], bs, "cpu")
        update_side_cache(chunked, keys[done:done + c], meta.slot_mapping,
                          RowInfo.build(meta, c), mean_compressor, bounds)
        done += c
    kh = keys.half().float()
    for grp in range(n // 4):
        blk, row = table[grp * 4 // bs], grp % (bs // 4)
        four = kh[grp * 4:grp * 4 + 4]
        want = four.amin(0) if bounds else four.mean(0)
        for side in (one, chunked):
            assert torch.equal(side.comp[blk, :, row], want.half())
            if bounds:
                assert torch.equal(side.hi[blk, :, row], four.amax(0).half())
    # the open tail group (token 44): in the ring, or as running bounds of its row
    for side in (one, chunked):
        if bounds:
            assert torch.equal(side.comp[table[2], :, 3], keys[44].half())
            assert torch.equal(side.hi[table[2], :, 3], keys[44].half())
        else:
            assert torch.equal(side.raw[table[2], :, 0], keys[44].half())
        used = torch.zeros(10, dtype=torch.bool)
        used[table] = True
        used[-1] = True  # trash block
        for x in (side.comp, side.hi, side.raw):
            assert x is None or bool((x[~used] == 0).all())


def test_config_rules(monkeypatch):
    assert QSAConfig().qsa_layers(12) == (3, 7, 11)
    assert QSAConfig(layer_rule="all_but_first", first_dense=2).qsa_layers(5) == (2, 3, 4)
    assert QSAConfig(layer_rule="explicit", layers=(4, 1)).qsa_layers(6) == (1, 4)
    assert QSAConfig().width == 2051 and QSAConfig().token_budget == 2048
    with pytest.raises(ConfigError):
        QSAConfig(layer_rule="explicit", layers=(9,)).qsa_layers(6)
    with pytest.raises(ConfigError):
        QSAConfig(compress_ratio=3).validate()
    with pytest.raises(ConfigError):
        QSAConfig(indexer="oracle").validate()
    with pytest.raises(ConfigError):
        QSAConfig().check_block_size(6)
    monkeypatch.setenv(ENV_DISABLE_QSA, "1")
    assert qsa_disabled()
    monkeypatch.setenv(ENV_DISABLE_QSA, "0")
    assert not qsa_disabled()
