"""Fused sampler benchmark: ``python -m kvcap.bench.sampler [--out DIR] [--sweep]``.

Correctness first (fused kernel vs the torch twin on every cell, plus mixed parameters and the
bisection fallback), then median CUDA-event timings of B {1, 8, 16, 64} x V {49,152; 151,936;
248,320} with top-k 20 + top-p 0.95 (temperature 1) for:
  * ``torch_sort``: a plain sort-based torch top-k/top-p + exponential-race sampler (the usual
    baseline, what DEVICE.md measured),
  * ``twin``: ``kvcap.sampling.reference.reference_sample`` (same semantics as the kernel),
  * ``fused``: the Triton kernel, eager and replayed from a CUDA graph, through each of its
    paths (``fused_one_*``: one launch, ``fused_two_*``: two launches); ``fused_ms`` and
    ``fused_graph_ms`` are the path ``fused_sample`` picks by default (``default_path``).
``--sweep`` also times, at V = 248,320, one vs two launches per batch size (to set
``ONE_LAUNCH_MAX_BATCH``: ``suggested_one_launch_max_batch``) and stage-1 chunk size / warps
variants of both paths.
Inputs rotate over enough copies to exceed the L2 cache. JSON goes to
``DIR/sampler-<date>.json`` (default docs/benchmarks; ``-2``, ``-3`` ... when taken) or to
the ``--out`` file named ``*.json``, with GPU, date and commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from kvcap.bench.provenance import result_path, stamp
from kvcap.kernels.sampling_topk_topp import (
    fused_sample,
    launch_config,
    one_launch_default,
    pack_params,
)
from kvcap.sampling.reference import keep_mask, reference_sample, scaled_logits
from kvcap.scales.fsutil import atomic_write_text

BATCHES = (1, 8, 16, 64)
VOCABS = (49_152, 151_936, 248_320)  # SmolLM2 / Qwen2.5 / Qwen3.5-class vocabularies
TOP_K, TOP_P = 20, 0.95
L2_BYTES = 60 << 20

Inputs = dict[str, torch.Tensor]


def make_inputs(b: int, v: int, k: int, p: float, mp: float, seed: int) -> Inputs:
    """Random LLM-like logits (a peaked head over noise) and per-row parameters on CUDA."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(b, v, device="cuda", generator=g) * 2.0
    x[:, :64] += torch.randn(b, 64, device="cuda", generator=g) * 4.0
    full = lambda val, dt=torch.float32: torch.full((b,), val, dtype=dt, device="cuda")  # noqa: E731
    filtered = k > 0 or p < 1.0 or mp > 0.0
    d = dict(
        logits=x, temperature=full(1.0), top_k=full(k, torch.int32), top_p=full(p),
        min_p=full(mp), mode=full(1 if filtered else 2, torch.int32),
        rng=torch.randint(-(2**31), 2**31, (b, 3), device="cuda", generator=g, dtype=torch.int32),
    )  # fmt: skip
    d["fparams"], d["iparams"] = pack_params(
        *(d[n] for n in ("temperature", "top_k", "top_p", "min_p", "rng", "mode"))
    )
    return d


def run_fused(d: Inputs, max_top_k: int = TOP_K, **kw: object) -> torch.Tensor:
    return fused_sample(d["logits"], d["fparams"], d["iparams"], max_top_k=max_top_k, **kw)


def run_engine(d: Inputs, max_top_k: int = TOP_K) -> torch.Tensor:
    """What the engine runs: kvcap.sampling.Sampler (with top-p rows in the batch, the kernel
    without its in-kernel fallback, and the sort-based twin on the rows it leaves, with a sync
    to find them; otherwise the kernel's own fallback)."""
    from kvcap.sampling.sampler import SamplingBatch

    batch = SamplingBatch(
        temperature=d["temperature"],
        top_k=d["top_k"],
        top_p=d["top_p"],
        min_p=d["min_p"],
        rng=d["rng"],
        mode=d["mode"],
        fparams=d["fparams"],
        iparams=d["iparams"],
        all_greedy=False,
        max_top_k=max_top_k,
        any_top_p=bool((d["top_p"] < 1.0).any()),
    )
    return _ENGINE_SAMPLER.sample(d["logits"], batch)


_ENGINE_SAMPLER = None  # built on first use (needs CUDA)


def run_twin(d: Inputs) -> torch.Tensor:
    return reference_sample(
        d["logits"], d["temperature"], d["top_k"], d["top_p"], d["min_p"], d["rng"]
    )


def run_torch_sort(d: Inputs) -> torch.Tensor:
    """Plain sort-based top-k, top-p, min-p masking and exponential-race sampling (torch ops)."""
    z = d["logits"] / d["temperature"].unsqueeze(1)
    zs, idx = z.sort(dim=-1, descending=False)
    v = z.shape[1]
    k = d["top_k"].long().unsqueeze(1)
    kth = zs.gather(1, (v - k).clamp(0, v - 1))
    zs = zs.masked_fill((k > 0) & (zs < kth), float("-inf"))
    cum = zs.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - d["top_p"].unsqueeze(1)
    drop[:, -1] = False
    zs = zs.masked_fill(drop, float("-inf"))
    probs = torch.empty_like(zs).scatter_(1, idx, zs).softmax(dim=-1)
    mp = d["min_p"].unsqueeze(1)
    probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def check(d: Inputs, max_top_k: int = TOP_K) -> dict[str, object]:
    """Fused (default path) vs twin on one input: token mismatches, mask mismatches (rows),
    path counts; and rows where the one- and two-launch paths differ (token, threshold, path)."""
    tok, thr, path = run_fused(d, max_top_k=max_top_k, return_aux=True)
    one, two = (run_fused(d, max_top_k=max_top_k, return_aux=True, one_launch=o)
                for o in (True, False))  # fmt: skip
    differ = torch.zeros_like(tok, dtype=torch.bool)
    for a, b in zip(one, two, strict=True):
        differ |= (a != b) & ~(torch.isnan(a.float()) & torch.isnan(b.float()))
    ref = run_twin(d)
    z = scaled_logits(d["logits"], d["temperature"])
    ref_keep = keep_mask(z, d["top_k"], d["top_p"], d["min_p"])
    m = z.max(1, keepdim=True).values
    keep = (z >= thr.unsqueeze(1)) & (torch.exp(z - m) >= d["min_p"].unsqueeze(1))
    return dict(
        token_mismatch=int((tok != ref).sum()),
        mask_mismatch_rows=int((keep != ref_keep).any(1).sum()),
        kept_mean=float(ref_keep.sum(1).float().mean()),
        fallback_rows=int(path.sum()),
        rows=int(tok.shape[0]),
        one_two_mismatch_rows=int(differ.sum()),
    )


def time_eager(fn: Callable[[Inputs], torch.Tensor], sets: list[Inputs], iters: int) -> float:
    """Median milliseconds of one call (CUDA events), rotating over input sets."""
    for d in sets[:3]:
        fn(d)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(sets[i % len(sets)])
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def time_graph(fn: Callable[[Inputs], torch.Tensor], sets: list[Inputs], iters: int) -> float:
    """Median milliseconds per call when one CUDA graph replays a call on every input set."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for d in sets:
            fn(d)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for d in sets:
            fn(d)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(5, iters // len(sets))):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times) / len(sets)


def input_sets(b: int, v: int, k: int, p: float, mp: float = 0.0) -> list[Inputs]:
    n = max(2, min(32, -(-L2_BYTES * 2 // (b * v * 4))))
    return [make_inputs(b, v, k, p, mp, seed=1000 * b + i) for i in range(n)]


def bench_cell(b: int, v: int, k: int, p: float, mp: float = 0.0) -> dict[str, object]:
    sets = input_sets(b, v, k, p, mp)
    row: dict[str, object] = dict(batch=b, vocab=v, top_k=k, top_p=p, min_p=mp)
    row["block"], row["cand"], row["num_warps"] = launch_config(b, v, k)
    row.update(check(sets[0], max_top_k=k))
    row["torch_sort_ms"] = time_eager(run_torch_sort, sets, 50)
    row["twin_ms"] = time_eager(run_twin, sets, 20)
    row["default_path"] = "one" if one_launch_default(b) else "two"
    for name, one in (("one", True), ("two", False)):
        fn = lambda d, o=one: run_fused(d, max_top_k=k, one_launch=o)  # noqa: E731
        row[f"fused_{name}_ms"] = time_eager(fn, sets, 200)
        row[f"fused_{name}_graph_ms"] = time_graph(fn, sets, 200)
    row["fused_ms"] = row[f"fused_{row['default_path']}_ms"]
    row["fused_graph_ms"] = row[f"fused_{row['default_path']}_graph_ms"]
    row["engine_ms"] = time_eager(lambda d: run_engine(d, max_top_k=k), sets, 100)
    row["torch_sort_graph_ms"] = time_graph(run_torch_sort, sets, 50)
    row["speedup_vs_torch_sort"] = row["torch_sort_ms"] / row["fused_ms"]
    row["speedup_vs_twin"] = row["twin_ms"] / row["fused_ms"]
    row["read_gbps"] = b * v * 4 / (row["fused_graph_ms"] * 1e6)
    return row


def sweep(v: int = 248_320) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """(launch rows, config rows): one vs two launches per batch size, eager and under graphs,
    at the default configuration; then stage-1 chunk size / warps variants of both paths on
    the headline shapes (graph-replay timing)."""
    launch, config = [], []
    for b in (1, 2, 4, 8, 16, 32, 64):
        sets = input_sets(b, v, TOP_K, TOP_P)
        r: dict[str, object] = dict(batch=b, vocab=v, default_path="two")
        if one_launch_default(b):
            r["default_path"] = "one"
        for name, one in (("one", True), ("two", False)):
            fn = lambda d, o=one: run_fused(d, one_launch=o)  # noqa: E731
            r[f"{name}_ms"] = time_eager(fn, sets, 200)
            r[f"{name}_graph_ms"] = time_graph(fn, sets, 100)
        launch.append(r)
        print(f"sweep B={b:3d} launches one/two: eager {r['one_ms'] * 1e3:7.1f}"
              f" {r['two_ms'] * 1e3:7.1f} us, graphs {r['one_graph_ms'] * 1e3:7.1f}"
              f" {r['two_graph_ms'] * 1e3:7.1f} us (default {r['default_path']})")  # fmt: skip
        if b not in (1, 16, 64):
            continue
        for block, warps in ((2048, 4), (4096, 8), (8192, 16)):
            for one in (True, False):
                fn = lambda d, bl=block, w=warps, o=one: run_fused(  # noqa: E731
                    d, block=bl, num_warps=w, one_launch=o
                )
                ms = time_graph(fn, sets, 100)
                config.append(dict(batch=b, vocab=v, block=block, num_warps=warps,
                                   one_launch=one, fused_graph_ms=ms))  # fmt: skip
                print(f"sweep B={b:3d} block={block:5d} warps={warps:2d}"
                      f" {'one' if one else 'two'}: {ms * 1e3:8.1f} us")  # fmt: skip
    return launch, config


def suggest_one_launch_max_batch(launch: list[dict[str, object]]) -> int:
    """Largest swept B up to which one launch is no slower than two, eager and under graphs
    (2% noise allowance); 0 when it loses already at the smallest B."""
    best = 0
    for r in sorted(launch, key=lambda r: r["batch"]):
        if r["one_ms"] > 1.02 * r["two_ms"] or r["one_graph_ms"] > 1.02 * r["two_graph_ms"]:
            break
        best = r["batch"]
    return best


def twin_cpu(out_dir: Path, repeats: int = 15) -> Path:
    """The sort-based twin on CPU (1 thread), full vs compact (``reference_sample(compact=)``,
    the CPU default), top-k 20 + top-p 0.95: equal tokens checked, median ms per call."""
    import platform
    import time

    torch.set_num_threads(1)
    rows = []
    for b, v in ((1, 49_152), (8, 49_152), (1, 151_936)):
        g = torch.Generator().manual_seed(b * v)
        x = torch.randn(b, v, generator=g) * 2.0
        x[:, :64] += torch.randn(b, 64, generator=g) * 4.0
        args = (x, torch.ones(b), torch.full((b,), TOP_K, dtype=torch.int32),
                torch.full((b,), TOP_P), torch.zeros(b),
                torch.randint(-(2**31), 2**31, (b, 3), generator=g, dtype=torch.int32))
        row: dict[str, object] = dict(batch=b, vocab=v)
        toks = {}
        for compact in (False, True):
            toks[compact] = reference_sample(*args, compact=compact)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                reference_sample(*args, compact=compact)
                times.append(time.perf_counter() - t0)
            row["compact_ms" if compact else "full_ms"] = 1e3 * statistics.median(times)
        row["tokens_equal"] = bool(torch.equal(toks[False], toks[True]))
        rows.append(row)
        print(f"B={b:2d} V={v:7d}: full {row['full_ms']:8.2f} ms, compact "
              f"{row['compact_ms']:7.2f} ms, tokens equal {row['tokens_equal']}")
    date = datetime.date.today().isoformat()
    result = dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                  threads=1, date=date, **stamp(), torch=torch.__version__,
                  timing=f"median of {repeats} calls (time.perf_counter)", rows=rows)
    out = result_path(out_dir, f"sampler-twin-cpu-{date}")
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/benchmarks",
                    help="a .json file, or a directory for sampler-DATE.json (-2, -3, ... when "
                         "that exists: an earlier run is never overwritten)")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also time one vs two launches per B and stage-1 variants",
    )
    ap.add_argument("--twin-cpu", action="store_true",
                    help="only the sort-based twin on CPU, full vs compact (no GPU needed)")
    args = ap.parse_args(argv)
    if args.twin_cpu:
        twin_cpu(Path(args.out))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("error: the sampler benchmark needs a CUDA GPU")
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = lambda it, **_: it  # noqa: E731
    extra = [  # correctness + timing of other parameter mixes (fallback path included)
        (16, 248_320, 0, 0.95, 0.0),
        (16, 248_320, 0, 1.0, 0.05),
        (16, 248_320, 0, 1.0, 0.0),
        (16, 248_320, 200, 0.9, 0.0),
    ]
    cells = [(b, v, TOP_K, TOP_P, 0.0) for v in VOCABS for b in BATCHES] + extra
    global _ENGINE_SAMPLER
    from kvcap.sampling.sampler import Sampler

    _ENGINE_SAMPLER = Sampler("cuda")
    rows = [bench_cell(*c) for c in tqdm(cells, desc="sampler bench")]
    launch_rows, sweep_rows = sweep() if args.sweep else ([], [])
    date = datetime.date.today().isoformat()
    result = dict(
        gpu=torch.cuda.get_device_name(), date=date, **stamp(),
        torch=torch.__version__, triton=__import__("triton").__version__,
        timing="median of CUDA-event timed calls; inputs rotated over > 2x L2",
        rows=rows, sweep=sweep_rows, launch_sweep=launch_rows,
    )  # fmt: skip
    if launch_rows:
        result["suggested_one_launch_max_batch"] = suggest_one_launch_max_batch(launch_rows)
    out = result_path(Path(args.out), f"sampler-{date}")
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    print(f"\n{result['gpu']}  commit {result['commit'][:10]}  -> {out}")
    print(" B       V    k     p min_p | tok mask   fb 1v2 | sort_ms engine_ms |"
          " eager one   two | graphs sort   one   two | path x sort x sort(graphs)")  # fmt: skip
    for r in rows:
        print(
            f"{r['batch']:2d} {r['vocab']:7d} {r['top_k']:4d} {r['top_p']:5.2f} {r['min_p']:5.2f}"
            f" | {r['token_mismatch']:3d} {r['mask_mismatch_rows']:4d} {r['fallback_rows']:4d}"
            f" {r['one_two_mismatch_rows']:3d} | {r['torch_sort_ms']:7.3f} {r['engine_ms']:9.3f}"
            f" | {r['fused_one_ms']:9.3f} {r['fused_two_ms']:5.3f} |"
            f" {r['torch_sort_graph_ms']:11.3f} {r['fused_one_graph_ms']:5.3f}"
            f" {r['fused_two_graph_ms']:5.3f} | {r['default_path']:>4}"
            f" {r['speedup_vs_torch_sort']:6.1f}"
            f" {r['torch_sort_graph_ms'] / r['fused_graph_ms']:14.1f}"
        )
    if launch_rows:
        print(f"suggested ONE_LAUNCH_MAX_BATCH: {result['suggested_one_launch_max_batch']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
