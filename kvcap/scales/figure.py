"""The calibration report figure (PNG, matplotlib Agg): per-layer scales and where the scaled
values fall against E4M3's underflow / subnormal / normal / saturation ranges."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from kvcap.scales.fsutil import atomic_write_png
from kvcap.scales.report import E4M3_MAX, MIN_NORMAL, UNDERFLOW

_RANGES = (("underflow", "underflow_frac", "#d62728"), ("subnormal", "subnormal_frac", "#ff7f0e"),
           ("normal", "normal_frac", "#2ca02c"), ("saturated", "saturation_frac", "#7f0000"))


def _scaled_log2_hist(report: dict[str, Any], kind: str, use_unit: bool
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Counts of log2(|x|/scale) over all layers of one tensor kind, 0.25-octave bins."""
    lo, hi = report["histogram"]["log2_range"]
    bins = report["histogram"]["bins"]
    centers = lo + (np.arange(bins) + 0.5) * (hi - lo) / bins
    grid = np.arange(-40.0, 48.0 + 1e-9, 0.25)
    total = np.zeros(len(grid) - 1)
    for t in report["tensors"]:
        if t["tensor"] != kind or not t["hist"]["counts"]:
            continue
        first, counts = t["hist"]["first"], np.asarray(t["hist"]["counts"], dtype=np.float64)
        shift = 0.0 if use_unit else math.log2(t["scale"])
        x = centers[first:first + len(counts)] - shift
        total += np.histogram(x, bins=grid, weights=counts)[0]
    s = total.sum()
    return grid, total / s if s else total


def _bands(ax) -> None:
    edges = [-60, math.log2(UNDERFLOW), math.log2(MIN_NORMAL), math.log2(E4M3_MAX), 60]
    for (label, _, color), a, b in zip(_RANGES, edges[:-1], edges[1:], strict=True):
        ax.axvspan(a, b, color=color, alpha=0.12, label=f"E4M3 {label}")


def _stacked(ax, report: dict[str, Any], key: str, title: str) -> None:
    tensors = report["tensors"]
    x = np.arange(len(tensors))
    bottom = np.zeros(len(tensors))
    for label, field, color in _RANGES:
        vals = np.array([t[key][field] for t in tensors])
        ax.bar(x, vals, bottom=bottom, color=color, width=0.9, label=label)
        bottom += vals
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_ylim(0, 1.05)
    ax.set_xticks(x[::2], [str(t["layer"]) for t in tensors[::2]], fontsize=6)
    ax.set_xlabel("layer (K, V bars side by side)")
    ax.set_ylabel("fraction of nonzero elements (upper bounds)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6, loc="lower right")


def write_figure(report: dict[str, Any], path: Path | str) -> Path:
    """Render the report figure to `path` (PNG) atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax = axes[0, 0]
    for kind, marker in (("K", "o"), ("V", "s")):
        ts = [t for t in report["tensors"] if t["tensor"] == kind]
        ax.plot([t["layer"] for t in ts], [t["scale"] for t in ts], marker=marker, ms=3,
                label=f"{kind} scale")
    ax.axhline(1.0, color="gray", ls=":", lw=1, label="unit scale (negative control)")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("scale (FP32)")
    pol = report["policy"]["formula"]
    ax.set_title(f"per-layer K/V scales: {pol}", fontsize=9)
    ax.legend(fontsize=7)

    ax = axes[0, 1]
    _bands(ax)
    for kind, use_unit, style in (("K", False, "-"), ("V", False, "-"), ("K", True, ":"),
                                  ("V", True, ":")):
        grid, frac = _scaled_log2_hist(report, kind, use_unit)
        label = f"{kind}, {'scale 1.0' if use_unit else 'calibrated scale'}"
        ax.step(grid[:-1], frac, where="post", ls=style, lw=1, label=label)
    ax.set_yscale("log")
    ax.set_xlim(-20, 12)
    ax.set_xlabel("log2(|x| / scale)")
    ax.set_ylabel("fraction of nonzero elements")
    ax.set_title("where scaled values fall (all layers)", fontsize=9)
    ax.legend(fontsize=6, loc="upper left")

    _stacked(axes[1, 0], report, "at_scale", "E4M3 ranges at the calibrated scales")
    _stacked(axes[1, 1], report, "at_unit_scale", "E4M3 ranges at scale 1.0")
    tokens = report.get("tokens")
    fig.suptitle(f"kvcap calibration: {report['num_layers']} layers, {tokens} tokens, shards "
                 f"{', '.join(report['shard_names'])}", fontsize=10)
    fig.tight_layout()
    atomic_write_png(Path(path), fig, dpi=110)
    plt.close(fig)
    return Path(path)
