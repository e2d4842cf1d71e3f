"""How the kernel benchmark's per-round times depend on the SM clock: for each arm, every
round's time over its cell's fastest round, binned by the SM clock read during that round,
and each cell's SDPA/native ratio and native % of ceiling from the rounds run at >= 1900 MHz
(docs/kernels.md, "Eighteenth change").

    python scripts/clock_spread_summary.py \
        docs/benchmarks/kernels-2026-12-02g-h200-8b-bf16-clocks-*.json
"""

from __future__ import annotations

import json
import statistics
import sys

ARMS = ("sdpa_fp16", "paged_fp16", "e4m3_native", "e4m3_software")
BINS = ((1900, 10**6, ">= 1900"), (1700, 1900, "1700-1899"), (0, 1700, "< 1700"))
FULL_CLOCK_MHZ = 1900


def rounds(arm: dict) -> list[tuple[float, int | None]]:
    """(ms, SM MHz) per round; runs without NVML recorded no clock (None)."""
    mhz = arm.get("sm_mhz_rounds") or [None] * len(arm["ms_rounds"])
    return list(zip(arm["ms_rounds"], mhz, strict=True))


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__)
        return 2
    runs = [(p, json.load(open(p))) for p in paths]
    print("arm            " + "".join(f"{label + ' MHz':>22s}" for *_, label in BINS))
    for arm in ARMS:
        cols = []
        for lo, hi, _ in BINS:
            ratios = [ms / min(c[arm]["ms_rounds"])
                      for _, run in runs for c in run["cells"] if arm in c
                      for ms, mhz in rounds(c[arm]) if mhz and lo <= mhz < hi]
            cols.append(f"{statistics.median(ratios):.3f} x best (n={len(ratios)})"
                        if ratios else "-")
        print(f"{arm:14s} " + "".join(f"{c:>22s}" for c in cols))
    ceiling = {p: run["ceilings"]["read_tbs"] for p, run in runs}
    print(f"\nat >= {FULL_CLOCK_MHZ} MHz: SDPA / native (native % of the read ceiling)")
    for path, run in runs:
        cells = []
        for c in run["cells"]:
            fast = {}
            for arm in ("sdpa_fp16", "e4m3_native"):
                ms = [t for t, mhz in rounds(c[arm]) if mhz and mhz >= FULL_CLOCK_MHZ]
                fast[arm] = statistics.median(ms) if ms else None
            name = f"{c['batch']}x{c['context'] // 1024}K"
            if None in fast.values():
                cells.append(f"{name} -")
                continue
            kv = c["batch"] * c["context"] * c["hkv"] * c["head_dim"] * 2
            pct = 100 * kv / (fast["e4m3_native"] * 1e-3) / (ceiling[path] * 1e12)
            cells.append(f"{name} {fast['sdpa_fp16'] / fast['e4m3_native']:.2f}x ({pct:.0f}%)")
        print(f"{path.rsplit('/', 1)[-1]}: " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
