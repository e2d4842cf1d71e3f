"""Where a decode call's time goes: a fixed cost per call and a cost per KV byte.

    python scripts/decode_fixed_cost.py [--out FILE.json] [--batches 8,16] [--splits 6]

For the Llama-3.1-8B shape (32 q / 8 kv heads, D = 128) it builds one benchmark cell at the
largest context, then times the default E4M3 decode (both decoders) and the FP16 paged kernel at
a fixed split count while shortening every sequence (seq_lens) from the full context down to
one tile and to zero tokens. A straight line through time vs context gives the cost per token
(its slope, as TB/s and % of the read ceiling) and the fixed cost per call (its intercept); the
zero-token call measures launch, prologue, epilogue and split merge without any KV read. The
merge kernel is also timed alone. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

from kvcap.bench import kernels as kb
from kvcap.kernels import decode as dk
from kvcap.scales.fsutil import atomic_write_text

HQ, HKV, D = 32, 8, 128


def prefer_shared(kernel) -> None:
    """cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT, 100) on a compiled Triton kernel,
    so an SM keeps its shared-memory split when it alternates between this kernel and one
    that needs the maximum (the decode kernel)."""
    import ctypes
    cuda = ctypes.CDLL("libcuda.so.1")
    rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(kernel.function), 9, 100)
    if rc:
        raise RuntimeError(f"cuFuncSetAttribute failed: CUresult {rc}")


def merge_only(cell: kb.Cell, splits: int, carveout: bool = False) -> list:
    """The split merge of one call, launched as paged_decode launches it (E4M3 native)."""
    b, hq, d = cell.b, cell.hq, cell.d
    po = torch.zeros((b, hq, splits, d), dtype=torch.float32, device="cuda")
    plse = torch.zeros((b, hq, splits), dtype=torch.float32, device="cuda")
    out = cell.out[0]
    ps = (hq * splits, splits, 1)

    # BLOCK_N 1: every split of the cell's contexts (>= splits tokens) counts as used.
    def run():
        return dk._merge_kernel[(b, hq)](out, po, plse, cell.qsl, cell.seq_lens, cell.vs, 1.0,
                                         out.stride(0), out.stride(1), *ps, splits,
                                         BLOCK_S=max(8, triton.next_power_of_2(splits)),
                                         HEAD_DIM=d, FP8=True, BLOCK_N=1, num_warps=4)
    if carveout:
        prefer_shared(run())
    return [run] * cell.r


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (slope ms per token, intercept ms) over (context, ms) points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope, my - slope * mx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--splits", default="", help="comma list; default: the heuristic's at the "
                    "full context")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--merge-carveout", action="store_true",
                    help="first set the merge kernel's preferred carveout to 100%% shared")
    args = ap.parse_args(argv)
    kb.DTYPE = getattr(torch, args.dtype)
    l2 = kb.run_info()["l2_bytes"]
    ceil = kb.measure_ceilings()["read_tbs"]
    rows, fits = [], []
    arms = [("e4m3_native", "native"), ("e4m3_software", "software"), ("paged_fp16", None)]
    for b in map(int, args.batches.split(",")):
        cell = kb.Cell(HQ, HKV, D, b, args.context, l2)
        if args.merge_carveout:
            for splits in range(2, 65):  # every BLOCK_S specialization the calls may compile
                merge_only(cell, splits, carveout=True)
        for arm, mode in arms:
            fp8 = mode is not None
            cfg = dk.decode_config(D, True, fp8, torch.device("cuda"))
            default = dk.choose_num_splits(b, HKV, args.context, cfg.block_n, dk.sm_count(
                torch.device("cuda")), cfg.programs_per_sm, cfg.whole_waves,
                cfg.short_programs_per_sm)
            for splits in ([int(s) for s in args.splits.split(",")] if args.splits
                           else [default]):
                pts = []
                for ctx in (args.context, args.context // 2, args.context // 4,
                            args.context // 8, args.context // 16, 128 * splits, 128, 0):
                    cell.seq_lens.fill_(ctx)
                    kw = {"num_splits": splits}
                    if fp8:
                        kw["fp8_mode"] = mode
                    ms = kb._graph_time(cell.fns(arm, **kw))
                    row = {"batch": b, "arm": arm, "splits": splits, "context": ctx, "ms": ms}
                    rows.append(row)
                    if ctx >= 1024:
                        pts.append((ctx, ms))
                    print(f"B={b:<3d} {arm:14s} splits={splits:<3d} ctx={ctx:<6d} "
                          f"{ms * 1e3:8.1f} us", flush=True)
                slope, icpt = fit(pts)
                per_tok = cell.kv_bytes(arm) / cell.ctx
                tbs = per_tok / (slope * 1e-3) / 1e12
                fits.append({"batch": b, "arm": arm, "splits": splits,
                             "slope_tbs": tbs, "slope_pct_ceiling": 100 * tbs / ceil,
                             "intercept_us": icpt * 1e3,
                             "zero_tokens_us": rows[-1]["ms"] * 1e3,
                             "one_tile_us": rows[-2]["ms"] * 1e3})
                if splits > 1 and fp8:
                    fits[-1]["merge_alone_us"] = kb._graph_time(merge_only(cell, splits)) * 1e3
        del cell
        torch.cuda.empty_cache()
    print(f"\nread ceiling {ceil:.2f} TB/s; fit over contexts >= 1K\n")
    print("| B | arm | splits | slope TB/s (% ceil) | intercept us | 0 tokens us | 1 tile us "
          "| merge alone us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for f in fits:
        print(f"| {f['batch']} | {f['arm']} | {f['splits']} | {f['slope_tbs']:.2f} "
              f"({f['slope_pct_ceiling']:.0f}%) | {f['intercept_us']:.1f} | "
              f"{f['zero_tokens_us']:.1f} | {f['one_tile_us']:.1f} | "
              f"{f.get('merge_alone_us', float('nan')):.1f} |")
    if args.out:
        info = kb.run_info() | {"read_tbs": ceil, "dtype": args.dtype}
        atomic_write_text(Path(args.out), json.dumps({"info": info, "rows": rows, "fits": fits},
                                               indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
