"""Does E4M3 decode slow down under sustained load? Replays one decode graph back to back for
`--seconds` per launch configuration, timing every replay, while `nvidia-smi` samples the SM
clock and power (run it alongside: see docs/kernels.md). Prints the median time per window of
the run, so a short benchmark burst can be compared with steady state.

    python scripts/decode_sustained_probe.py [--seconds 2] [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvcap.bench.kernels import Cell

CONFIGS = {"uncapped-s2": dict(block_n=128, num_warps=4, num_stages=2, maxnreg=None),
           "cap128-s3": dict(block_n=128, num_warps=4, num_stages=3, maxnreg=128)}
CELLS = [(32, 8, 128, 8, 32768, 9), (32, 8, 128, 16, 16384, 5)]


def run(cell: Cell, arm: str, kw: dict, seconds: float) -> list[float]:
    fns = cell.fns(arm, **kw)
    fns[0]()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fns[0]()
    times, t0 = [], time.perf_counter()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while time.perf_counter() - t0 < seconds:
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--out", default="probe.json")
    args = ap.parse_args()
    rows = []
    for hq, hkv, d, b, ctx, splits in CELLS:
        cell = Cell(hq, hkv, d, b, ctx, 0)
        for arm in ("paged_fp16", "e4m3_native", "e4m3_software"):
            for name, kw in CONFIGS.items():
                kw = dict(kw, num_splits=splits) if arm != "paged_fp16" else {}
                time.sleep(1.0)  # idle first, like a benchmark moving to its next cell
                t = run(cell, arm, kw, args.seconds)
                win = {f"{a}-{z}": statistics.median(t[a:z]) for a, z in
                       ((0, 10), (10, 100), (100, 1000), (len(t) // 2, len(t)))}
                rows.append({"batch": b, "context": ctx, "arm": arm, "config": name,
                             "replays": len(t), "t_start": time.time(), "median_us": win})
                print(f"B={b} ctx={ctx} {arm:14s} {name:12s} " + " ".join(
                    f"{k}:{v:6.1f}" for k, v in win.items()), flush=True)
                if arm == "paged_fp16":
                    break
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
