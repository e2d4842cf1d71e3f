"""Does prefetching o_proj's weight into L2 during decode attention shorten attention + o_proj?

    python scripts/l2_prefetch_probe.py [--out FILE]

Llama-3.1-8B shape (32 q / 8 kv heads, D = 128, o_proj 4096 x 4096, BF16). For each
(batch, context, KV dtype): CUDA graphs over rotated KV sets and weight copies (beyond L2) of
  plain:    attention_i ; o_proj(out_i, W_i)
  prefetch: side stream prefetches W_i while attention_i runs ; join ; o_proj(out_i, W_i)
plus the GEMM alone cold, the GEMM right after a prefetch, and the prefetch alone. Checks that
the prefetch leaves results unchanged first. Prints a table last, writes JSON.
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
from kvcap.kernels.l2_prefetch import l2_prefetch
from kvcap.scales.fsutil import atomic_write_text

HQ, HKV, D, HIDDEN = 32, 8, 128, 4096


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="1:1024,16:1024,64:1024,16:4096,8:16384")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    kb.DTYPE = torch.bfloat16  # the cells' queries, outputs and 16-bit caches
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    w_bytes = HIDDEN * HQ * D * 2
    nw = max(4, math.ceil(8 * l2 / w_bytes))
    ws = [torch.randn(HIDDEN, HQ * D, device="cuda", dtype=torch.bfloat16) * 0.02
          for _ in range(nw)]
    side = torch.cuda.Stream()
    rows = []
    x = torch.randn(16, HQ * D, device="cuda", dtype=torch.bfloat16)
    gemm = _graph_time([lambda w=w: F.linear(x, w) for w in ws])
    pre = _graph_time([lambda w=w: l2_prefetch(w) for w in ws])
    both = _graph_time([f for w in ws for f in (lambda w=w: l2_prefetch(w),
                                               lambda w=w: F.linear(x, w))])
    rows.append({"what": "o_proj 16 rows", "gemm_cold_us": gemm * 1e3,
                 "prefetch_alone_us": pre * 1e3, "prefetch_then_gemm_us": both * 1e3})
    print(f"o_proj alone {gemm*1e3:.1f} us, prefetch alone {pre*1e3:.1f} us, "
          f"prefetch then gemm {both*1e3:.1f} us", flush=True)
    for spec in args.cells.split(","):
        b, ctx = map(int, spec.split(":"))
        cell = Cell(HQ, HKV, D, b, ctx, l2)
        for arm in ("paged_fp16", "e4m3_native"):
            att = cell.fns(arm)
            r = max(len(att), nw)

            def seq(i, prefetch, att=att, cell=cell, b=b):
                return _step(att[i % len(att)], cell.out[i % len(att)].view(b, HQ * D),
                             ws[i % nw], side, prefetch)

            ref = seq(0, False)().clone()
            got = seq(0, True)().clone()
            torch.cuda.synchronize()
            if not torch.equal(ref, got):
                print(f"MISMATCH {b}x{ctx} {arm}", file=sys.stderr)
                return 1
            t_plain = _graph_time([seq(i, False) for i in range(r)])
            t_pre = _graph_time([seq(i, True) for i in range(r)])
            t_att = _graph_time(att)
            row = {"batch": b, "context": ctx, "arm": arm, "attention_us": t_att * 1e3,
                   "plain_us": t_plain * 1e3, "prefetch_us": t_pre * 1e3,
                   "ratio": t_pre / t_plain}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del cell
        torch.cuda.empty_cache()
    print("| B x ctx | arm | attention us | attn+o_proj us | with prefetch us | ratio |")
    for r_ in rows[1:]:
        print(f"| {r_['batch']} x {r_['context']} | {r_['arm']} | {r_['attention_us']:.1f} | "
              f"{r_['plain_us']:.1f} | {r_['prefetch_us']:.1f} | {r_['ratio']:.3f} |")
    if args.out:
        atomic_write_text(Path(args.out), json.dumps({**run_info(), "rows": rows}, indent=1))
    return 0


def _step(attend, out, w, side, prefetch: bool):
    """One attention call then o_proj; with `prefetch` a side stream prefetches the weight
    meanwhile (fork before the attention launch, join before the GEMM)."""

    def step():
        main = torch.cuda.current_stream()
        if prefetch:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                l2_prefetch(w)
        attend()
        if prefetch:
            main.wait_stream(side)
        return F.linear(out, w)
    return step


if __name__ == "__main__":
    raise SystemExit(main())
