"""Decode-size GEMMs: cuBLAS (`F.linear`) vs kvcap's weight-streaming Triton kernel
(kvcap.kernels.skinny_gemm) on every distinct linear of a model, at M = 16 and 64 rows; and the
MLP's gate/up GEMM + SiLU-and-multiply as cuBLAS + `fused_ops.silu_mul` (two kernels, the
model's path without the skinny kernels) vs `skinny_swiglu` (one kernel), as "swiglu".

    python -m kvcap.bench.gemm [--config kvcap/bench/configs/llama-3.1-8b.json] [--out FILE]

Checks each kernel configuration against an FP32 reference first, then times both in CUDA
graphs over enough distinct weight copies to defeat L2 (median of replays), as bytes read
(weights + activations) per second and as a fraction of the streaming-read ceiling measured in
the same run. Sweeps the Triton launch configuration per shape and reports the best next to
cuBLAS. Writes JSON (atomically) and prints a short table last.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from kvcap.bench.kernels import _graph_time, measure_ceilings
from kvcap.bench.throughput import CONFIGS
from kvcap.commands.common import positive_int, require_cuda
from kvcap.kernels.skinny_gemm import skinny_linear, skinny_swiglu
from kvcap.scales.fsutil import atomic_write_text

SWEEP_STAGES = (3, 5)


def sweep_configs(stages=SWEEP_STAGES, splits=(1,), warps=(4, 8),
                  block_ns: tuple[int, ...] | None = None) -> list[dict]:
    """Launch keywords the Triton sweep tries: every (BLOCK_N, BLOCK_K, warps, stages) without
    split-K, and for each split count > 1 the 32- and 64-column tiles of 128-wide K steps on
    4 warps (the plain kernel's usual winners). `block_ns` replaces both sets of column tile
    widths (e.g. 128 / 256 at 64 rows, where narrow tiles make every program re-read the
    activation rows from L2: 128 programs x 64 rows x 14,336 x 2 bytes = 235 MB on down_proj,
    twice its weight); with it the split configurations also try `warps`."""
    plain = block_ns or (16, 32, 64)
    out = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns) for bn, bk, nw, ns in
           itertools.product(plain, (128, 256), warps, stages)]
    split_warps = warps if block_ns else (4,)
    out += [dict(block_n=bn, block_k=128, num_warps=nw, num_stages=ns, split_k=sk)
            for sk, bn, nw, ns in itertools.product([s for s in splits if s > 1],
                                                    block_ns or (32, 64), split_warps, stages)]
    return out


SWEEP = sweep_configs()


def linear_shapes(spec) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each distinct linear of a Llama-family model."""
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    return {"qkv_proj": (q + 2 * kv, spec.hidden_size), "o_proj": (spec.hidden_size, q),
            "gate_up_proj": (2 * spec.intermediate_size, spec.hidden_size),
            "down_proj": (spec.hidden_size, spec.intermediate_size),
            "lm_head": (spec.vocab_size, spec.hidden_size)}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def _unfused_swiglu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from kvcap.kernels.fused_ops import silu_mul

    return silu_mul(F.linear(x, w))


def _swiglu_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = (x.float() @ w.float().t()).chunk(2, dim=-1)
    return F.silu(gate) * up


def bench_shape(name: str, n: int, k: int, rows: list[int], ceiling: float,
                sweep=SWEEP) -> list[dict]:
    """cuBLAS and every Triton configuration in `sweep` (none: cuBLAS only) on one linear;
    name "swiglu": the fused gate/up weight [n, k] into SiLU(gate) * up."""
    fused = name == "swiglu"
    plain, triton_fn = ((_unfused_swiglu, skinny_swiglu) if fused
                        else (F.linear, skinny_linear))
    w_bytes = n * k * 2
    copies = max(2, -(-(400 << 20) // w_bytes))  # > 8x the H200's 50 MB L2
    ws = [torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02 for _ in range(copies)]
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        want = _swiglu_reference(x, ws[0]) if fused else x.float() @ ws[0].float().t()
        moved = w_bytes + 2 * m * ((n // 2 if fused else n) + k)

        def row(impl: str, ms: float, m=m, moved=moved, **extra) -> dict:
            tbs = moved / ms / 1e9
            return {"linear": name, "n": n, "k": k, "m": m, "impl": impl, "us": 1e3 * ms,
                    "tbs": tbs, "pct_ceiling": 100 * tbs / ceiling, **extra}

        cublas_err = _rel_err(plain(x, ws[0]), want)
        out.append(row("cublas", _graph_time([functools.partial(plain, x, w) for w in ws]),
                       rel_err=cublas_err))
        for kw in sweep:
            if fused and kw.get("split_k", 1) > 1:
                continue  # skinny_swiglu has no split-K
            try:
                err = _rel_err(triton_fn(x, ws[0], **kw), want)
                if err > 4 * cublas_err + 1e-4:
                    raise AssertionError(f"relative error {err:.2e} vs cuBLAS {cublas_err:.2e}")
                ms = _graph_time([functools.partial(triton_fn, x, w, **kw) for w in ws])
            except Exception as e:  # noqa: BLE001 - a config that cannot run is reported
                print(f"{name} m={m} {kw}: {e!s:.100}", flush=True)
                continue
            out.append(row("triton", ms, **{"split_k": 1, **kw},
                           rel_err=err))
    del ws
    torch.cuda.empty_cache()
    return out


def start_report(config: Path, prefix: str, out: Path):
    """(model spec, read ceiling in TB/s, report header, result path) of a GEMM benchmark run
    on `config`'s linears: the ceiling measured now, the path `prefix`-DATE.json under `out`
    unless `out` names a file."""
    from kvcap.bench.provenance import result_path, stamp
    from kvcap.config import ModelSpec

    spec = ModelSpec.from_hf_config(json.loads(config.read_text()))
    ceil = measure_ceilings()["read_tbs"]
    report = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              **stamp(), "torch": torch.__version__, "config": config.name,
              "read_ceiling_tbs": ceil, "rows": []}
    return spec, ceil, report, result_path(out, f"{prefix}-{report['date']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=CONFIGS / "llama-3.1-8b.json")
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[16, 64])
    ap.add_argument("--linears", nargs="+", default=None,
                    choices=["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head",
                             "swiglu"],  # (linear_shapes; an unknown name timed nothing)
                    help="which of the model's linears (default: all, and swiglu)")
    ap.add_argument("--stages", type=positive_int, nargs="+", default=list(SWEEP_STAGES),
                    help="pipeline depths the Triton sweep tries")
    ap.add_argument("--warps", type=positive_int, nargs="+", default=[4, 8])
    ap.add_argument("--splits", type=positive_int, nargs="+", default=[1],
                    help="split-K counts the sweep tries (1: none)")
    ap.add_argument("--block-ns", type=positive_int, nargs="+", default=None,
                    help="column tile widths the sweep tries (default: 16 32 64 unsplit, "
                         "32 64 split)")
    ap.add_argument("--out", type=Path, default=Path("."),
                    help="a .json file, or a directory for gemm-DATE.json (-2, -3, ... when "
                         "that exists: an earlier run is never overwritten)")
    args = ap.parse_args(argv)
    require_cuda(ap)
    spec, ceil, report, out = start_report(args.config, "gemm", args.out)
    shapes = {**linear_shapes(spec), "swiglu": linear_shapes(spec)["gate_up_proj"]}
    shapes = {name: nk for name, nk in shapes.items() if not args.linears or name in args.linears}
    for name, (n, k) in shapes.items():
        report["rows"] += bench_shape(name, n, k, args.rows, ceil,
                                      sweep_configs(tuple(args.stages),
                                                    tuple(args.splits), tuple(args.warps),
                                                    tuple(args.block_ns or ()) or None))
        atomic_write_text(out, json.dumps(report, indent=1))
    print(f"read ceiling {ceil:.2f} TB/s")
    print(f"{'linear':14} {'m':>3} {'cuBLAS us':>10} {'%ceil':>6} {'triton us':>10} {'%ceil':>6} "
          f"{'ratio':>6}  best config (BN, BK, warps, stages, split)")
    for name in shapes:
        for m in args.rows:
            rows = [r for r in report["rows"] if r["linear"] == name and r["m"] == m]
            cb = next(r for r in rows if r["impl"] == "cublas")
            tr = min((r for r in rows if r["impl"] == "triton"), key=lambda r: r["us"],
                     default=None)
            if tr is None:
                print(f"{name:14} {m:3d} {cb['us']:10.1f} {cb['pct_ceiling']:6.1f}  (no triton)")
                continue
            print(f"{name:14} {m:3d} {cb['us']:10.1f} {cb['pct_ceiling']:6.1f} {tr['us']:10.1f} "
                  f"{tr['pct_ceiling']:6.1f} {cb['us'] / tr['us']:6.2f}  "
                  f"{tr['block_n']}, {tr['block_k']}, {tr['num_warps']}, {tr['num_stages']}, "
                  f"{tr['split_k']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
