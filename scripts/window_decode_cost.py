"""What a sliding window costs a decode call (GPU): the 8B shape (32 / 8 heads, D = 128, BF16
queries), 16 sequences, the 16-bit, native E4M3 and software E4M3 caches, timed as
kvcap.bench.kernels times its cells (CUDA graphs of >= 8 calls, KV sets rotated beyond L2):

  - the whole context of CONTEXT tokens (no window),
  - the same context through a WINDOW-token window,
  - a context of WINDOW tokens (no window): what the windowed call should cost.

    python scripts/window_decode_cost.py [--context 32768] [--window 4096] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvcap.bench import kernels as kb
from kvcap.bench.provenance import stamp
from kvcap.scales.fsutil import atomic_write_text

ARMS = ("paged_fp16", "e4m3_native", "e4m3_software")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    kb.DTYPE = torch.bfloat16
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    long = kb.Cell(32, 8, 128, args.batch, args.context, l2)
    short = kb.Cell(32, 8, 128, args.batch, args.window, l2)
    for arm in ARMS:
        full = kb._graph_time(long.fns(arm))
        windowed = kb._graph_time(long.fns(arm, window=args.window))
        ref = kb._graph_time(short.fns(arm))
        rows.append(dict(arm=arm, full_us=full * 1e3, windowed_us=windowed * 1e3,
                         window_context_us=ref * 1e3, windowed_over_window_context=windowed / ref,
                         full_over_windowed=full / windowed))
    info = dict(gpu=torch.cuda.get_device_name(0), batch=args.batch, context=args.context,
                window=args.window, shape="llama31-8b", dtype="bfloat16", **stamp())
    print(f"{info['gpu']}: {args.batch} sequences x {args.context} tokens, window {args.window}")
    print(f"{'arm':15s} {'full us':>9s} {'window us':>10s} {'ctx=W us':>9s} {'win/ctxW':>9s} "
          f"{'full/win':>9s}")
    for r in rows:
        print(f"{r['arm']:15s} {r['full_us']:9.1f} {r['windowed_us']:10.1f} "
              f"{r['window_context_us']:9.1f} {r['windowed_over_window_context']:9.3f} "
              f"{r['full_over_windowed']:9.2f}")
    if args.out:
        atomic_write_text(args.out, json.dumps(dict(info=info, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
