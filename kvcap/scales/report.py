"""Calibration report: scale policy, conservative histogram statistics, envelope (SYSTEM.md §2).

Policy `max` (the default and reference): scale = ceil_fp32(max_abs / 448), the least FP32
value s with s >= max_abs/448 in exact arithmetic, so 448*s >= max_abs and no calibration value
saturates (FP32 division and rounding are monotone). `percentile:Q` (explicit opt-in only)
uses the conservative histogram bound of the Q-th percentile of |x| instead of max_abs.

Histogram-derived numbers are bounds, never guesses: the q-th percentile is the upper edge of
the bin holding the element of rank ceil(q*n)+1 (at or above every usual quantile definition,
numpy's 12 methods included), capped by the exact max_abs;
fractions below/in/above a threshold are reported as an upper bound (`*_frac`, counting every
bin that straddles it) with the matching lower bound (`*_frac_lo`). Fractions are of the
nonzero elements (zeros encode exactly). At scale s: underflow = |x|/s < 2^-10 (rounds to 0),
subnormal = 2^-10 <= |x|/s < 2^-6, normal = 2^-6 <= |x|/s <= 448, saturated = |x|/s > 448.
Per-shard scales use the max policy; their ratio to the global max-policy scale measures how
stable the scale is across corpora.
"""

from __future__ import annotations

import copy
import logging
import math
from fractions import Fraction
from typing import Any

import numpy as np

from kvcap.config import ModelSpec
from kvcap.errors import CalibrationError
from kvcap.scales.binding import SCALE_CONTRACT
from kvcap.scales.stats import TENSORS, KVStats, bin_edges

logger = logging.getLogger(__name__)

REPORT_KIND = "kvcap.calibration-report"
REPORT_SCHEMA = 1
E4M3_MAX = 448
UNDERFLOW = 2.0**-10  # scaled magnitudes below this round to zero in E4M3
MIN_NORMAL = 2.0**-6
PERCENTILES = (("p99_9", 0.999), ("p99_99", 0.9999))


def ceil_fp32(q: float | Fraction) -> float:
    """The least FP32 value >= q (q > 0), computed exactly."""
    exact = Fraction(q)
    if exact <= 0:
        raise ValueError(f"ceil_fp32 needs a positive value, got {q!r}")
    if exact > Fraction(float(np.finfo(np.float32).max)):
        raise ValueError(f"{q!r} exceeds the FP32 range")
    s = np.float32(float(exact))
    while Fraction(float(s)) < exact:
        s = np.nextafter(s, np.float32(np.inf))
    while True:
        prev = np.nextafter(s, np.float32(0))
        if prev <= 0 or Fraction(float(prev)) < exact:
            break
        s = prev
    return float(s)


def scale_for(max_abs: float) -> float:
    """The reference policy: ceil_fp32(max_abs / 448)."""
    return ceil_fp32(Fraction(max_abs) / E4M3_MAX)


def parse_policy(policy: str) -> dict[str, Any]:
    if policy == "max":
        return {"name": "max", "formula": "ceil_fp32(max_abs / 448)"}
    if policy.startswith("percentile:"):
        try:
            pct = float(policy.split(":", 1)[1])
        except ValueError:
            pct = -1.0
        if not 50.0 <= pct < 100.0:
            raise CalibrationError(f"policy {policy!r}: percentile must be in [50, 100)")
        return {"name": "percentile", "percentile": pct,
                "formula": f"ceil_fp32(p{pct:g}_upper_bound(|x|) / 448) (clips outliers)"}
    raise CalibrationError(f"unknown scale policy {policy!r}: use 'max' or 'percentile:Q'")


class _Dist:
    """One tensor's distribution: histogram of nonzero |x| plus exact counts and max."""

    def __init__(self, hist: np.ndarray, count: int, nonzero: int, max_abs: float,
                 edges: np.ndarray):
        self.hist, self.count, self.nonzero, self.max_abs = hist, count, nonzero, max_abs
        lo = edges[:-1].astype(np.float64)
        hi = edges[1:].astype(np.float64)
        lo[0], hi[-1] = 0.0, max(float(hi[-1]), max_abs)  # clamped tails
        self.lo, self.hi = lo, np.minimum(hi, max_abs)

    def percentile_upper(self, q: float) -> float:
        if self.count == 0:
            return 0.0
        rank = min(self.count, math.ceil(Fraction(repr(q)) * self.count) + 1)
        zeros = self.count - self.nonzero
        if rank <= zeros:
            return 0.0
        b = int(np.searchsorted(np.cumsum(self.hist), rank - zeros))
        return float(self.hi[b])

    def count_below(self, t: float) -> tuple[int, int]:
        """(lower, upper) bounds of the number of nonzero |x| < t."""
        return int(self.hist[self.hi < t].sum()), int(self.hist[self.lo < t].sum())

    def count_above(self, t: float) -> tuple[int, int]:
        if self.max_abs <= t:
            return 0, 0
        return int(self.hist[self.lo > t].sum()), int(self.hist[self.hi > t].sum())

    def ranges_at(self, scale: float) -> dict[str, float]:
        n = self.nonzero
        if n == 0:
            return dict.fromkeys(("underflow_frac", "underflow_frac_lo", "subnormal_frac",
                                  "subnormal_frac_lo", "normal_frac", "saturation_frac",
                                  "saturation_frac_lo"), 0.0)
        u_lo, u_hi = self.count_below(scale * UNDERFLOW)
        sub_lo, sub_hi = self.count_below(scale * MIN_NORMAL)
        sat_lo, sat_hi = self.count_above(scale * E4M3_MAX)
        return {"underflow_frac": u_hi / n, "underflow_frac_lo": u_lo / n,
                "subnormal_frac": max(0, sub_hi - u_lo) / n,
                "subnormal_frac_lo": max(0, sub_lo - u_hi) / n,
                "normal_frac": max(0, n - sub_lo - sat_lo) / n,
                "saturation_frac": sat_hi / n, "saturation_frac_lo": sat_lo / n}


def _policy_scale(policy: dict[str, Any], dist: _Dist) -> float:
    if policy["name"] == "max":
        return scale_for(dist.max_abs)
    bound = dist.percentile_upper(policy["percentile"] / 100)
    return ceil_fp32(Fraction(bound) / E4M3_MAX) if bound > 0 else 0.0


def _hist_json(h: np.ndarray) -> dict[str, Any]:
    nz = np.flatnonzero(h)
    if nz.size == 0:
        return {"first": 0, "counts": []}
    return {"first": int(nz[0]), "counts": h[nz[0]:nz[-1] + 1].tolist()}


def _hist_from_json(d: dict[str, Any], bins: int) -> np.ndarray:
    h = np.zeros(bins, dtype=np.int64)
    h[d["first"]:d["first"] + len(d["counts"])] = d["counts"]
    return h


def _tensor_entry(name: str, layer: int, ti: int, dist: _Dist, policy: dict[str, Any],
                  shards: dict[str, float]) -> dict[str, Any]:
    if dist.max_abs <= 0:
        raise CalibrationError(f"layer {layer} {TENSORS[ti]}: every observed value is zero; no "
                               "scale can be derived")
    scale = _policy_scale(policy, dist)
    if scale <= 0:  # a percentile policy on a mostly-zero tensor: its bound is 0
        raise CalibrationError(f"layer {layer} {TENSORS[ti]}: the {policy['percentile']}th "
                               "percentile of |x| is 0 (mostly zeros), so no scale can be "
                               "derived from it; use the max policy")
    at = dist.ranges_at(scale)
    entry: dict[str, Any] = {
        "name": name, "layer": layer, "tensor": TENSORS[ti], "count": dist.count,
        "nonzero": dist.nonzero, "zero_frac": 1.0 - dist.nonzero / dist.count,
        "max_abs": dist.max_abs, "scale": scale,
        "saturation_ratio": at["saturation_frac"],
        **{k: dist.percentile_upper(q) for k, q in PERCENTILES},
        "at_scale": at, "at_unit_scale": dist.ranges_at(1.0),
    }
    ref = scale_for(dist.max_abs)  # stability is measured under the max policy
    per = {s: {"max_abs": m, "scale": scale_for(m), "ratio": scale_for(m) / ref}
           for s, m in shards.items() if m > 0}
    ratios = [p["ratio"] for p in per.values()]
    entry.update(shards=per, shard_ratio_min=min(ratios, default=None),
                 shard_ratio_max=max(ratios, default=None))
    return entry


def build_report(stats: KVStats, spec: ModelSpec, model: dict[str, Any],
                 policy: str = "max", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The calibration report (JSON-able dict) from merged statistics.

    Raises CalibrationError when a layer was never observed, values were non-finite, the
    statistics do not match the model's layer count, or a tensor is all zeros.
    """
    if stats.num_layers != spec.num_layers:
        raise CalibrationError(f"statistics cover {stats.num_layers} layers, the model has "
                               f"{spec.num_layers}")
    stats.check_complete()
    pol = parse_policy(policy)
    if pol["name"] != "max":
        logger.warning("scale policy %s: outliers above the percentile WILL saturate", policy)
    edges, total = bin_edges(stats.bins, stats.log2_lo, stats.log2_hi), stats.total()
    names = spec.scale_names()
    tensors = []
    for layer in range(spec.num_layers):
        for ti in range(2):
            dist = _Dist(total.hist[layer, ti], int(total.count[layer, ti]),
                         int(total.nonzero[layer, ti]), float(total.max_abs[layer, ti]), edges)
            shard_max = {n: float(s.max_abs[layer, ti]) for n, s in stats.shards.items()}
            entry = _tensor_entry(names[2 * layer + ti], layer, ti, dist, pol, shard_max)
            entry["hist"] = _hist_json(total.hist[layer, ti])
            tensors.append(entry)
    report = {
        "kind": REPORT_KIND, "schema_version": REPORT_SCHEMA, "scale_contract": SCALE_CONTRACT,
        "policy": pol, "model": model, "num_layers": spec.num_layers,
        "layer_prefix": spec.layer_prefix, "shard_names": list(stats.shards),
        "tokens": int(total.rows[0]),
        "shard_tokens": {n: int(s.rows[0]) for n, s in stats.shards.items()},
        "ranks": stats.ranks,
        "histogram": {"bins": stats.bins, "log2_range": [stats.log2_lo, stats.log2_hi]},
        "tensors": tensors, "extra": extra or {},
    }
    report["summary"] = summarize(tensors)
    return report


def summarize(tensors: list[dict[str, Any]]) -> dict[str, Any]:
    def span(key: str, sub: str | None = None) -> list[float]:
        vals = [t[sub][key] if sub else t[key] for t in tensors]
        return [min(vals), max(vals)]

    return {"scale_range": span("scale"), "max_saturation_ratio": span("saturation_ratio")[1],
            "underflow_frac_range": span("underflow_frac", "at_scale"),
            "subnormal_frac_range": span("subnormal_frac", "at_scale"),
            "unit_scale_underflow_frac_range": span("underflow_frac", "at_unit_scale"),
            "unit_scale_subnormal_frac_range": span("subnormal_frac", "at_unit_scale"),
            "shard_ratio_range": [min((t["shard_ratio_min"] for t in tensors
                                       if t["shard_ratio_min"] is not None), default=None),
                                  max((t["shard_ratio_max"] for t in tensors
                                       if t["shard_ratio_max"] is not None), default=None)]}


def envelope(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge reports: keep the first's distribution statistics, take the max of max_abs over
    all of them and recompute each scale (and the fractions at it) with the max policy."""
    if not reports:
        raise CalibrationError("envelope needs at least one report")
    base = copy.deepcopy(reports[0])
    base.pop("_sha256", None)
    for i, r in enumerate(reports):
        if r.get("kind") != REPORT_KIND or r.get("schema_version") != REPORT_SCHEMA:
            raise CalibrationError(f"report {i} is not a kvcap calibration report (schema "
                                   f"{REPORT_SCHEMA})")
        try:  # a truncated or hand-edited report is refused by name, not by a KeyError
            if r.get("policy", {}).get("name") != "max":
                raise CalibrationError(f"report {i} uses policy {r.get('policy')}; the envelope "
                                       "is defined for the max policy")
            if r["model"]["fingerprint"] != base["model"]["fingerprint"] or \
                    r["model"]["files"] != base["model"]["files"]:
                raise CalibrationError(f"report {i} was calibrated on another checkpoint "
                                       "revision")
            if [t["name"] for t in r["tensors"]] != [t["name"] for t in base["tensors"]]:
                raise CalibrationError(f"report {i} covers other tensors than report 0")
            max_abs = [(t["name"], t["max_abs"]) for t in r["tensors"]]
        except (KeyError, TypeError, AttributeError) as e:
            raise CalibrationError(f"report {i} is malformed (missing or mistyped field {e})"
                                   ) from None
        for name, m in max_abs:
            # max() would silently drop a NaN from any report but the first, and a NaN, inf or
            # non-positive value there would fail deep in ceil_fp32: refuse all of them here.
            if isinstance(m, bool) or not isinstance(m, (int, float)) or \
                    not (math.isfinite(m) and m > 0):
                raise CalibrationError(f"report {i}: {name} has max_abs {m!r}; expected a "
                                       "finite number > 0 (a corrupted report?)")
    try:  # report 0's distribution statistics: a truncated one was a KeyError traceback here
        bins = base["histogram"]["bins"]
        edges = bin_edges(bins, *base["histogram"]["log2_range"])
        for i, t in enumerate(base["tensors"]):
            m = max(float(r["tensors"][i]["max_abs"]) for r in reports)
            dist = _Dist(_hist_from_json(t["hist"], bins), t["count"], t["nonzero"], m, edges)
            shards = {s: v["max_abs"] for s, v in t["shards"].items()}
            new = _tensor_entry(t["name"], t["layer"], TENSORS.index(t["tensor"]), dist,
                                base["policy"], shards)
            for key in ("max_abs", "scale", "saturation_ratio", "at_scale", "shards",
                        "shard_ratio_min", "shard_ratio_max"):
                t[key] = new[key]
            t["envelope_max_abs"] = [r["tensors"][i]["max_abs"] for r in reports]
        base["envelope"] = {"count": len(reports),
                            "shard_names": [r["shard_names"] for r in reports],
                            "tokens": [r["tokens"] for r in reports]}
        base["summary"] = summarize(base["tensors"])
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
        raise CalibrationError(f"a report lacks the statistics the envelope recomputes from "
                               f"({type(e).__name__}: {e}); use reports written by kvcap "
                               "calibrate") from None
    return base
