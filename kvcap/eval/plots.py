"""PNG figures of a compare report: per-layer attention error, KL distribution, retrieval grid."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from kvcap.scales.fsutil import atomic_write_png  # noqa: E402

logger = logging.getLogger(__name__)


def _save(fig, path: Path) -> Path:
    """Write `fig` through a rename, as report.json is (savefig wrote in place), and close it."""
    fig.tight_layout()
    try:
        atomic_write_png(Path(path), fig, dpi=110)
    finally:
        plt.close(fig)
    return path


def per_layer_error(heldout: dict[str, Any], labels: dict[str, str], path: Path) -> Path | None:
    """Solid: same layer inputs (isolated); dashed: end to end."""
    views = [(key, style) for key, style in (("internals_isolated", "-"), ("internals", "--"))
             if any(key in a for a in heldout["arms"].values())]
    if not views:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for ci, (name, arm) in enumerate(a for a in heldout["arms"].items() if views[0][0] in a[1]):
        for key, style in views:
            rows = arm[key]["per_layer"]
            layers = [r["layer"] for r in rows]
            tag = f"{labels.get(name, name)}, {'isolated' if key.endswith('isolated') else 'e2e'}"
            kw = {"ls": style, "marker": "o", "ms": 3, "color": f"C{ci}", "label": tag}
            ax1.semilogy(layers, [max(1 - r["cosine"], 1e-12) for r in rows], **kw)
            ax2.semilogy(layers, [max(r["rel_l2"], 1e-12) for r in rows], **kw)
    ax1.axhline(1e-3, color="grey", ls=":", lw=0.8, label="goal: cosine 0.999")
    ax1.set(xlabel="layer", ylabel="1 - cosine", title="attention output vs reference")
    ax2.set(xlabel="layer", ylabel="relative L2", title="attention output vs reference")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def kl_distribution(heldout: dict[str, Any], labels: dict[str, str], path: Path) -> Path | None:
    edges = np.asarray(heldout["kl_histogram_edges"])
    arms = {n: a for n, a in heldout["arms"].items() if a.get("kl_mean") is not None}
    if not arms:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, a in arms.items():
        counts = np.asarray(a["kl_histogram"], dtype=float)
        ax.stairs(
            counts / max(counts.sum(), 1),
            edges,
            label=f"{labels.get(name, name)} (mean {a['kl_mean']:.2e})",
        )
    ax.axvline(2e-3, color="grey", ls="--", lw=0.8, label="goal: mean KL 2e-3")
    ax.set_xscale("log")
    ax.set(
        xlabel="KL(P_ref || P_arm) per position [nats]",
        ylabel="fraction of positions",
        title="teacher-forced KL distribution (held-out)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def retrieval_grid(ret: dict[str, Any], labels: dict[str, str], path: Path) -> Path | None:
    cases = ret["cases"]
    if not cases:
        return None
    tasks = sorted({c["task"] for c in cases})
    ctxs = sorted({c["context"] for c in cases})
    depths = sorted({c["depth"] for c in cases})
    arms = list(ret["arms"])
    fig, axes = plt.subplots(
        len(tasks), len(arms), figsize=(3.2 * len(arms), 2.6 * len(tasks)), squeeze=False
    )
    for ti, task in enumerate(tasks):
        for ai, arm in enumerate(arms):
            grid = np.full((len(ctxs), len(depths)), np.nan)
            for c, ok in zip(cases, ret["arms"][arm]["correct"], strict=True):
                if c["task"] == task:
                    grid[ctxs.index(c["context"]), depths.index(c["depth"])] = float(ok)
            ax = axes[ti][ai]
            ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            ax.set_xticks(range(len(depths)), [f"{d}%" for d in depths], fontsize=7)
            ax.set_yticks(range(len(ctxs)), [str(c) for c in ctxs], fontsize=7)
            score = int(np.nansum(grid))
            ax.set_title(
                f"{task}: {labels.get(arm, arm)}\n{score}/{int(np.sum(~np.isnan(grid)))}",
                fontsize=8,
            )
            if ai == 0:
                ax.set_ylabel("context (tokens)", fontsize=8)
            if ti == len(tasks) - 1:
                ax.set_xlabel("needle depth", fontsize=8)
    return _save(fig, path)


def write_plots(results: dict[str, Any], labels: dict[str, str], out: Path) -> list[str]:
    """Every figure the results support; returns the file names written."""
    written: list[Path | None] = []
    if "heldout" in results:
        written.append(per_layer_error(results["heldout"], labels, out / "per_layer_error.png"))
        written.append(kl_distribution(results["heldout"], labels, out / "kl_distribution.png"))
    if "retrieval" in results:
        written.append(retrieval_grid(results["retrieval"], labels, out / "retrieval_grid.png"))
    names = [p.name for p in written if p is not None]
    logger.info("plots: %s", ", ".join(names) or "none")
    return names
