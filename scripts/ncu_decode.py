"""Launch the paged decode kernels of a few benchmark cells so Nsight Compute can profile them.

Each (cell, arm) runs `--warmup` calls (compilation included), then one call between
cudaProfilerStart and cudaProfilerStop, the only one ncu profiles with
`--profile-from-start off`. Used by `scripts/gpu_parallel.sh ncu`, which writes the reports
as text:

    ncu --clock-control none --profile-from-start off --set full -o rep \
        python scripts/ncu_decode.py --cells 8x16384,64x16384 --arms e4m3_native
"""

from __future__ import annotations

import argparse

import torch

from kvcap.bench.kernels import Cell


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="8x16384,64x16384", help="BxCTX,... (8B shape)")
    ap.add_argument("--arms", default="e4m3_native,e4m3_software,paged_fp16")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    for spec in args.cells.split(","):
        b, ctx = (int(x) for x in spec.split("x"))
        cell = Cell(32, 8, 128, b, ctx, 0)
        for arm in args.arms.split(","):
            fn = cell.fns(arm)[0]
            for _ in range(args.warmup):
                fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"profiled {arm} {b}x{ctx}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
