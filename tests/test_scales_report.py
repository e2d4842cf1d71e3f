"""Scale policy (ceil_fp32 proof), conservative statistics, report, envelope and figure."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcap.config import ModelSpec
from kvcap.errors import CalibrationError
from kvcap.scales.figure import write_figure
from kvcap.scales.observer import KVStatsObserver
from kvcap.scales.report import build_report, ceil_fp32, envelope, scale_for
from kvcap.scales.stats import KVStats

MODEL = {"fingerprint": {"scheme": "sha256(model.safetensors)", "file": "model.safetensors",
                         "sha256": "ab" * 32}, "files": {}}
F32 = np.float32


def spec(num_layers: int = 3) -> ModelSpec:
    return ModelSpec.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": num_layers, "intermediate_size": 64,
        "vocab_size": 50})


def adversarial_max_abs() -> list[float]:
    rng = np.random.default_rng(0)
    out: list[float] = []
    for s in [F32(2.0**-149), F32(1.0), F32(0.017), F32(0.084), F32(3.4e38 / 448), F32(1e-40)]:
        exact = float(s) * 448  # 448*s is exact in float64
        for m in (F32(exact), np.nextafter(F32(exact), F32(np.inf)),
                  np.nextafter(F32(exact), F32(0))):
            if np.isfinite(m) and m > 0:
                out.append(float(m))
    out += [float(F32(x)) for x in (448.0, 1.0, 7.0, 3.0, 2.0**-126, 2.0**-149, 3.4028235e38)]
    bits = rng.integers(1, 0x7F7FFFFF, size=20_000, dtype=np.uint32)  # all positive finite FP32
    out += bits.view(np.float32).astype(np.float64).tolist()
    return out


def test_ceil_fp32_proof_on_adversarial_values() -> None:
    naive_failures = 0
    values = adversarial_max_abs()
    scales = []
    for m in values:
        s = scale_for(m)
        scales.append(s)
        assert float(F32(s)) == s and s > 0  # an FP32 value
        assert Fraction(s) * 448 >= Fraction(m)  # 448*scale >= max_abs, exactly
        prev = np.nextafter(F32(s), F32(0))
        assert prev == 0 or Fraction(float(prev)) * 448 < Fraction(m)  # the least such value
        naive = F32(m / 448)  # round-to-nearest: the policy must not be this
        naive_failures += Fraction(float(naive)) * 448 < Fraction(m)
    assert naive_failures > 1000  # the adversarial set really probes the rounding direction
    # In FP32 arithmetic too (the cache write's x.float() / scale): no value saturates.
    q = torch.tensor(values, dtype=torch.float32) / torch.tensor(scales, dtype=torch.float32)
    assert float(q.max()) <= 448.0
    assert torch.isfinite(q.to(torch.float8_e4m3fn).float()).all()


def test_ceil_fp32_edge_cases() -> None:
    assert ceil_fp32(1.0) == 1.0
    third = ceil_fp32(Fraction(1, 3))
    assert Fraction(third) >= Fraction(1, 3) > Fraction(float(np.nextafter(F32(third), F32(0))))
    assert ceil_fp32(1e-50) == float(np.nextafter(F32(0), F32(1)))
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError):
            ceil_fp32(bad)
    with pytest.raises(ValueError, match="FP32 range"):
        ceil_fp32(1e39)


def observe(obs: KVStatsObserver, data: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    for layer, (k, v) in data.items():
        obs.observe(layer, k, v)


def make_data(seed: int, n_layers: int = 3, t: int = 300, mult: float = 1.0
              ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(n_layers):
        k = torch.randn(t, 2, 16, generator=g) * (layer + 1) * 3 * mult
        v = torch.exp(torch.randn(t, 2, 16, generator=g) * 2) * 0.01 * mult  # heavy tail
        v[::7] = 0.0
        out[layer] = (k, v)
    return out


def report_for(data_by_shard: dict[str, dict], n_layers: int = 3, policy: str = "max"):
    obs = KVStatsObserver(n_layers)
    for shard, data in data_by_shard.items():
        obs.set_shard(shard)
        observe(obs, data)
    return build_report(obs.stats(), spec(n_layers), MODEL, policy)


QUANTILE_METHODS = ("inverted_cdf", "lower", "higher", "nearest", "midpoint", "linear",
                    "closest_observation", "interpolated_inverted_cdf", "hazen", "weibull",
                    "median_unbiased", "normal_unbiased")


def test_report_fields_against_exact_data() -> None:
    data = make_data(0)
    rep = report_for({"prose": data})
    json.dumps(rep)  # JSON-able
    assert rep["tokens"] == 300 and rep["shard_names"] == ["prose"]
    bin_ratio = 2.0 ** (40 / 4096)
    for t in rep["tensors"]:
        x = data[t["layer"]][0 if t["tensor"] == "K" else 1].abs().reshape(-1).double().numpy()
        nz = x[x > 0]
        assert t["name"] == f"model.layers.{t['layer']}.self_attn.{t['tensor'].lower()}_scale"
        assert t["count"] == x.size and t["nonzero"] == nz.size
        assert t["max_abs"] == x.max() and t["scale"] == scale_for(x.max())
        assert t["saturation_ratio"] == 0.0 and t["at_scale"]["saturation_frac"] == 0.0
        for key, q in (("p99_9", 0.999), ("p99_99", 0.9999)):
            exact = max(np.quantile(x, q, method=m) for m in QUANTILE_METHODS)
            assert exact <= t[key], (key, exact, t[key])  # conservative
            rank = min(x.size, math.ceil(q * x.size) + 1)
            assert t[key] <= np.sort(x)[rank - 1] * bin_ratio * (1 + 1e-6)  # and tight
        for at, s in (("at_scale", t["scale"]), ("at_unit_scale", 1.0)):
            r = x[x > 0] / s
            exact_u = np.mean(r < 2.0**-10)
            exact_s = np.mean((r >= 2.0**-10) & (r < 2.0**-6))
            f = t[at]
            assert f["underflow_frac_lo"] <= exact_u <= f["underflow_frac"]
            assert f["subnormal_frac_lo"] <= exact_s <= f["subnormal_frac"]
            assert f["underflow_frac"] - f["underflow_frac_lo"] <= 0.02  # one bin's mass
        assert t["shard_ratio_min"] == t["shard_ratio_max"] == 1.0


def test_unit_scale_shows_underflow_that_calibration_removes() -> None:
    g = torch.Generator().manual_seed(1)
    k = torch.randn(400, 2, 16, generator=g) * 1e-3  # tiny activations
    obs = KVStatsObserver(1)
    obs.observe(0, k, k * 100)
    rep = build_report(obs.stats(), spec(1), MODEL)
    kt = rep["tensors"][0]
    assert kt["at_unit_scale"]["underflow_frac_lo"] > 0.3
    assert kt["at_scale"]["underflow_frac"] < 0.01


def test_percentile_policy_on_a_mostly_zero_tensor_is_refused_by_name() -> None:
    data = make_data(3)
    data[1][1][: 290] = 0.0  # layer 1's V: 97% zeros, so its 50th percentile bound is 0
    with pytest.raises(CalibrationError, match="layer 1 V: the 50.0th percentile"):
        report_for({"a": data}, policy="percentile:50")


def test_per_shard_scales_and_ratios() -> None:
    rep = report_for({"small": make_data(1, mult=0.5), "big": make_data(1, mult=2.0)})
    for t in rep["tensors"]:
        small, big = t["shards"]["small"], t["shards"]["big"]
        assert big["max_abs"] == t["max_abs"] and big["ratio"] == 1.0
        assert small["scale"] == scale_for(small["max_abs"])
        assert t["shard_ratio_min"] == small["ratio"] == pytest.approx(0.25, rel=1e-6)
        assert t["shard_ratio_max"] == 1.0
    assert rep["shard_tokens"] == {"small": 300, "big": 300} and rep["tokens"] == 600
    assert rep["summary"]["shard_ratio_range"][1] == 1.0


def test_percentile_policy_is_explicit_and_reports_saturation() -> None:
    data = make_data(3)
    rep_max = report_for({"a": data})
    rep_p = report_for({"a": data}, policy="percentile:99.9")
    assert rep_p["policy"]["name"] == "percentile" and rep_max["policy"]["name"] == "max"
    v_max, v_p = rep_max["tensors"][1], rep_p["tensors"][1]
    assert v_p["scale"] < v_max["scale"] and v_p["scale"] == scale_for(v_p["p99_9"])
    x = data[0][1].abs().reshape(-1).numpy()
    exact_sat = np.mean(x[x > 0] > 448 * v_p["scale"])
    assert exact_sat > 0 and v_p["at_scale"]["saturation_frac_lo"] <= exact_sat
    assert exact_sat <= v_p["saturation_ratio"]
    with pytest.raises(CalibrationError, match="unknown scale policy"):
        report_for({"a": data}, policy="mse")


def test_missing_layer_aborts_naming_it() -> None:
    data = make_data(0)
    del data[1]
    with pytest.raises(CalibrationError, match="layer 1 K, layer 1 V"):
        report_for({"a": data})


def test_non_finite_stats_abort() -> None:
    obs = KVStatsObserver(3)
    observe(obs, make_data(0))
    st = obs.stats()
    st.shards["default"].finite[2, 1] -= 1  # e.g. merged from a foreign stats file
    with pytest.raises(CalibrationError, match="non-finite K/V activations in layer 2 V"):
        build_report(st, spec(3), MODEL)


def test_layer_count_mismatch_and_all_zero() -> None:
    obs = KVStatsObserver(3)
    observe(obs, make_data(0))
    with pytest.raises(CalibrationError, match="cover 3 layers"):
        build_report(obs.stats(), spec(4), MODEL)
    z = KVStatsObserver(1)
    z.observe(0, torch.ones(2, 1, 4), torch.zeros(2, 1, 4))
    with pytest.raises(CalibrationError, match="layer 0 V: every observed value is zero"):
        build_report(z.stats(), spec(1), MODEL)


def test_envelope() -> None:
    a = report_for({"prose": make_data(0)})
    b = report_for({"code": make_data(5, mult=1.7)})
    env = envelope([a, b])
    for ta, tb, te in zip(a["tensors"], b["tensors"], env["tensors"], strict=True):
        m = max(ta["max_abs"], tb["max_abs"])
        assert te["max_abs"] == m and te["scale"] == scale_for(m)
        assert te["p99_9"] == ta["p99_9"] and te["count"] == ta["count"]  # base statistics
        assert te["saturation_ratio"] == 0.0
        assert te["envelope_max_abs"] == [ta["max_abs"], tb["max_abs"]]
        if te["scale"] > ta["scale"]:
            assert te["at_scale"]["underflow_frac"] >= ta["at_scale"]["underflow_frac"]
    assert env["shard_names"] == ["prose"] and env["envelope"]["count"] == 2
    same = envelope([a])
    assert [t["scale"] for t in same["tensors"]] == [t["scale"] for t in a["tensors"]]


def test_envelope_refusals() -> None:
    a = report_for({"prose": make_data(0)})
    other = json.loads(json.dumps(a))
    other["model"]["fingerprint"]["sha256"] = "cd" * 32
    with pytest.raises(CalibrationError, match="another checkpoint revision"):
        envelope([a, other])
    pct = report_for({"prose": make_data(0)}, policy="percentile:99.99")
    with pytest.raises(CalibrationError, match="defined for the max policy"):
        envelope([a, pct])
    with pytest.raises(CalibrationError, match="at least one"):
        envelope([])


@pytest.mark.parametrize("index,edit", [
    (0, lambda r: r.pop("histogram")),
    (0, lambda r: r["tensors"][1].pop("hist")),
    (0, lambda r: r["tensors"][0].pop("shards")),
    (0, lambda r: r["tensors"][0].update(count="12")),
    (1, lambda r: r.pop("shard_names")),
], ids=["no-histogram", "no-hist", "no-shards", "str-count", "no-shard-names-1"])
def test_envelope_refuses_reports_without_statistics(index: int, edit) -> None:
    """Report 0's distribution statistics (and every report's shard names) were read unchecked:
    a truncated report was a KeyError / TypeError traceback out of `kvcap envelope`."""
    reports = [report_for({"prose": make_data(0)}), report_for({"prose": make_data(1)})]
    edit(reports[index])
    with pytest.raises(CalibrationError, match="lacks the statistics"):
        envelope(reports)


def test_stats_roundtrip_gives_same_report(tmp_path: Path) -> None:
    obs = KVStatsObserver(3)
    observe(obs, make_data(4))
    st = obs.stats()
    r1 = build_report(st, spec(3), MODEL)
    r2 = build_report(KVStats.load(st.save(tmp_path / "s.npz")), spec(3), MODEL)
    assert r1 == r2


def test_figure_is_a_png(tmp_path: Path) -> None:
    import matplotlib.image

    rep = report_for({"a": make_data(0), "b": make_data(1)})
    path = write_figure(rep, tmp_path / "report.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(str(path))
    assert img.shape[0] > 500 and img.shape[1] > 800
