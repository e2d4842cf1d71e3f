"""Chunked-prefill attention: FP16/BF16 cache vs E4M3 (both decoders) at launch configurations.

    python scripts/prefill_sweep.py [--out FILE.json] [--dtype float16|bfloat16]
        [--configs BM:BN:W:S[:R],...] [--contexts 2048,8192,16384] [--chunk 2048]
        [--shape HQ,HKV,D]

Llama-3.1-8B shape by default (32 q / 8 kv heads, D = 128; `--shape 24,4,256` the GQA-6 /
D = 256 one), one sequence whose last `chunk` tokens are new
(the engine's default step budget is 2048 tokens) and attend to all the context before them,
causally among themselves. Times paged_prefill with CUDA-graph replays (kvcap.bench.kernels'
protocol) per cache arm x configuration x context; prints µs, attention TFLOP/s and each E4M3
arm's time over the 16-bit cache's at the same configuration; writes JSON. R is a register cap
per thread (0: none); "default" is each arm's own prefill_config (the E4M3 arms' register cap
included).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from kvcap.bench import kernels as kb
from kvcap.kernels.prefill import paged_prefill, prefill_config
from kvcap.scales.fsutil import atomic_write_text

SHAPE_8B = (32, 8, 128)
ARMS = ("paged_fp16", "e4m3_native", "e4m3_software")


def causal_flops(ctx: int, chunk: int, hq: int, d: int) -> float:
    """QK^T and PV multiply-adds (2 FLOPs each) of `chunk` new tokens after ctx - chunk cached."""
    visible = sum(ctx - chunk + j + 1 for j in range(chunk))
    return 4.0 * hq * d * visible


def prefill_fns(cell: kb.Cell, q: torch.Tensor, outs: list, chunk: int, arm: str,
                knobs: dict) -> list:
    """One paged_prefill call per KV set of the cell: its last `chunk` tokens are new."""
    fp8 = arm.startswith("e4m3")
    kc, vc = (cell.k8, cell.v8) if fp8 else (cell.k16, cell.v16)
    mode = "software" if arm == "e4m3_software" else "auto"
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    sc = 1 / math.sqrt(cell.d)
    return [lambda i=i: paged_prefill(
        q, kc, vc, outs[i], cell.tables[i], cell.seq_lens, qsl, sc, chunk,
        cell.ks if fp8 else None, cell.vs if fp8 else None, fp8_mode=mode, **knobs)
        for i in range(cell.r)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--contexts", default="2048,8192,16384")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--configs", default="",
                    help="BM:BN:W:S[:R] or 'default' list; default: the default and a few "
                         "around it")
    ap.add_argument("--shape", default=",".join(map(str, SHAPE_8B)),
                    help="query heads, KV heads, head_dim")
    args = ap.parse_args(argv)
    hq, hkv, d = (int(x) for x in args.shape.split(","))
    kb.DTYPE = getattr(torch, args.dtype)
    configs = ([None if c == "default" else tuple(int(x) for x in c.split(":"))
                for c in args.configs.split(",")] if args.configs else
               [None, (128, 64, 8, 2), (128, 64, 4, 2), (128, 32, 4, 2), (128, 32, 8, 3),
                (64, 64, 4, 2), (128, 64, 8, 3)])
    l2 = kb.run_info()["l2_bytes"]
    rows = []
    for ctx in map(int, args.contexts.split(",")):
        cell = kb.Cell(hq, hkv, d, 1, ctx, l2)
        g = torch.Generator(device="cuda").manual_seed(ctx)
        q = torch.randn(args.chunk, hq, d, generator=g, device="cuda", dtype=kb.DTYPE)
        outs = [torch.empty_like(q) for _ in range(cell.r)]
        flops = causal_flops(ctx, args.chunk, hq, d)
        ref = None
        for given in configs:
            base = None
            for arm in ARMS:
                fp8 = arm.startswith("e4m3")
                default = tuple(prefill_config(d, hq // hkv, torch.device("cuda"), fp8))
                default = default[:4] + (default[4] or 0,)  # R 0: no cap, as the knob reads it
                cfg = default if given is None else given + (0,) * (5 - len(given))
                knobs = dict(zip(("block_m", "block_n", "num_warps", "num_stages", "maxnreg"),
                                 cfg, strict=True))
                fns = prefill_fns(cell, q, outs, args.chunk, arm, knobs)
                try:
                    ms = kb._graph_time(fns, reps=20)
                except Exception as e:  # e.g. out of shared memory at this configuration
                    print(f"ctx={ctx} {cfg} {arm}: {type(e).__name__}: {e}"[:200], flush=True)
                    continue
                out = fns[0]().float()
                if ref is None and not fp8:
                    ref = out
                err = float((out - ref).norm() / ref.norm()) if ref is not None else None
                base = ms if not fp8 else base
                row = {"context": ctx, "chunk": args.chunk, "config": list(cfg), "arm": arm,
                       "default": cfg == default, "us": ms * 1e3,
                       "tflops": flops / (ms * 1e-3) / 1e12, "err_vs_16bit": err,
                       "x_16bit": ms / base if base else None}
                rows.append(row)
                tiles = ":".join(f"{k}{v}" for k, v in zip("BM BN W S R".split(), cfg, strict=True))
                print(f"ctx={ctx:<6d} {tiles} {arm:14s} "
                      f"{row['us']:8.1f} us {row['tflops']:6.1f} TFLOP/s "
                      f"x16bit {row['x_16bit'] or 0:.3f} err {err or 0:.1e}", flush=True)
        del cell
        torch.cuda.empty_cache()
    if args.out:
        info = kb.run_info() | {"dtype": args.dtype, "shape": [hq, hkv, d]}
        atomic_write_text(Path(args.out), json.dumps({"info": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
