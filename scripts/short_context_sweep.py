"""Decode at short contexts and small batches: split counts and tile sizes per cache arm.

    python scripts/short_context_sweep.py [--out FILE.json] [--dtype bfloat16]
        [--batches 1,2,4,8] [--contexts 1024,2048,4096] [--shape HQ,HKV,D]
        [--splits 1,2,4,8,16,32] [--tiles 64,128]
    python scripts/short_context_sweep.py --compare-rules [--classes 2048,16384] ...
    python scripts/short_context_sweep.py --compare-routes [--classes 2048,16384] ...

Why: end to end at 1 x 1K (8B shape) the E4M3 cache decoded 1-2% slower than the BF16 one
(docs/benchmarks/throughput-2026-12-02e-h200-low-bf16.json), where the attention call is a
latency-bound launch of a few dozen programs: the E4M3 word route's 128-token tiles and its
rule of >= 4 tiles per split give it fewer, longer programs than the 16-bit kernel. This
times every arm's default launch, then each arm at explicit split counts (and, for E4M3, 64-
and 128-token tiles), with kvcap.bench.kernels' protocol (CUDA graphs of >= 8 calls over KV
sets beyond L2), checks every output against the arm's default, prints the best launch per
arm and cell next to the 16-bit default, and writes JSON. `--compare-rules` instead times
each arm at the split count of choose_num_splits without and with its short-context rule
(decode_config's short_programs_per_sm), computed as the engine computes it: from the context
class a step's graph was captured for (`--classes`, the engine's 2048 / 16384 / max length)
while the sequences hold `--contexts` tokens. `--compare-routes` times the E4M3 word route
against the short-context byte route (decode.short_byte_route) the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvcap.bench import kernels as kb
from kvcap.kernels.common import sm_count
from kvcap.kernels.decode import choose_num_splits, decode_config, default_launch
from kvcap.scales.fsutil import atomic_write_text

ARMS = ("paged_fp16", "e4m3_native", "e4m3_software")


def arm_launches(arm: str, tiles: list[int], splits: list[int], cell: kb.Cell,
                 stages: list[int] | None = None, both_routes: bool = False) -> list[dict]:
    """paged_decode keywords to time for one arm (the default launch first, as {}); E4M3
    launches keep the route (and its register cap) the default takes for the cell, or with
    `both_routes` also take the other one (word route / short-context byte route)."""
    out: list[dict] = [{}]
    if arm == "paged_fp16":
        return out + [{"num_splits": s} for s in splits]
    dev = torch.device("cuda")
    words, cfg, _ = default_launch(cell.b, cell.hkv, cell.ctx, cell.d, True, dev)
    routes = [(words, cfg)]
    if both_routes:
        other = not words
        routes.append((other, decode_config(cell.d, True, True, dev, words=other,
                                            short_route=not other)))
    for route_words, rcfg in routes:
        for bn in tiles:
            for ns in stages or [rcfg.num_stages]:
                for s in splits:
                    kw = dict(block_n=bn, num_warps=rcfg.num_warps, num_stages=ns,
                              maxnreg=rcfg.maxnreg or 0, num_splits=s, words=route_words)
                    out.append({**kw, "pairs": rcfg.pairs} if route_words else kw)
    return out


def compare_rules(cell: kb.Cell, cls: int, rows: list[dict]) -> None:
    """Times each arm at the split count without and with the short-context rule, chosen for
    a `cls`-token context class; prints the ratio."""
    dev = torch.device("cuda")
    b, ctx = cell.b, cell.ctx
    for arm in ARMS:
        words, cfg, _ = default_launch(b, cell.hkv, cls, cell.d, arm != "paged_fp16", dev)
        args = (b, cell.hkv, cls, cfg.block_n, sm_count(dev), cfg.programs_per_sm,
                cfg.whole_waves)
        old, new = choose_num_splits(*args), choose_num_splits(*args, cfg.short_programs_per_sm)
        times = {}
        for rule, s in (("old", old), ("new", new)):
            if rule == "new" and new == old:
                times["new"] = times["old"]
                continue
            fns = cell.fns(arm, num_splits=s, words=words if arm != "paged_fp16" else None)
            fns[0]()
            if rule == "old":
                ref = cell.out[0].clone()
            err = kb._rel(cell.out[0], ref)
            times[rule] = kb._graph_time(fns, reps=20) * 1e3
            if err > 2e-3:
                print(f"MISMATCH {arm} B={b} ctx={ctx} splits={s}: {err:.1e}", flush=True)
        rows.append({"batch": b, "context": ctx, "context_class": cls, "arm": arm,
                     "splits_old": old, "splits_new": new, "us_old": times["old"],
                     "us_new": times["new"]})
        print(f"rules B={b} ctx={ctx} (class {cls}) {arm:13s} old {old:2d} splits "
              f"{times['old']:6.1f}us  new {new:2d} splits {times['new']:6.1f}us  "
              f"x{times['new'] / times['old']:.3f}", flush=True)


def launch_of(cfg, words: bool) -> dict:
    """paged_decode keywords that pin a DecodeConfig's launch (route, tiles, cap)."""
    kw = dict(words=words, block_n=cfg.block_n, num_warps=cfg.num_warps,
              num_stages=cfg.num_stages, maxnreg=cfg.maxnreg or 0)
    return {**kw, "pairs": cfg.pairs} if words else kw


def compare_routes(cell: kb.Cell, cls: int, rows: list[dict]) -> None:
    """Times each E4M3 decoder on the word route and on the short-context byte route
    (decode_config(short_route=True), whatever short_byte_route says of the call), each at the
    split count the engine computes for a `cls`-token class, next to the 16-bit kernel's
    default for that class."""
    dev = torch.device("cuda")
    b, ctx = cell.b, cell.ctx
    s16 = default_launch(b, cell.hkv, cls, cell.d, False, dev)[2]
    fns = cell.fns("paged_fp16", num_splits=s16)
    fns[0]()
    ref = cell.out[0].clone()
    base = kb._graph_time(fns, reps=20) * 1e3
    for arm in ARMS[1:]:
        times = {}
        for route, words in (("word", True), ("byte", False)):
            cfg = decode_config(cell.d, True, True, dev, words=words, short_route=not words)
            s = choose_num_splits(b, cell.hkv, cls, cfg.block_n, sm_count(dev),
                                  cfg.programs_per_sm, cfg.whole_waves,
                                  cfg.short_programs_per_sm)
            fns = cell.fns(arm, num_splits=s, **launch_of(cfg, words))
            fns[0]()
            err = kb._rel(cell.out[0], ref)
            if err > 0.1:
                print(f"MISMATCH {arm} {route} B={b} ctx={ctx}: {err:.1e}", flush=True)
            times[route] = (kb._graph_time(fns, reps=20) * 1e3, s, cfg.block_n)
        rows.append({"batch": b, "context": ctx, "context_class": cls, "arm": arm,
                     "us_16bit": base, "splits_16bit": s16,
                     **{f"{k}_{r}": v[i] for r, v in times.items()
                        for i, k in enumerate(("us", "splits", "block_n"))}})
        (w, ws, _), (y, ys, _) = times["word"], times["byte"]
        print(f"routes B={b:3d} ctx={ctx} (class {cls}) {arm:13s} 16-bit {base:6.1f}us  "
              f"word {ws:2d} splits {w:6.1f}us  byte {ys:2d} splits {y:6.1f}us  "
              f"byte/word x{y / w:.3f}  byte/16-bit x{y / base:.3f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--contexts", default="1024,2048,4096")
    ap.add_argument("--shape", default="32,8,128", help="HQ,HKV,D (default: Llama-3.1-8B)")
    ap.add_argument("--splits", default="1,2,4,8,16,32")
    ap.add_argument("--tiles", default="64,128", help="E4M3 tile sizes (BLOCK_N) to time")
    ap.add_argument("--stages", default="",
                    help="E4M3 pipeline depths to time (default: the arm's own)")
    ap.add_argument("--both-routes", action="store_true",
                    help="E4M3: time the word route and the short-context byte route alike")
    ap.add_argument("--compare-rules", action="store_true",
                    help="time the split count without and with the short-context rule")
    ap.add_argument("--compare-routes", action="store_true",
                    help="E4M3: the word route against the short-context byte route, at the "
                         "engine's split counts for the context class")
    ap.add_argument("--classes", default="",
                    help="--compare-rules: context classes the split count is chosen from "
                         "(the smallest >= the context; default: the context itself)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        hq, hkv, d = (int(x) for x in args.shape.split(","))
        batches = [int(x) for x in args.batches.split(",")]
        contexts = [int(x) for x in args.contexts.split(",")]
        splits = [int(x) for x in args.splits.split(",")]
        tiles = [int(x) for x in args.tiles.split(",")]
        stages = [int(x) for x in args.stages.split(",") if x]
        classes = sorted(int(x) for x in args.classes.split(",") if x)
    except ValueError:
        raise SystemExit("--shape/--batches/--contexts/--splits/--tiles: comma-separated "
                         "integers, e.g. --shape 32,8,128 --splits 1,2,4") from None
    kb.DTYPE = getattr(torch, args.dtype)
    info = kb.run_info()
    info.update(dtype=args.dtype, shape=[hq, hkv, d], block_size=kb.BLOCK_SIZE)
    ceil = kb.measure_ceilings()
    rows: list[dict] = []
    out = Path(args.out or Path(__import__("os").environ.get("OUT", ".")) / "short.json")

    def save() -> None:
        atomic_write_text(out, json.dumps({"info": info, "ceilings": ceil, "rows": rows},
                                          indent=1))

    dev = torch.device("cuda")
    for b in batches:
        for ctx in contexts:
            cell = kb.Cell(hq, hkv, d, b, ctx, info["l2_bytes"])
            if args.compare_rules or args.compare_routes:
                cls = next((c for c in classes if c >= ctx), ctx)
                (compare_routes if args.compare_routes else compare_rules)(cell, cls, rows)
                save()
                del cell
                torch.cuda.empty_cache()
                continue
            best: dict[str, tuple[float, dict]] = {}
            for arm in ARMS:
                _, cfg, default_splits = default_launch(b, hkv, ctx, d, arm != "paged_fp16",
                                                        dev)
                ref = None
                for kw in arm_launches(arm, tiles, splits, cell, stages, args.both_routes):
                    fns = cell.fns(arm, **kw)
                    try:
                        fns[0]()
                    except Exception as exc:  # noqa: BLE001 - e.g. a launch out of resources
                        print(f"skip {arm} {kw}: {type(exc).__name__}", flush=True)
                        continue
                    if ref is None:
                        ref = cell.out[0].clone()
                    err = kb._rel(cell.out[0], ref)
                    ms = kb._graph_time(fns, reps=20)
                    row = {"batch": b, "context": ctx, "arm": arm, "default": not kw,
                           "default_splits": default_splits, "block_n": cfg.block_n, **kw,
                           "us": ms * 1e3, "rel_err_vs_default": err}
                    rows.append(row)
                    if arm not in best or ms < best[arm][0]:
                        best[arm] = (ms, row)
                    if err > 2e-3:
                        print(f"MISMATCH {row}", flush=True)
            base = next(r["us"] for r in rows if r["batch"] == b and r["context"] == ctx
                        and r["arm"] == "paged_fp16" and r["default"])
            for arm in ARMS:
                dflt = next(r for r in rows if r["batch"] == b and r["context"] == ctx
                            and r["arm"] == arm and r["default"])
                ms, r = best[arm]
                print(f"B={b} ctx={ctx} {arm:13s} default {dflt['us']:6.1f}us "
                      f"(splits {dflt['default_splits']}, x{dflt['us'] / base:.2f} of 16-bit) "
                      f"best {ms * 1e3:6.1f}us (words={r.get('words')} BN={r.get('block_n')} "
                      f"S={r.get('num_stages')} "
                      f"splits={r.get('num_splits', r['default_splits'])}, "
                      f"x{ms * 1e3 / base:.2f})", flush=True)
            save()
            del cell
            torch.cuda.empty_cache()
    save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
