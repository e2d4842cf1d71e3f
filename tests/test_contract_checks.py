"""Independent checks of the calibration statistics, scale policy and A/B metrics against
SYSTEM.md §2 (numbers recomputed here with numpy / Fraction / torch.nn.functional, not with the
code under test)."""

from __future__ import annotations

import hashlib
import itertools
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_scales_report import MODEL, spec

from kvcap.eval import disjoint, metrics
from kvcap.eval.corpora import record_hash
from kvcap.scales.observer import KVStatsObserver
from kvcap.scales.report import build_report, ceil_fp32, scale_for
from kvcap.scales.stats import KVStats, bin_edges

F32_MAX = Fraction(float(np.finfo(np.float32).max))
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _ref_bin(edges64: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Contract binning of nonzero |x|: largest i with E[i] <= |x|, clamped to [0, bins-1]."""
    return np.clip(np.searchsorted(edges64, a, side="right") - 1, 0, edges64.size - 2)


def _ref_ceil_fp32(q: Fraction) -> float:
    """Least positive FP32 >= q, by binary search over the FP32 bit patterns (exact)."""
    lo, hi = 1, 0x7F7FFFFF
    while lo < hi:
        mid = (lo + hi) // 2
        if Fraction(float(np.array(mid, np.uint32).view(np.float32))) >= q:
            hi = mid
        else:
            lo = mid + 1
    return float(np.array(lo, np.uint32).view(np.float32))


def _probe_values(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    e = bin_edges()
    vals = [e, np.nextafter(e, np.float32(0)), np.nextafter(e, np.float32(np.inf)),
            np.array([0.0, 1e-45, 1e-38, 2.0**-25, 2.0**17, 3.4e38, 65504.0], np.float32),
            (np.exp2(rng.uniform(-30, 20, 20_000))).astype(np.float32)]
    x = np.concatenate(vals).astype(np.float32)
    x = np.concatenate([x, -x])  # negative values bin by |x|; -0.0 is a zero
    return x[rng.permutation(x.size)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_observer_counts_max_and_histogram_match_contract(device: str, dtype: torch.dtype
                                                          ) -> None:
    t = torch.from_numpy(_probe_values(1)).to(dtype)
    t = t[torch.isfinite(t)]
    x = t.float().numpy().astype(np.float64)
    obs = KVStatsObserver(1)
    k = t.reshape(-1, 1, 1).to(device)
    obs.observe(0, k[: x.size // 3], torch.zeros_like(k[: x.size // 3]))  # two forwards
    obs.observe(0, k[x.size // 3:], torch.zeros_like(k[x.size // 3:]))
    s = obs.stats().shards["default"]
    a = np.abs(x)
    nz = a[a > 0]
    want = np.bincount(_ref_bin(bin_edges().astype(np.float64), nz), minlength=4096)
    assert s.count[0, 0] == x.size and s.finite[0, 0] == x.size
    assert s.nonzero[0, 0] == nz.size
    assert s.max_abs[0, 0] == a.max()  # exact, not rounded
    np.testing.assert_array_equal(s.hist[0, 0], want)
    # V was all zeros (incl. none nonzero): counted, but no histogram mass and max 0
    assert s.count[0, 1] == x.size and s.nonzero[0, 1] == 0 and s.hist[0, 1].sum() == 0
    assert s.max_abs[0, 1] == 0.0


def test_bin_edges_are_correctly_rounded_powers() -> None:
    e = bin_edges()
    assert e.size == 4097 and e[0] == 2.0**-24 and e[-1] == 2.0**16 and e[2048] == 2.0**-4
    # every edge whose exponent is an integer is that exact power of two
    for i in range(0, 4097, 512):
        assert e[i] == 2.0 ** (-24 + i * 40 // 4096)


def test_merge_is_order_independent() -> None:
    rng = np.random.default_rng(5)
    parts = []
    for r in range(4):
        obs = KVStatsObserver(2, rank=r)
        for sh in rng.choice(["a", "b", "c"], 2, replace=False):
            obs.set_shard(str(sh))
            for layer in range(2):
                k = rng.standard_normal((7, 2, 4)) * 10.0 ** rng.uniform(-3, 3)
                k = torch.from_numpy(k.astype(np.float32))
                obs.observe(layer, k, 2 * k)
        parts.append(obs.stats())

    def canon(s: KVStats) -> tuple:
        return (tuple(s.ranks), tuple(sorted(
            (n, tuple(getattr(sh, f).tobytes() for f in
                      ("count", "finite", "nonzero", "max_abs", "hist", "rows")))
            for n, sh in s.shards.items())))

    results = set()
    for perm in itertools.permutations(parts):
        m = perm[0]
        for p in perm[1:]:
            m = m.merge(p)
        results.add(canon(m))
    results.add(canon(parts[0].merge(parts[1]).merge(parts[2].merge(parts[3]))))
    assert len(results) == 1
    # and the merge is the plain sum / max of the parts
    m = parts[0].merge(parts[1]).merge(parts[2]).merge(parts[3])
    assert m.total().hist.sum() == sum(p.total().hist.sum() for p in parts)
    np.testing.assert_array_equal(m.total().max_abs,
                                  np.max([p.total().max_abs for p in parts], axis=0))


def test_ceil_fp32_is_least_fp32_at_or_above_exact_quotient() -> None:
    rng = np.random.default_rng(1)
    maxes = list(np.exp2(rng.uniform(-160, 128, 300)))
    maxes += [float(np.array(b, np.uint32).view(np.float32))
              for b in rng.integers(1, 0x7F7FFFFF, 300)]
    maxes += [5e-324, 1e-300, 2.0**-149, 2.0**-150, 1.5 * 2.0**-149, 2.0**-126, 448.0, 1.0,
              float(np.finfo(np.float32).max)]
    for m in maxes:
        for q in (Fraction(m), Fraction(m) / 448):
            if 0 < q <= F32_MAX:
                assert ceil_fp32(q) == _ref_ceil_fp32(q), m
        if Fraction(m) <= F32_MAX:
            s = scale_for(m)
            assert s == _ref_ceil_fp32(Fraction(m) / 448) and 448 * Fraction(s) >= Fraction(m)


def test_report_fractions_bound_the_exact_values() -> None:
    rng = np.random.default_rng(3)
    num_layers, obs, data = 2, KVStatsObserver(2), {}
    for sh in ("a", "b"):
        obs.set_shard(sh)
        for layer in range(num_layers):
            k = rng.standard_normal((64, 2, 8)) * np.exp2(rng.uniform(-20, 4, (64, 2, 8)))
            k[rng.random(k.shape) < 0.05] = 0
            v = rng.standard_normal((64, 2, 8)) * 0.01
            k, v = k.astype(np.float32), v.astype(np.float32)
            obs.observe(layer, torch.from_numpy(k), torch.from_numpy(v))
            for ti, x in enumerate((k, v)):
                data.setdefault((layer, ti), []).append(np.abs(x).ravel())
                data.setdefault((sh, layer, ti), []).append(np.abs(x).ravel())
    for policy in ("max", "percentile:99.9"):
        report = build_report(obs.stats(), spec(num_layers), MODEL, policy)
        for t in report["tensors"]:
            key = (t["layer"], "KV".index(t["tensor"]))
            a = np.concatenate(data[key]).astype(np.float64)
            nz, s = a[a > 0], t["scale"]
            assert t["count"] == a.size and t["nonzero"] == nz.size and t["max_abs"] == a.max()
            exact = {"underflow": np.mean(nz / s < 2.0**-10),
                     "subnormal": np.mean((nz / s >= 2.0**-10) & (nz / s < 2.0**-6)),
                     "saturation": np.mean(nz > 448 * s)}
            for name, val in exact.items():
                at = t["at_scale"]
                assert at[f"{name}_frac_lo"] <= val <= at[f"{name}_frac"], (policy, name)
            assert t["saturation_ratio"] == t["at_scale"]["saturation_frac"]
            if policy == "max":
                assert s == scale_for(a.max()) and t["saturation_ratio"] == 0
                for q, k in ((99.9, "p99_9"), (99.99, "p99_99")):
                    for method in ("linear", "higher", "inverted_cdf", "nearest"):
                        assert np.percentile(a, q, method=method) <= t[k]
                for sh, p in t["shards"].items():
                    m = float(np.concatenate(data[(sh, *key)]).max())
                    assert p["scale"] == scale_for(m) and p["ratio"] == scale_for(m) / s


def test_kl_top1_nll_perplexity_match_torch() -> None:
    g = torch.Generator().manual_seed(0)
    for dtype, scale in itertools.product((torch.float32, torch.bfloat16), (0.1, 10.0, 60.0)):
        ref = (torch.randn(19, 1031, generator=g) * scale).to(dtype)
        arm = (ref.double() + 0.05 * scale * torch.randn(19, 1031, generator=g,
                                                         dtype=torch.float64)).to(dtype)
        want = F.kl_div(torch.log_softmax(arm.double(), -1), torch.log_softmax(ref.double(), -1),
                        log_target=True, reduction="none").sum(-1)
        torch.testing.assert_close(metrics.kl_per_position(ref, arm), want, rtol=1e-9,
                                   atol=1e-15)
        assert torch.equal(metrics.top1_agreement(ref, arm),
                           ref.float().argmax(-1) == arm.float().argmax(-1))
        ids = torch.randint(0, 1031, (19,), generator=g)
        ce = F.cross_entropy(arm[:-1].double(), ids[1:], reduction="none")
        nll = metrics.next_token_nll(arm, ids.tolist())
        torch.testing.assert_close(nll, ce, rtol=1e-12, atol=0)
        assert metrics.perplexity(float(nll.sum()), nll.numel()) == pytest.approx(
            float(ce.mean().exp()), rel=1e-12)


def test_record_hash_and_disjointness_check() -> None:
    recs = [[1, 2, 3], [70000, 5], [2**31 - 1, 0]]
    for r in recs:  # SHA-256 of the ids as little-endian int32
        assert record_hash(r) == hashlib.sha256(struct.pack(f"<{len(r)}i", *r)).hexdigest()
    cal = {record_hash(recs[0]), record_hash(recs[1])}
    res = disjoint.check({"heldout": [record_hash([9, 9]), record_hash(recs[0])],
                          "generation": [record_hash(recs[1])]}, cal, {"path": "x"})
    assert not res["verified"] and res["evaluation_records"] == 3
    assert res["overlaps"] == {"heldout": [record_hash(recs[0])],
                               "generation": [record_hash(recs[1])]}
    ok = disjoint.check({"heldout": [record_hash(recs[2])]}, cal, {"path": "x"})
    assert ok["verified"] and ok["overlaps"] == {}
