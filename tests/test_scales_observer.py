"""KVStatsObserver and KVStats: exact counts, exact binning, merging, serialization, aborts."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcap.errors import CalibrationError
from kvcap.scales.observer import KVStatsObserver
from kvcap.scales.stats import KVStats, bin_edges

EDGES = bin_edges()


def ref_hist(x: torch.Tensor) -> np.ndarray:
    """Reference binning with numpy: E[i] <= |x| < E[i+1], clamped; zeros excluded."""
    a = x.detach().abs().float().reshape(-1).numpy()
    a = a[a > 0]
    idx = np.clip(np.searchsorted(EDGES, a, side="right") - 1, 0, len(EDGES) - 2)
    return np.bincount(idx, minlength=len(EDGES) - 1)


def sample(t: int, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 2, 8, generator=g) * scale
    x[0, 0, :3] = 0.0
    return x.to(dtype)


def test_bin_edges_are_fp32_and_increasing() -> None:
    assert EDGES.dtype == np.float32 and len(EDGES) == 4097
    assert EDGES[0] == np.float32(2.0**-24) and EDGES[-1] == np.float32(2.0**16)
    assert np.all(np.diff(EDGES) > 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_counts_max_and_histogram_exact(dtype: torch.dtype) -> None:
    obs = KVStatsObserver(num_layers=2)
    k, v = sample(7, 0, 3.0, dtype), sample(7, 1, 0.01, dtype)
    obs.observe(1, k, v)
    s = obs.stats().shards["default"]
    for ti, x in enumerate((k, v)):
        assert s.count[1, ti] == x.numel() == s.finite[1, ti]
        assert s.nonzero[1, ti] == int((x != 0).sum())
        assert s.max_abs[1, ti] == float(x.abs().max().float())
        np.testing.assert_array_equal(s.hist[1, ti], ref_hist(x))
    assert s.count[0].tolist() == [0, 0] and s.rows.tolist() == [0, 7]


def test_values_on_bin_edges_and_out_of_range() -> None:
    """Exact edge values, their FP32 neighbours, and values beyond [2^-24, 2^16)."""
    e = torch.from_numpy(EDGES[::97].copy())
    below = torch.from_numpy(np.nextafter(EDGES[1::97], np.float32(0)))
    x = torch.cat([e, below, -e, torch.tensor([1e-30, 3e-8, 7e4, 1e30, 0.0, 448.0, 1.0])])
    obs = KVStatsObserver(1)
    obs.observe(0, x.reshape(-1, 1, 1), x.reshape(-1, 1, 1))
    h = obs.stats().shards["default"].hist[0, 0]
    np.testing.assert_array_equal(h, ref_hist(x))
    assert h[0] >= 2 and h[-1] >= 2  # tiny values clamp into bin 0, huge ones into the last


def test_every_bin_upper_edge_bounds_its_values() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.exp2(torch.rand(200_000, generator=g) * 40 - 24).reshape(-1, 4, 5)
    obs = KVStatsObserver(1)
    obs.observe(0, x, x)
    h = obs.stats().shards["default"].hist[0, 0]
    a = np.sort(x.reshape(-1).numpy())
    cum = np.cumsum(h)
    for b in np.flatnonzero(h)[:-1]:
        assert a[cum[b] - 1] < EDGES[b + 1]  # the largest value counted up to bin b
        assert a[cum[b] - h[b]] >= EDGES[b] or b == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("which", ["K", "V"])
def test_non_finite_aborts_naming_layer_and_tensor(bad: float, which: str) -> None:
    obs = KVStatsObserver(4)
    obs.set_shard("code")
    k, v = sample(3, 0), sample(3, 1)
    (k if which == "K" else v)[2, 1, 4] = bad
    with pytest.raises(CalibrationError,
                       match=rf"shard 'code' layer 3 {which} has 1 non-finite of 48"):
        obs.observe(3, k, v)


def test_layer_out_of_range() -> None:
    with pytest.raises(CalibrationError, match="layer 2"):
        KVStatsObserver(2).observe(2, sample(1, 0), sample(1, 0))


def test_shards_merge_and_total() -> None:
    obs = KVStatsObserver(2)
    xs = {}
    for name, seed in (("prose", 0), ("code", 1), ("prose", 2)):
        obs.set_shard(name)
        k, v = sample(5, seed, 1 + seed), sample(5, seed + 10)
        xs.setdefault(name, []).append((k, v))
        obs.observe(0, k, v)
        obs.observe(1, v, k)
    st = obs.stats()
    assert list(st.shards) == ["prose", "code"]
    prose_k = torch.cat([k for k, _ in xs["prose"]])
    np.testing.assert_array_equal(st.shards["prose"].hist[0, 0], ref_hist(prose_k))
    total = st.total()
    all_k = torch.cat([k for pairs in xs.values() for k, _ in pairs])
    np.testing.assert_array_equal(total.hist[0, 0], ref_hist(all_k))
    assert total.max_abs[0, 0] == float(all_k.abs().max())
    assert total.rows.tolist() == [15, 15]


def test_merge_across_ranks_equals_single_observer() -> None:
    """Two ranks each seeing one KV head merge to the stats of one observer seeing both."""
    k, v = sample(9, 4, 2.0), sample(9, 5, 0.5)
    whole = KVStatsObserver(1)
    whole.observe(0, k, v)
    r0, r1 = KVStatsObserver(1, rank=0), KVStatsObserver(1, rank=1)
    r0.observe(0, k[:, :1], v[:, :1])
    r1.observe(0, k[:, 1:], v[:, 1:])
    merged = r0.stats().merge(r1.stats())
    a, b = merged.shards["default"], whole.stats().shards["default"]
    assert merged.ranks == [0, 1]
    for f in ("count", "finite", "nonzero", "max_abs", "hist"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_merge_refuses_other_layout() -> None:
    with pytest.raises(CalibrationError, match="cannot merge"):
        KVStats(2).merge(KVStats(3))


@pytest.mark.parametrize("suffix", [".npz", ".json"])
def test_roundtrip(tmp_path: Path, suffix: str) -> None:
    obs = KVStatsObserver(3, rank=2)
    for name in ("a", "b"):
        obs.set_shard(name)
        for layer in range(3):
            obs.observe(layer, sample(4, layer, 2.0), sample(4, layer + 5, 0.1))
    st = obs.stats()
    back = KVStats.load(st.save(tmp_path / f"stats{suffix}"))
    assert (back.num_layers, back.bins, back.ranks, list(back.shards)) == (3, 4096, [2],
                                                                           ["a", "b"])
    for name in ("a", "b"):
        for f in ("count", "finite", "nonzero", "max_abs", "hist", "rows"):
            np.testing.assert_array_equal(getattr(back.shards[name], f),
                                          getattr(st.shards[name], f))


def test_load_rejects_garbage(tmp_path: Path) -> None:
    p = tmp_path / "s.json"
    p.write_text('{"schema": "other"}')
    with pytest.raises(CalibrationError, match="cannot read K/V statistics"):
        KVStats.load(p)


def test_check_complete_names_missing_layers() -> None:
    obs = KVStatsObserver(3)
    obs.observe(0, sample(2, 0), sample(2, 1))
    obs.observe(2, sample(2, 0), sample(2, 1))
    with pytest.raises(CalibrationError, match="layer 1 K, layer 1 V"):
        obs.stats().check_complete()
    with pytest.raises(CalibrationError, match="no K/V activations"):
        KVStatsObserver(3).stats().check_complete()
    obs.observe(1, sample(2, 0), sample(2, 1))
    obs.stats().check_complete()


def test_empty_tensors_are_ignored() -> None:
    obs = KVStatsObserver(1)
    obs.observe(0, torch.zeros(0, 2, 8), torch.zeros(0, 2, 8))
    assert obs.stats().shards["default"].count.sum() == 0


@pytest.mark.parametrize("bins,lo,hi", [(64, -4.0, 4.0), (1000, -30.0, 20.0), (4096, -24.0, 16.0)])
def test_other_bin_layouts_exact(bins: int, lo: float, hi: float) -> None:
    edges = bin_edges(bins, lo, hi)
    g = torch.Generator().manual_seed(bins)
    x = torch.exp2(torch.rand(5000, generator=g) * (hi - lo + 8) + lo - 4)
    x = torch.cat([x, torch.from_numpy(edges.copy()), torch.zeros(3)]).reshape(-1, 1, 1)
    obs = KVStatsObserver(1, bins=bins, log2_lo=lo, log2_hi=hi)
    obs.observe(0, x, x)
    a = x.reshape(-1).numpy()
    a = a[a > 0]
    ref = np.bincount(np.clip(np.searchsorted(edges, a, side="right") - 1, 0, bins - 1),
                      minlength=bins)
    np.testing.assert_array_equal(obs.stats().shards["default"].hist[0, 0], ref)


def test_fp16_subnormals_and_negative_zero() -> None:
    x = torch.tensor([6e-8, -6e-8, 1e-5, -0.0, 0.0, 65504.0], dtype=torch.float16)
    obs = KVStatsObserver(1)
    obs.observe(0, x.reshape(-1, 1, 1), x.reshape(-1, 1, 1))
    s = obs.stats().shards["default"]
    assert s.nonzero[0, 0] == 4 and s.max_abs[0, 0] == 65504.0
    np.testing.assert_array_equal(s.hist[0, 0], ref_hist(x))
