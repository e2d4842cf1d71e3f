"""Mergeable K/V calibration statistics (numpy) and their JSON / npz serialization.

Per shard: count, finite, nonzero, rows [L, 2 or L] int64, max_abs [L, 2] float64 (exact FP32
values), hist [L, 2, bins] int64 over log2|x| (bin semantics in kvcap.scales.observer).
Merging sums counts and histograms and takes the max of max_abs; shards with the same name
(other ranks or runs) merge into one.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcap.errors import CalibrationError
from kvcap.scales.fsutil import atomic_write_bytes, atomic_write_text

HIST_BINS = 4096
LOG2_LO = -24.0
LOG2_HI = 16.0
TENSORS = ("K", "V")
STATS_SCHEMA = "kvcap-kv-stats/1"


def bin_edges(bins: int = HIST_BINS, lo: float = LOG2_LO, hi: float = LOG2_HI) -> np.ndarray:
    """FP32 bin edges E[0..bins]: E[i] = fp32(2^(lo + i*(hi-lo)/bins)), strictly increasing."""
    e = np.exp2(lo + np.arange(bins + 1, dtype=np.float64) * ((hi - lo) / bins))
    edges = e.astype(np.float32)
    if not np.all(np.diff(edges) > 0):
        raise ValueError("histogram bins are too narrow for FP32 edges")
    return edges


@dataclass
class ShardStats:
    count: np.ndarray  # [L, 2] int64 elements observed
    finite: np.ndarray  # [L, 2] int64
    nonzero: np.ndarray  # [L, 2] int64
    max_abs: np.ndarray  # [L, 2] float64
    hist: np.ndarray  # [L, 2, bins] int64 (nonzero elements only)
    rows: np.ndarray  # [L] int64 tokens (rows of [T, Hkv, D]) seen per layer

    @classmethod
    def empty(cls, num_layers: int, bins: int) -> ShardStats:
        z = np.zeros((num_layers, 2), dtype=np.int64)
        return cls(z.copy(), z.copy(), z.copy(), np.zeros((num_layers, 2)),
                   np.zeros((num_layers, 2, bins), dtype=np.int64),
                   np.zeros(num_layers, dtype=np.int64))

    def merged(self, other: ShardStats) -> ShardStats:
        return ShardStats(self.count + other.count, self.finite + other.finite,
                          self.nonzero + other.nonzero, np.maximum(self.max_abs, other.max_abs),
                          self.hist + other.hist, self.rows + other.rows)


@dataclass
class KVStats:
    num_layers: int
    bins: int = HIST_BINS
    log2_lo: float = LOG2_LO
    log2_hi: float = LOG2_HI
    ranks: list[int] = field(default_factory=lambda: [0])
    shards: dict[str, ShardStats] = field(default_factory=dict)

    def _layout(self) -> tuple[int, int, float, float]:
        return (self.num_layers, self.bins, self.log2_lo, self.log2_hi)

    def merge(self, other: KVStats) -> KVStats:
        """Sum counts/histograms and max max_abs, shard by shard (same names merge)."""
        if self._layout() != other._layout():
            raise CalibrationError(f"cannot merge statistics with layouts {self._layout()} and "
                                   f"{other._layout()} (layers, bins, log2 range)")
        shards = dict(self.shards)
        for name, s in other.shards.items():
            shards[name] = shards[name].merged(s) if name in shards else s
        return KVStats(self.num_layers, self.bins, self.log2_lo, self.log2_hi,
                       sorted(set(self.ranks) | set(other.ranks)), shards)

    def total(self) -> ShardStats:
        out = ShardStats.empty(self.num_layers, self.bins)
        for s in self.shards.values():
            out = out.merged(s)
        return out

    def check_complete(self) -> None:
        """Refuse statistics where some layer's K or V was never observed or is non-finite."""
        if not self.shards:
            raise CalibrationError("no K/V activations were observed")
        t = self.total()
        missing = [f"layer {layer} {TENSORS[i]}" for layer in range(self.num_layers)
                   for i in range(2) if t.count[layer, i] == 0]
        if missing:
            raise CalibrationError(f"calibration saw no activations for {len(missing)} tensors: "
                                   f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        bad = [f"layer {layer} {TENSORS[i]}" for layer in range(self.num_layers)
               for i in range(2) if t.finite[layer, i] != t.count[layer, i]
               or not np.isfinite(t.max_abs[layer, i])]
        if bad:
            raise CalibrationError(f"non-finite K/V activations in {', '.join(bad[:8])}")

    # --- serialization -----------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return {"schema": STATS_SCHEMA, "num_layers": self.num_layers, "bins": self.bins,
                "log2_range": [self.log2_lo, self.log2_hi], "ranks": self.ranks,
                "shards": list(self.shards)}

    def save(self, path: Path | str) -> Path:
        """Write `.npz` (dense) or `.json` (sparse histograms), atomically."""
        path = Path(path)
        if path.suffix == ".npz":
            names = list(self.shards)
            arrays = {f: np.stack([getattr(self.shards[n], f) for n in names]) if names else
                      np.zeros(0) for f in ("count", "finite", "nonzero", "max_abs", "hist",
                                            "rows")}
            buf = io.BytesIO()
            np.savez_compressed(buf, meta=np.array(json.dumps(self._meta())), **arrays)
            atomic_write_bytes(path, buf.getvalue())
        elif path.suffix == ".json":
            data = self._meta()
            data["data"] = {name: _shard_json(s) for name, s in self.shards.items()}
            atomic_write_text(path, json.dumps(data) + "\n")
        else:
            raise ValueError(f"statistics path must end in .npz or .json: {path}")
        return path

    @classmethod
    def load(cls, path: Path | str) -> KVStats:
        path = Path(path)
        try:
            if path.suffix == ".npz":
                with np.load(path, allow_pickle=False) as z:
                    meta = json.loads(str(z["meta"]))
                    shards = {n: ShardStats(*(z[f][i].astype(dt) for f, dt in _FIELDS))
                              for i, n in enumerate(meta["shards"])}
            else:
                meta = json.loads(path.read_text())
                shards = {n: _shard_from_json(meta["data"][n], meta["num_layers"], meta["bins"])
                          for n in meta["shards"]}
            if meta.get("schema") != STATS_SCHEMA:
                raise ValueError(f"schema {meta.get('schema')!r} is not {STATS_SCHEMA!r}")
            lo, hi = meta["log2_range"]
            return cls(int(meta["num_layers"]), int(meta["bins"]), float(lo), float(hi),
                       [int(r) for r in meta["ranks"]], shards)
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            raise CalibrationError(f"cannot read K/V statistics {path}: {e}") from None


_FIELDS = (("count", np.int64), ("finite", np.int64), ("nonzero", np.int64),
           ("max_abs", np.float64), ("hist", np.int64), ("rows", np.int64))


def _shard_json(s: ShardStats) -> dict[str, Any]:
    out: dict[str, Any] = {f: getattr(s, f).tolist() for f, _ in _FIELDS if f != "hist"}
    sparse = []
    for layer in range(s.hist.shape[0]):
        for ti in range(2):
            nz = np.flatnonzero(s.hist[layer, ti])
            sparse.append([nz.tolist(), s.hist[layer, ti, nz].tolist()])
    out["hist_sparse"] = sparse  # [layer*2 + tensor] -> [bin indices, counts]
    return out


def _shard_from_json(d: dict[str, Any], num_layers: int, bins: int) -> ShardStats:
    hist = np.zeros((num_layers, 2, bins), dtype=np.int64)
    for i, (idx, counts) in enumerate(d["hist_sparse"]):
        hist[i // 2, i % 2, np.asarray(idx, dtype=np.int64)] = counts
    return ShardStats(*[hist if f == "hist" else np.asarray(d[f], dtype=dt)
                        for f, dt in _FIELDS])
