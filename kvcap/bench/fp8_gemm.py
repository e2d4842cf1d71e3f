"""FP8-weight linears: kvcap's weight-only E4M3 GEMM (kvcap.kernels.fp8_gemm) against the 16-bit
weights it replaces (cuBLAS, and kvcap's skinny kernel where the model uses it) on each linear
of a model, at decode and prefill row counts, per scale layout and E4M3 decoder.

    python -m kvcap.bench.fp8_gemm [--config kvcap/bench/configs/llama-3.1-8b.json] \
        [--rows 1 16 64 128 256 2048] [--splits 1 2] [--sweep [all|swap]] [--out FILE]

Checks the kernel against its torch twin first (relative error vs cuBLAS on the dequantized
weight), then times every arm in CUDA graphs over enough weight copies to defeat L2 (median of
replays, kvcap.bench.kernels._graph_time): us per call, weight bytes read per second, the
fraction of the streaming-read ceiling measured in the same run, and the speedup over the best
16-bit arm. Rows above the kernel's limit time the model's path there: the weight dequantized
into a scratch buffer, then cuBLAS. Writes JSON (atomically) and prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from kvcap.bench.gemm import linear_shapes, start_report
from kvcap.bench.kernels import _graph_time
from kvcap.bench.throughput import CONFIGS
from kvcap.commands.common import positive_int, require_cuda
from kvcap.kernels import fp8_gemm
from kvcap.kernels.common import sm_count
from kvcap.kernels.skinny_gemm import skinny_linear
from kvcap.models.decode_gemm import row_limits
from kvcap.models.fp8_linear import dequantize_reference
from kvcap.scales.fsutil import atomic_write_text

LAYOUTS = {"row": None, "block128": (128, 128)}
KINDS = {"qkv_proj": "qkv_proj", "o_proj": "o_proj", "gate_up_proj": "swiglu",
         "down_proj": "down_proj"}


def sweep_configs(rows: int, grouped: bool, hopper: bool) -> list[fp8_gemm.Launch]:
    """Launches to time at `rows`: the unswapped tiles, and on Hopper above 32 rows (where
    launch_config may swap) the swapped ones (weight rows as the warpgroup MMA's M: 64 or 128
    a program); with scales along K (`grouped`) each swapped launch both ways: partials
    scaled a K step, and tiles scaled before their MMA (tile_scales)."""
    bms = sorted({16 if rows <= 16 else 32 if rows <= 32 else 64, 64 if rows > 64 else 16})
    bks = (64, 128) if grouped else (64, 128, 256)
    out = [(bm, bn, bk, nw, ns, False, False) for bm, bn, bk, nw, ns in itertools.product(
        bms, (32, 64, 128), bks, (4, 8), (3, 4, 5)) if bm * bn <= 64 * 128]
    if hopper and rows > 32:
        # 64 weight rows in one warpgroup, or 64 / 128 in two (one spills at 128 x 128); 256
        # activation rows a program in 64-wide K steps (128-wide ones spill); 64-wide K steps
        # also halve a stage, so 2-3 programs fit an SM where a 128-wide one fits one. With
        # scales along K also 64 activation rows at 256 rows (the SwiGLU default there).
        tokens = ((64,) if rows <= 64 else (64, 128) if rows <= 128
                  else (64, 128, 256) if grouped else (128, 256))
        out += [(bm, bn, bk, nw, ns, True, scaled)
                for scaled, bm, (bn, nw), bk, ns in itertools.product(
                    (False, True) if grouped else (False,), tokens,
                    ((64, 4), (64, 8), (128, 8)), (64, 128), (3, 4))
                if bm < 256 or bk == 64]
    return out


def _swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def bench_linear(name: str, n: int, k: int, rows: list[int], ceiling: float, layout: str,
                 modes: list[str], sweep: str | None, splits: list[int]) -> list[dict]:
    rb, kg = LAYOUTS[layout] or (1, k)
    w_bytes = n * k
    copies = max(2, -(-(400 << 20) // w_bytes))  # > 8x the H200's 50 MB L2
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(n, k, device="cuda", generator=g) * 60).clamp(-448, 448)
          .to(torch.float8_e4m3fn).view(torch.uint8) for _ in range(copies)]
    s = torch.rand(-(-n // rb), -(-k // kg), device="cuda", generator=g) * 1e-3 + 1e-4
    dense = dequantize_reference(ws[0], s, rb, kg)
    w16 = [dense.to(torch.bfloat16)] + [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                                       for _ in range(max(2, copies // 2) - 1)]
    scratch = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability() >= (9, 0)  # where sweeps offer swapped launches
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ dense.t()
        base = dict(linear=name, n=n, k=k, m=m, layout=layout)

        def row(impl: str, ms: float, bytes_: int, base=base, **extra) -> dict:
            tbs = bytes_ / ms / 1e9
            return {**base, "impl": impl, "us": 1e3 * ms, "tbs": tbs,
                    "pct_ceiling": 100 * tbs / ceiling, **extra}

        cublas_err = _rel_err(F.linear(x, w16[0]), want)
        moved16 = 2 * n * k + 2 * m * (n + k)
        out.append(row("cublas-bf16", _graph_time([functools.partial(F.linear, x, w)
                                                   for w in w16]), moved16, rel_err=cublas_err))
        if m <= row_limits(torch.cuda.get_device_name())[KINDS[name]]:
            out.append(row("skinny-bf16", _graph_time([functools.partial(skinny_linear, x, w)
                                                       for w in w16]), moved16))
        moved8 = w_bytes + 4 * s.numel() + 2 * m * (n + k)
        for mode in modes:
            if m > fp8_gemm.MAX_ROWS:  # the model's path: dequantize into a scratch, cuBLAS
                def deq_mm(w, x=x, mode=mode):
                    fp8_gemm.dequantize_into(w, s, rb, kg, scratch, fp8_mode=mode)
                    return F.linear(x, scratch)
                err = _rel_err(deq_mm(ws[0]), want)
                out.append(row(f"dequant+cublas-{mode}", _graph_time(
                    [functools.partial(deq_mm, w) for w in ws]), moved8, rel_err=err))
                continue
            grouped = kg < k
            configs = [None] + [c for c in (sweep_configs(m, grouped, hopper) if sweep else [])
                                if sweep == "all" or c[5]]
            # gate/up also as the model's decode path: SiLU(gate) * up in the same kernel;
            # K splits (not with SiLU)
            arms = [(False, sk) for sk in splits]
            arms += [(True, 1)] if name == "gate_up_proj" else []
            for cfg, (swiglu, sk) in itertools.product(configs, arms):
                ref = _swiglu_reference(want) if swiglu else want
                call = functools.partial(fp8_gemm.fp8_linear, fp8_mode=mode, config=cfg,
                                         swiglu=swiglu, split_k=sk)
                try:
                    err = _rel_err(call(x, ws[0], s, rb, kg), ref)
                    if err > 4 * cublas_err + 1e-3:
                        raise AssertionError(f"relative error {err:.2e} vs cuBLAS "
                                             f"{cublas_err:.2e}")
                    ms = _graph_time([functools.partial(call, x, w, s, rb, kg) for w in ws])
                except Exception as e:  # noqa: BLE001 - a config that cannot run is reported
                    print(f"{name} m={m} {layout} {mode} {cfg} split {sk}: {e!s:.120}",
                          flush=True)
                    continue
                n_out = n // 2 if swiglu else n
                launch = cfg or fp8_gemm.gemm_config(m, n_out, kg, k, x.device, swiglu)
                default = cfg is None and sk == fp8_gemm.gemm_split(
                    m, n_out, launch, sm_count(x.device), swiglu)
                out.append(row(f"fp8-{'swiglu-' if swiglu else ''}{mode}", ms, moved8,
                               rel_err=err, default=default, split_k=sk, config=list(launch)))
    del ws, w16
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=CONFIGS / "llama-3.1-8b.json")
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[1, 16, 64, 128, 256, 2048])
    ap.add_argument("--linears", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--modes", nargs="+", default=["native", "software"],
                    choices=["native", "software"])
    ap.add_argument("--sweep", nargs="?", const="all", choices=["all", "swap"],
                    help="also every launch configuration (swap: only the swapped operands)")
    ap.add_argument("--splits", type=positive_int, nargs="+", default=[1, 2],
                    help="K splits timed (not for the fused SwiGLU)")
    ap.add_argument("--out", type=Path, default=Path("."),
                    help="a .json file, or a directory for fp8-gemm-DATE.json")
    args = ap.parse_args(argv)
    require_cuda(ap)
    spec, ceil, report, out = start_report(args.config, "fp8-gemm", args.out)
    shapes = linear_shapes(spec)
    for name, layout in itertools.product(args.linears, args.layouts):
        n, k = shapes[name]
        report["rows"] += bench_linear(name, n, k, args.rows, ceil, layout, args.modes,
                                       args.sweep, args.splits)
        atomic_write_text(out, json.dumps(report, indent=1))
    print(f"read ceiling {ceil:.2f} TB/s")
    print(f"{'linear':13} {'layout':8} {'m':>4} {'bf16 us':>8} {'fp8 arm':>24} {'us':>8} "
          f"{'%ceil':>6} {'speedup':>7}  config (BM, BN, BK, warps, stages, swap, tile scales), "
          "K splits")
    for name, layout, m in itertools.product(args.linears, args.layouts, args.rows):
        rows = [r for r in report["rows"]
                if (r["linear"], r["layout"], r["m"]) == (name, layout, m)]
        best16 = min((r["us"] for r in rows if r["impl"].endswith("bf16")), default=None)
        for impl in sorted({r["impl"] for r in rows if not r["impl"].endswith("bf16")}):
            best = min((r for r in rows if r["impl"] == impl), key=lambda r: r["us"])
            print(f"{name:13} {layout:8} {m:4d} {best16 or 0:8.1f} {impl:>24} {best['us']:8.1f} "
                  f"{best['pct_ceiling']:6.1f} {best16 / best['us'] if best16 else 0:7.2f}  "
                  f"{best.get('config', '')} x{best.get('split_k', 1)}"
                  f"{'' if best.get('default', True) else ' (not the default)'}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
