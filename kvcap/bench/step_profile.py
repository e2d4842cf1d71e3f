"""Where a GPU decode step's time goes: kernel time per step by category, and the model's
GEMMs against the read ceiling.

    python -m kvcap.bench.step_profile [--config kvcap/bench/configs/llama-3.1-8b.json]
        [--cells fp16:16:1024 fp8:16:16384 ...] [--steps 20] [--out FILE]

1. GEMMs: every distinct linear of the model (fused QKV, o_proj, fused gate/up, down_proj,
   LM head) as `F.linear` (cuBLAS) at M = 16 and 64 rows, timed in a CUDA graph over enough
   distinct weight copies to defeat L2; bytes read (weights + activations) over time, as a
   fraction of the streaming-read ceiling measured in the same run.
2. Steps: a random-weight model in the engine (CUDA graphs, overlap: the serving path) with
   `concurrency` requests of `context` tokens, all decoding; `--steps` decode steps under the
   torch profiler. Kernel time per step by category (GEMM, attention, KV write, norm, RoPE,
   activation, sampling, other) next to the wall time per step, so the gap between the step and
   its roofline (`kvcap.bench.throughput`) can be attributed. `--eager` runs the steps without
   CUDA graphs (as every mixed prefill + decode step runs): the wall time is then taken in
   steps of their own, unprofiled, and the profiled ones also record kernel launches per step
   and the host operators that took the most time (where an eager step's host cost goes).

Writes JSON (atomically) and prints a short table last.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import time
from pathlib import Path

import torch

from kvcap.bench.gemm import bench_shape, linear_shapes
from kvcap.bench.kernels import measure_ceilings
from kvcap.bench.throughput import CONFIGS, kv_arm
from kvcap.commands.common import positive_int, require_cuda
from kvcap.scales.fsutil import atomic_write_text

# First match wins; names are matched lower-case.
CATEGORIES = [
    ("attention", ("_decode_kernel", "_merge_kernel", "_prefill", "qsa")),
    ("kv_write", ("store_kv",)),
    ("norm", ("rms_norm", "rmsnorm")),
    ("rope", ("rope",)),
    ("activation", ("silu",)),
    ("sampling", ("argmax", "topk", "top_p", "sampl", "softmax", "multinomial")),
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "sm90_", "sm80_", "splitk")),
]


def category(kernel_name: str) -> str:
    name = kernel_name.lower()
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


def time_gemms(spec, rows: list[int], ceiling_tbs: float) -> list[dict]:
    """cuBLAS (`F.linear`, the model's own call) on every distinct linear of the model."""
    return [r for name, (n, k) in linear_shapes(spec).items()
            for r in bench_shape(name, n, k, rows, ceiling_tbs, sweep=())]


def profile_cell(config: Path, kv: str, concurrency: int, context: int, steps: int,
                 dtype: str = "float16", eager: bool = False) -> dict:
    from kvcap import LLM
    from kvcap.bench.throughput import calibrated_scales

    model = f"dummy:{config}"
    with kv_arm(kv) as kv_dtype:  # the arm's switches hold through capture and every step
        scales = calibrated_scales(model, dtype) if kv_dtype == "fp8_e4m3" else None
        llm = LLM(model=model, dtype=dtype, kv_cache_dtype=kv_dtype, kv_scales=scales,
                  max_num_seqs=concurrency, max_model_len=context + 256,
                  max_num_batched_tokens=8192, enforce_eager=eager)
        try:
            return {"kv": kv, "eager": eager,
                    **_profile_steps(llm, concurrency, context, steps, eager)}
        finally:
            llm.shutdown()
            del llm
            torch.cuda.empty_cache()


def _profile_steps(llm, concurrency: int, context: int, steps: int, eager: bool = False) -> dict:
    """`steps` decode steps of `concurrency` requests of `context` tokens, under the profiler
    (eager: timed first in `steps` unprofiled steps, then profiled with host operators too)."""
    from torch.profiler import ProfilerActivity, profile

    from kvcap import SamplingParams
    from kvcap.bench.throughput import _sync

    gen = torch.Generator().manual_seed(context + concurrency)
    ids = torch.randint(100, llm.spec.vocab_size - 100, (concurrency, context),
                        generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 64, ignore_eos=True)
    for i, p in enumerate(ids):
        llm.engine.add_request(f"r{i}", p, params)
    # Prefill, then a few decode steps so every request decodes in lockstep.
    while _prefilling(llm):
        llm.engine.step()
    for _ in range(8):
        llm.engine.step()
    _sync(llm)

    def timed() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        _sync(llm)
        return 1e3 * (time.perf_counter() - t0) / steps

    wall_ms = timed() if eager else None  # the profiler's host hooks would slow eager steps
    acts = [ProfilerActivity.CUDA] if llm.device.type == "cuda" else []
    if eager or not acts:
        acts.append(ProfilerActivity.CPU)
    with profile(activities=acts) as prof:
        profiled_ms = timed()
    while llm.engine.has_unfinished():
        llm.engine.step()
    kernels: dict[str, float] = collections.defaultdict(float)
    launches, host = 0, []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t and ev.device_type == torch.autograd.DeviceType.CUDA:  # GPU kernels only
            kernels[ev.key] += t / 1e3 / steps  # ms per step
            launches += ev.count
        elif ev.device_type == torch.autograd.DeviceType.CPU and ev.self_cpu_time_total:
            host.append((ev.key, ev.self_cpu_time_total / 1e3 / steps, ev.count / steps))
    by_cat: dict[str, float] = collections.defaultdict(float)
    for name, ms in kernels.items():
        by_cat[category(name)] += ms
    top = sorted(kernels.items(), key=lambda kv_: -kv_[1])[:20]
    out = {"concurrency": concurrency, "context": context, "steps": steps,
           "wall_ms_per_step": profiled_ms if wall_ms is None else wall_ms,
           "kernel_ms_per_step": sum(kernels.values()),
           "kernels_per_step": launches / steps,
           "by_category_ms": dict(sorted(by_cat.items(), key=lambda x: -x[1])),
           "top_kernels_ms": [{"name": n[:160], "ms": ms} for n, ms in top]}
    if eager:
        out["host_top_ms"] = [{"name": n[:160], "self_ms": ms, "calls": calls}
                              for n, ms, calls in sorted(host, key=lambda h: -h[1])[:20]]
    return out


def _prefilling(llm) -> bool:
    return any(r.num_computed_tokens < r.num_prompt_tokens for r in llm.scheduler.running) or \
        bool(llm.scheduler.waiting)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=CONFIGS / "llama-3.1-8b.json")
    ap.add_argument("--cells", nargs="+", default=["fp16:16:1024", "fp16:16:16384",
                                                   "fp8:16:16384"],
                    help="KV:CONCURRENCY:CONTEXT, KV one of kvcap.bench.throughput's modes "
                         "(fp16, fp8, fp8-software, fp8-mixed)")
    ap.add_argument("--steps", type=positive_int, default=20)
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[16, 64])
    ap.add_argument("--out", type=Path, default=Path("."),
                    help="a .json file, or a directory for step-profile-DATE.json (-2, -3, ... "
                         "when that exists: an earlier run is never overwritten)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"],
                    help="model dtype of the step cells")
    ap.add_argument("--eager", action="store_true",
                    help="steps without CUDA graphs: wall time unprofiled, then kernel launches "
                         "and the host operators' time per step")
    args = ap.parse_args(argv)
    from kvcap.bench.provenance import result_path, stamp
    from kvcap.bench.throughput import KV_MODES

    cells = []
    for cell in args.cells:  # all checked before any GPU time is spent
        kv, _, rest = cell.partition(":")
        c, _, ctx = rest.partition(":")
        if kv not in KV_MODES or not (c.isdigit() and ctx.isdigit() and int(c) and int(ctx)):
            ap.error(f"--cells {cell!r}: want KV:CONCURRENCY:CONTEXT with KV one of "
                     f"{', '.join(KV_MODES)} and both numbers >= 1")
        cells.append((kv, int(c), int(ctx)))
    require_cuda(ap)
    from kvcap.config import ModelSpec

    spec = ModelSpec.from_hf_config(json.loads(args.config.read_text()))
    ceil = measure_ceilings()
    report = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              **stamp(), "torch": torch.__version__, "config": args.config.name,
              "dtype": args.dtype, "read_ceiling_tbs": ceil["read_tbs"],
              "gemms": time_gemms(spec, args.rows, ceil["read_tbs"]), "cells": []}
    out = result_path(args.out, f"step-profile-{report['date']}")

    def save() -> None:
        atomic_write_text(out, json.dumps(report, indent=1))

    save()
    for kv, c, ctx in cells:
        report["cells"].append(profile_cell(args.config, kv, c, ctx, args.steps, args.dtype,
                                            args.eager))
        save()
    print(f"read ceiling {ceil['read_tbs']:.2f} TB/s")
    print(f"{'linear':14} {'m':>4} {'us':>8} {'TB/s':>6} {'%ceil':>6}")
    for g in report["gemms"]:
        print(f"{g['linear']:14} {g['m']:4d} {g['us']:8.1f} {g['tbs']:6.2f} "
              f"{g['pct_ceiling']:6.1f}")
    for c in report["cells"]:
        cats = ", ".join(f"{k} {v:.2f}" for k, v in c["by_category_ms"].items())
        print(f"{c['kv']} {c['concurrency']}x{c['context']}{' eager' if c['eager'] else ''}: "
              f"wall {c['wall_ms_per_step']:.2f} ms/step, kernels {c['kernel_ms_per_step']:.2f} "
              f"ms in {c['kernels_per_step']:.0f} launches ({cats})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
