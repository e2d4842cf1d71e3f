"""Does prefetching o_proj's weight into L2 during decode attention shorten attention + o_proj?

    python scripts/l2_prefetch_probe.py [--out FILE]

Llama-3.1-8B shape (32 q / 8 kv heads, D = 128, o_proj 4096 x 4096, BF16). For each
(batch, context, KV dtype): CUDA graphs over rotated KV sets and weight copies (beyond L2) of
  plain:    attention_i ; o_proj(out_i, W_i)
  side:     side stream prefetches W_i while attention_i runs ; join ; o_proj(out_i, W_i)
  inline:   attention_i ; prefetch W_i ; o_proj(out_i, W_i)   (one stream)
and every linear of the shape alone (weights beyond L2) and right after a prefetch of its
weight. Checks that the prefetch leaves results unchanged first. Prints a table last, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import kvcap.bench.kernels as kb
from kvcap.bench.kernels import Cell, _graph_time, run_info
from kvcap.kernels.l2_prefetch import l2_prefetch, supported
from kvcap.scales.fsutil import atomic_write_text

HQ, HKV, D, HIDDEN = 32, 8, 128, 4096


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="1:1024,16:1024,64:1024,16:4096,8:16384")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not supported(torch.device("cuda")):
        print("l2_prefetch_probe: the bulk L2 prefetch needs an sm_90+ (Hopper) CUDA GPU",
              file=sys.stderr)
        return 2
    torch.manual_seed(0)
    kb.DTYPE = torch.bfloat16  # the cells' queries, outputs and 16-bit caches
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    w_bytes = HIDDEN * HQ * D * 2
    nw = max(4, math.ceil(8 * l2 / w_bytes))
    ws = [torch.randn(HIDDEN, HQ * D, device="cuda", dtype=torch.bfloat16) * 0.02
          for _ in range(nw)]
    side = torch.cuda.Stream()
    rows = []
    rows += gemm_rows(l2)
    for spec in filter(None, args.cells.split(",")):
        b, ctx = map(int, spec.split(":"))
        cell = Cell(HQ, HKV, D, b, ctx, l2)
        for arm in ("paged_fp16", "e4m3_native"):
            att = cell.fns(arm)
            r = max(len(att), nw)

            def seq(i, mode, att=att, cell=cell, b=b):
                return _step(att[i % len(att)], cell.out[i % len(att)].view(b, HQ * D),
                             ws[i % nw], side, mode)

            ref = seq(0, "plain")().clone()
            for mode in ("side", "inline"):
                got = seq(0, mode)().clone()
                torch.cuda.synchronize()
                if not torch.equal(ref, got):
                    print(f"MISMATCH {b}x{ctx} {arm} {mode}", file=sys.stderr)
                    return 1
            t = {mode: _graph_time([seq(i, mode) for i in range(r)])
                 for mode in ("plain", "side", "inline")}
            t_att = _graph_time(att)
            row = {"batch": b, "context": ctx, "arm": arm, "attention_us": t_att * 1e3,
                   "plain_us": t["plain"] * 1e3, "side_us": t["side"] * 1e3,
                   "inline_us": t["inline"] * 1e3}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del cell
        torch.cuda.empty_cache()
    print("| B x ctx | arm | attention us | attn+o_proj us | side-stream prefetch | inline |")
    for r_ in (r_ for r_ in rows if "arm" in r_):
        print(f"| {r_['batch']} x {r_['context']} | {r_['arm']} | {r_['attention_us']:.1f} | "
              f"{r_['plain_us']:.1f} | {r_['side_us']:.1f} | {r_['inline_us']:.1f} |")
    if args.out:
        atomic_write_text(Path(args.out), json.dumps({**run_info(), "rows": rows}, indent=1))
    return 0


def gemm_rows(l2: int) -> list[dict]:
    """Every distinct linear of the 8B shape at decode row counts: the GEMM alone over weight
    copies beyond L2, and right after a prefetch of its weight (same stream)."""
    from kvcap.bench.gemm import linear_shapes
    from kvcap.bench.throughput import CONFIGS
    from kvcap.config import ModelSpec

    spec = ModelSpec.from_hf_config(json.loads((CONFIGS / "llama-3.1-8b.json").read_text()))
    out = []
    for name, (n, k) in linear_shapes(spec).items():
        w_bytes = n * k * 2
        copies = max(2, math.ceil(3 * l2 / w_bytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
              for _ in range(copies)]
        for m in (1, 16, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cold = _graph_time([lambda w=w, x=x: F.linear(x, w) for w in ws])
            # _graph_time gives the time per launched function: two per weight here
            warm = 2 * _graph_time([f for w in ws for f in (lambda w=w: l2_prefetch(w),
                                                            lambda w=w, x=x: F.linear(x, w))])
            row = {"linear": name, "n": n, "k": k, "m": m, "weight_mb": w_bytes / 1e6,
                   "gemm_us": cold * 1e3, "pair_us": warm * 1e3,
                   "ratio": warm / cold}
            out.append(row)
            print(f"{name:13s} m={m:3d} {w_bytes / 1e6:7.1f} MB  gemm {cold * 1e3:7.1f} us  "
                  f"prefetch+gemm {warm * 1e3:7.1f} us  ({warm / cold:.3f}x)", flush=True)
        del ws
        torch.cuda.empty_cache()
    return out


def _step(attend, out, w, side, mode: str):
    """One attention call then o_proj. mode "side": a side stream prefetches the weight during
    the attention (fork before its launch, join before the GEMM); "inline": the prefetch is
    launched between the attention and the GEMM on the same stream; "plain": no prefetch."""

    def step():
        main = torch.cuda.current_stream()
        if mode == "side":
            side.wait_stream(main)
            with torch.cuda.stream(side):
                l2_prefetch(w)
        attend()
        if mode == "side":
            main.wait_stream(side)
        elif mode == "inline":
            l2_prefetch(w)
        return F.linear(out, w)
    return step


if __name__ == "__main__":
    raise SystemExit(main())
