"""Kernel benchmark: correctness checks, then paged decode timings vs torch SDPA.

    python -m kvcap.bench.kernels [--out docs/benchmarks/kernels-DATE.json] [--sweep]
        [--sweep-only] [--batches 1,4,8,16,64] [--contexts 1024,...] [--shapes a,b]
    python -m kvcap.bench.kernels --markdown docs/benchmarks/kernels-DATE.json   # doc tables

1. Checks on fresh random data: store_kv bytes == e4m3.encode; decode (every route) and mixed
   prefill+decode against the torch reference backend.
2. Measures a read ceiling (a streaming-read Triton kernel over a 4 GiB buffer) and a
   device-to-device copy.
3. Times decode over batch x context x model shape for FP16 paged, E4M3 native and E4M3
   software, and torch SDPA (FP16, contiguous KV, enable_gqa) on the same data. Each timing
   replays a CUDA graph of calls over R distinct KV sets (R x bytes > 4 x L2), at least 8 calls
   (the sets repeated) so the replay's own ~10 us is amortized, and takes the median over
   replays. Prints ms, KV-read TB/s, % of the read ceiling and speedup vs SDPA,
   then writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from kvcap.bench.provenance import result_path, stamp
from kvcap.bench.telemetry import sm_clock_mhz
from kvcap.bench.throughput_targets import json_number
from kvcap.commands.common import block_size, list_type, positive_int, positive_int_list
from kvcap.kernels.common import sm_count, use_software_fp8
from kvcap.kernels.decode import choose_num_splits, default_launch, paged_decode
from kvcap.scales.fsutil import atomic_write_text

logger = logging.getLogger(__name__)

# (name, Hq, Hkv, D): real model configurations
SHAPES = [("llama31-8b", 32, 8, 128), ("gqa6-d256", 24, 4, 256), ("smollm2-135m", 9, 3, 64)]
BATCHES = [1, 4, 8, 16, 64]
CONTEXTS = [1024, 4096, 16384, 32768, 131072]
ARMS = ["sdpa_fp16", "paged_fp16", "e4m3_native", "e4m3_software"]
BLOCK_SIZE = 16
CONTIGUOUS_TABLES = False  # --contiguous-tables
# --dtype: queries, SDPA tensors and the unquantized paged cache (the "_fp16" arms hold this
# 16-bit dtype; the JSON's info.dtype says which)
DTYPE = torch.float16
# A cell's peak device memory over its FP16 KV bytes: the SDPA tensors (1x), the paged FP16
# pool (1x), the E4M3 pool (0.5x) and, while the pools fill, two 0.5x copies of K or V (the
# padded tensor and its block-major reshape), plus the codec's int64 temporaries for one
# sequence; a cell is skipped, with the figures, when that is over FREE_MEMORY_SHARE of what
# is free (was a fixed 20 GiB of FP16 KV, which skipped 64 x 128K of the 8B shape even on an
# H200, where it fits).
PEAK_PER_FP16_BYTE = 3.5
FREE_MEMORY_SHARE = 0.9
MIN_GRAPH_CALLS = 8  # _graph_time: calls per timed graph (amortizes the replay's own cost)


def _graph_time(fns: list, target_ms: float = 40.0, reps: int | None = None,
                warmup_ms: float = 50.0, min_calls: int | None = None,
                clocks: list | None = None) -> float:
    """Median ms per call of a CUDA graph that runs the fns in order, the list repeated until
    the graph holds at least `min_calls` calls, after `warmup_ms` of replays.

    Why several calls: one replay costs about 10 us more than its kernels (H200, 2026-12-01,
    scripts/decode_fixed_cost.py: a zero-token decode and a lone merge kernel both measured
    10.8-11.2 us per replay), which a graph of one call -- every cell whose KV set alone
    exceeds 4 x L2 -- charged to the kernel: 13% of an 80 us decode, unequally across arms of
    different speed. Back to back in one graph, as in a model step, calls pay only the gap
    between kernels. A cell's R KV sets together exceed 4 x L2 (Cell.r), so a set has left
    L2 before it comes round again.

    The warm-up matters: on the H200 the first ~10 replays after a pause (building the next
    cell's data on the host) ran ~5% slower than the same graph later (2026-12-01 occupancy
    sweep: the default launch timed first at 182 us, again later at 174 us), which biased
    whichever arm a cell timed first.

    `clocks`: the SM clock (sm_clock_mhz) read while the middle replay runs is appended."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    fns = fns * math.ceil((min_calls or MIN_GRAPH_CALLS) / len(fns))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    g.replay()
    e.record()
    torch.cuda.synchronize()
    one = max(s.elapsed_time(e), 1e-3)
    for _ in range(min(1000, int(warmup_ms / one))):
        g.replay()
    n = reps or max(5, min(200, int(target_ms / one)))
    times = []
    for i in range(n):
        s.record()
        g.replay()
        e.record()
        if clocks is not None and i == n // 2:
            clocks.append(sm_clock_mhz())
        e.synchronize()
        times.append(s.elapsed_time(e))
    del g
    return statistics.median(times) / len(fns)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(x_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def _ceilings() -> dict:
    n_bytes = 4 * 2**30
    x = torch.randint(-2**31, 2**31 - 1, (n_bytes // 4,), dtype=torch.int32, device="cuda")
    best = 0.0
    for block, iters, warps in ((4096, 8, 8), (8192, 4, 8), (2048, 16, 4), (4096, 16, 8)):
        grid = triton.cdiv(x.numel(), block * iters)
        out = torch.empty(grid, dtype=torch.int32, device="cuda")
        fn = functools.partial(_read_kernel[(grid,)], x, out, x.numel(), BLOCK=block,
                               ITERS=iters, num_warps=warps)
        ms = _graph_time([fn], reps=20)
        best = max(best, n_bytes / ms / 1e9)  # bytes per ms / 1e9 = TB/s
    half = x[: x.numel() // 2]
    dst = torch.empty_like(half)
    ms = _graph_time([functools.partial(dst.copy_, half)], reps=20)
    copy = 2 * half.numel() * 4 / ms / 1e9
    return {"read_tbs": best, "copy_rw_tbs": copy}


def measure_ceilings() -> dict:
    res = _ceilings()
    torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------- checks
def run_checks() -> list[str]:
    """Fresh random data through every kernel route vs the torch reference backend."""
    from kvcap.attention.metadata import AttentionMetadata
    from kvcap.attention.torch_ref import TorchReferenceBackend
    from kvcap.attention.triton_backend import TritonBackend
    from kvcap.kernels.store_kv import store_kv
    from kvcap.kv_cache.pool import LayerKVCache
    from kvcap.numerics import e4m3

    lines = []
    x = torch.randn(4096, 4, 128, device="cuda") * 20
    kc = torch.zeros(256, 4, 16, 128, dtype=torch.uint8, device="cuda")
    vc = torch.zeros_like(kc)
    slots = torch.randperm(4096, device="cuda")
    s = torch.tensor(0.0371, device="cuda")
    store_kv(x, x, kc, vc, slots, s, s)
    ok = torch.equal(kc[slots // 16, :, slots % 16], e4m3.encode(x, s))
    lines.append(f"store_kv e4m3 bytes == encode: {ok}")
    if not ok:
        raise SystemExit("store_kv mismatch")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, hq, hkv, d in SHAPES:
        for kv, mode in (("fp16", "auto"), ("bf16", "auto"), ("fp8_e4m3", "native"),
                         ("fp8_e4m3", "software")):
            dtype = torch.bfloat16 if kv == "bf16" else torch.float16
            qlens = [1, 1, 300, 1, 37, 1]
            ctxs = [3000, 17, 500, 9000, 0, 1]
            seq = [c + n for c, n in zip(ctxs, qlens, strict=True)]
            nblk = [math.ceil(x / BLOCK_SIZE) for x in seq]
            perm = torch.randperm(sum(nblk) + 7).tolist()
            tables, p = [], 0
            for nb in nblk:
                tables.append(perm[p: p + nb])
                p += nb
            meta = AttentionMetadata.build(qlens, seq, tables, BLOCK_SIZE,
                                           torch.device("cuda"), sum(qlens) + 2)
            t = sum(qlens) + 2
            store = torch.uint8 if kv == "fp8_e4m3" else dtype
            shape = (sum(nblk) + 7, hkv, BLOCK_SIZE, d)
            ks = torch.tensor(0.0371, device="cuda") if kv == "fp8_e4m3" else None
            vs = torch.tensor(0.0129, device="cuda") if kv == "fp8_e4m3" else None
            ctx_k = torch.randn(shape, generator=g, device="cuda") * 3
            ctx_v = torch.randn(shape, generator=g, device="cuda")
            if kv == "fp8_e4m3":
                ctx_k, ctx_v = e4m3.encode(ctx_k, ks), e4m3.encode(ctx_v, vs)
            caches = []
            for _ in range(2):
                caches.append(LayerKVCache(0, ctx_k.to(store).clone(), ctx_v.to(store).clone(),
                                           kv, ks, vs))
            q = torch.randn(t, hq, d, generator=g, device="cuda").to(dtype)
            k = (torch.randn(t, hkv, d, generator=g, device="cuda") * 3).to(dtype)
            v = torch.randn(t, hkv, d, generator=g, device="cuda").to(dtype)
            ref = torch.full_like(q, 7.0)
            got = torch.full_like(q, 7.0)
            sc = 1 / math.sqrt(d)
            TorchReferenceBackend().forward(q, k, v, caches[0], meta, sc, ref)
            TritonBackend(mode).forward(q, k, v, caches[1], meta, sc, got)
            n = meta.num_tokens
            err = ((got[:n].double() - ref[:n].double()).norm() / ref[:n].double().norm())
            pad_ok = bool((got[n:] == 7.0).all())
            tol = 2e-2 if kv == "bf16" else 5e-3
            status = "ok" if err < tol and pad_ok and torch.isfinite(got).all() else "FAIL"
            lines.append(f"check {name:13s} {kv:8s} {mode:8s} mixed prefill+decode "
                         f"rel_err={err:.2e} padding_untouched={pad_ok} {status}")
            if status != "ok":
                raise SystemExit("\n".join(lines))
    return lines


# ----------------------------------------------------------------------------- timing
class Cell:
    """R rotations of one (shape, B, ctx): SDPA tensors, a paged FP16 and an E4M3 pool."""

    def __init__(self, hq: int, hkv: int, d: int, b: int, ctx: int, l2_bytes: int):
        from kvcap.numerics import e4m3

        self.hq, self.hkv, self.d, self.b, self.ctx = hq, hkv, d, b, ctx
        fp8_bytes = b * ctx * hkv * d * 2
        self.r = max(1, min(64, math.ceil(4 * l2_bytes / fp8_bytes)))
        r = self.r
        nblk = math.ceil(ctx / BLOCK_SIZE)
        g = torch.Generator(device="cuda").manual_seed(b * 7 + ctx)
        self.q = [torch.randn(b, hq, d, generator=g, device="cuda", dtype=DTYPE)
                  for _ in range(r)]
        self.sk = [torch.randn(b, hkv, ctx, d, generator=g, device="cuda",
                               dtype=DTYPE) * 2 for _ in range(r)]
        self.sv = [torch.randn(b, hkv, ctx, d, generator=g, device="cuda", dtype=DTYPE)
                   for _ in range(r)]
        total = r * b * nblk
        # Random block order (a pool fragmented by a long-running server) unless
        # CONTIGUOUS_TABLES (a fresh pool, as in an end-to-end benchmark's first requests).
        perm = (torch.arange(total, device="cuda") if CONTIGUOUS_TABLES
                else torch.randperm(total, device="cuda"))
        self.tables = perm.view(r, b, nblk).to(torch.int32)
        pool_shape = (total, hkv, BLOCK_SIZE, d)
        self.k16 = torch.empty(pool_shape, dtype=DTYPE, device="cuda")
        self.v16 = torch.empty_like(self.k16)
        self.k8 = torch.empty(pool_shape, dtype=torch.uint8, device="cuda")
        self.v8 = torch.empty_like(self.k8)
        amax_k = max(float(x.abs().max()) for x in self.sk)
        amax_v = max(float(x.abs().max()) for x in self.sv)
        self.ks = torch.tensor(amax_k / 448 * 1.001, device="cuda")
        self.vs = torch.tensor(amax_v / 448 * 1.001, device="cuda")
        pad = nblk * BLOCK_SIZE - ctx
        for i in range(r):
            for src, d16, d8, sc in ((self.sk[i], self.k16, self.k8, self.ks),
                                     (self.sv[i], self.v16, self.v8, self.vs)):
                x = torch.nn.functional.pad(src, (0, 0, 0, pad))
                x = x.view(b, hkv, nblk, BLOCK_SIZE, d).permute(0, 2, 1, 3, 4)
                x = x.reshape(b * nblk, hkv, BLOCK_SIZE, d)
                idx = self.tables[i].reshape(-1).long()
                d16[idx] = x
                per = nblk  # encode one sequence at a time (the codec's temporaries are int64)
                for j in range(b):
                    d8[idx[j * per: (j + 1) * per]] = e4m3.encode(x[j * per: (j + 1) * per], sc)
        self.seq_lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        self.qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda")
        self.out = [torch.empty(b, hq, d, dtype=DTYPE, device="cuda") for _ in range(r)]

    def fns(self, arm: str, fp8_mode: str | None = None, **kw) -> list:
        """One decode call per KV set; `fp8_mode` overrides the arm's E4M3 decoder."""
        sc = 1 / math.sqrt(self.d)
        f = []
        for i in range(self.r):
            if arm == "sdpa_fp16":
                q4 = self.q[i].unsqueeze(2)
                # SDPA returns its output (no copy into self.out: that would time a second
                # kernel per call); every fn returns the call's output
                f.append(lambda q4=q4, i=i: torch.nn.functional.scaled_dot_product_attention(
                    q4, self.sk[i], self.sv[i], scale=sc, enable_gqa=True).squeeze(2))
            else:
                fp8 = arm.startswith("e4m3")
                kc, vc = (self.k8, self.v8) if fp8 else (self.k16, self.v16)
                mode = fp8_mode or ("software" if arm == "e4m3_software" else "auto")
                f.append(lambda i=i, kc=kc, vc=vc, fp8=fp8, mode=mode: paged_decode(
                    self.q[i], kc, vc, self.out[i], self.tables[i], self.seq_lens, self.qsl,
                    sc, self.ctx, self.ks if fp8 else None, self.vs if fp8 else None,
                    fp8_mode=mode, **kw))
        return f

    def kv_bytes(self, arm: str) -> int:
        per = 1 if arm.startswith("e4m3") else 2
        return self.b * self.ctx * self.hkv * self.d * 2 * per


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def time_cell(cell: Cell, arms: list[str], rounds: int = 1, clocks: dict | None = None,
              **kw) -> tuple[dict, dict, dict]:
    """(median ms per arm, each arm's output, each arm's ms per round); `clocks` (a dict)
    gets each arm's SM clock per round (sm_clock_mhz, during the timing). With rounds > 1 the
    arms are timed again in reversed order, then forward, ...: on the H200 one E4M3 decode
    launch's five rounds spread 3-26% (docs/kernels.md, "Seventeenth change"), so a
    difference between arms under the rounds' spread is noise."""
    per_round: dict[str, list[float]] = {arm: [] for arm in arms}
    outs = {}
    for i in range(rounds):
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            fns = cell.fns(arm, **kw)
            arm_clocks = None if clocks is None else clocks.setdefault(arm, [])
            per_round[arm].append(_graph_time(fns, clocks=arm_clocks))
            if arm not in outs:
                outs[arm] = fns[0]().clone()
    return {arm: statistics.median(v) for arm, v in per_round.items()}, outs, per_round


def run_info() -> dict:
    """What every GPU benchmark JSON records about its run (GPU 0, versions, commit)."""
    props = torch.cuda.get_device_properties(0)
    return {"date": datetime.date.today().isoformat(), "gpu": props.name,
            "sm_count": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", 50 * 2**20),
            "torch": torch.__version__, "triton": triton.__version__,
            # what the "native" arm (fp8_mode auto) decoded with, and the rollback/launch
            # switches in force: under KVCAP_FORCE_SOFTWARE_FP8=1 or before SM89 both E4M3
            # arms run the software decoder, and "software within 1.15x" holds trivially
            "native_arm_decoder": ("software" if use_software_fp8(torch.device("cuda", 0))
                                   else "native"),
            # (no secret -- KVCAP_API_KEY, `kvcap serve`'s, or any *KEY* / *TOKEN* /
            # *SECRET* / *PASSWORD* name: these files are committed and --summary prints them
            # -- nor KVCAP_CACHE, a local path)
            "switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVCAP_")
                         and k not in ("KVCAP_COMMIT", "KVCAP_CACHE")
                         and not any(w in k for w in ("KEY", "TOKEN", "SECRET", "PASSWORD"))},
            **stamp()}


def source_caveats(info: dict) -> str:
    """What --summary adds to a file's line: the decoder its "native" arm really ran (when
    not native) and the KVCAP_* switches it ran under (files before 2026-12-07 record neither)."""
    out = ""
    if info.get("native_arm_decoder") == "software":
        out += "; its native arm ran the software decoder (left out of the verdicts)"
    switches = info.get("switches")
    if isinstance(switches, dict) and switches:
        out += "; switches " + " ".join(f"{k}={v}" for k, v in switches.items())
    return out


def judged_cells(cells: list[dict], info: dict) -> list[dict]:
    """A file's cells as --summary judges them: without the "native" arm where the file says
    it ran the software decoder (its times would pass "software within 1.15x" trivially)."""
    if info.get("native_arm_decoder") != "software":
        return cells
    return [{k: v for k, v in r.items() if k != "e4m3_native"} for r in cells]


def main(argv: list[str] | None = None) -> int:
    global BLOCK_SIZE, CONTIGUOUS_TABLES, DTYPE, MIN_GRAPH_CALLS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None,
                    help="a .json file, or a directory for kernels.json (-2, -3, ... when that "
                         "exists: an earlier run is never overwritten); default $OUT or .")
    ap.add_argument("--batches", type=positive_int_list, default=",".join(map(str, BATCHES)))
    ap.add_argument("--contexts", type=positive_int_list, default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--shapes", type=parse_names([s[0] for s in SHAPES]),
                    default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also sweep decode launch configs")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--sweep-only", action="store_true", help="skip the decode matrix")
    ap.add_argument("--compare-words", action="store_true",
                    help="time the E4M3 byte and word routes on the sweep cells, then stop")
    ap.add_argument("--compare-pairs", action="store_true",
                    help="time the E4M3 word route with and without byte-pair conversion on "
                         "the 8B cells, then stop")
    ap.add_argument("--compare-fold", action="store_true",
                    help="time decode with the split-K merge in a second launch and folded into "
                         "the decode kernel, every cache dtype, on the split cells, then stop")
    ap.add_argument("--compare-prewait", action="store_true",
                    help="time decode with and without the first tile's L2 prefetch ahead of "
                         "the dependent-launch wait (paged_decode prewait), every cache dtype, "
                         "on the split cells (<= 16 sequences: dependent launches on), then stop")
    ap.add_argument("--grid", action="store_true",
                    help="--compare-fold / --compare-prewait / --compare-pairs / --compare-bf16 / "
                         "--sweep-occupancy time the cells of --shapes x --batches x --contexts "
                         "instead of their own")
    ap.add_argument("--compare-decoders", action="store_true",
                    help="time every E4M3 decoder pairing (K/V native/software) on the sweep "
                         "cells, then stop")
    ap.add_argument("--sweep-occupancy", action="store_true",
                    help="time launch configurations, register caps and split counts of the "
                         "E4M3 default route on the target cells, then stop")
    ap.add_argument("--occupancy-configs", type=parse_configs, default=OCCUPANCY_CONFIGS,
                    help="BN:WARPS:STAGES:MAXNREG,... for --sweep-occupancy")
    ap.add_argument("--occupancy-arms", type=parse_names(ARMS[1:]),
                    default="e4m3_native,e4m3_software",
                    help="arms --sweep-occupancy times (paged_fp16, e4m3_native, e4m3_software)")
    ap.add_argument("--occupancy-words", action="store_true",
                    help="--sweep-occupancy times the E4M3 word route with byte pairs (the "
                         "D = 128 default) whatever the head size")
    ap.add_argument("--occupancy-waves", action="store_true",
                    help="--sweep-occupancy times the split counts that fill whole waves of "
                         "2..8 programs per SM (default: 0.5/1/2x the old heuristic)")
    ap.add_argument("--occupancy-splits", type=parse_splits, default=None, metavar="S,S,...",
                    help="--sweep-occupancy times exactly these split counts, on the cells of "
                         "--shapes x --batches x --contexts instead of its own cells")
    ap.add_argument("--block-size", type=block_size, default=BLOCK_SIZE,
                    help="tokens per KV cache block, a power of two (default 16, the engine's)")
    ap.add_argument("--contiguous-tables", action="store_true",
                    help="every sequence's KV blocks in order (default: a random permutation)")
    ap.add_argument("--rounds", type=positive_int, default=2,
                    help="time every arm of a matrix cell this many times, alternating the "
                         "arms' order; cells report the median and the spread (max/min - 1)")
    ap.add_argument("--min-graph-calls", type=positive_int, default=MIN_GRAPH_CALLS,
                    help="calls per timed CUDA graph (1: the protocol before 2026-12-01's "
                    "second session, which charged a replay's ~10 us to one call)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"],
                    help="query / SDPA / unquantized-cache dtype (the \"_fp16\" arms)")
    ap.add_argument("--compare-bf16", action="store_true",
                    help="BF16 queries over E4M3: time BF16 dots (each decoded FP16 value "
                         "converted) against FP16 dots (paged_decode fp16_dots, the default) on "
                         "the target cells, then stop")
    ap.add_argument("--markdown", metavar="JSON",
                    help="print the per-shape tables of docs/kernels.md from a result file")
    ap.add_argument("--summary", metavar="JSON", nargs="+",
                    help="print issue 5's target verdicts and the target cells from result "
                         "files (their cells together), then stop")
    args = ap.parse_args(argv)
    if args.markdown:
        try:
            text = markdown_tables(read_result(args.markdown))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            print(f"error: {args.markdown} is not a readable kvcap.bench.kernels result ({e})",
                  file=sys.stderr)
            return 2
        from kvcap.bench.throughput_report import print_report

        print_report(text)  # (`... --markdown FILE | head` was a BrokenPipeError traceback)
        return 0
    if args.summary:
        rows, sources = [], []
        # files of two GPUs were judged as one set: a later H100 file's cells replaced an
        # H200 run's (an H200 verdict of "met in 1 of 8" read "7 of 8" with the H100 file
        # after it, no cell saying its GPU). With more than one GPU named, each GPU's files
        # are judged apart (files naming none with the others when at most one is named).
        by_gpu: dict = {}
        for name in args.summary:
            try:
                result = read_result(name)
                info = result.get("info") or {}
                cells = judged_cells(result["cells"], info)
                rows += cells
                # the issue's targets are the H200's, against FP16: each file says its own
                sources.append(f"{Path(name).name}: {info.get('gpu', 'unknown GPU')}, "
                               f"16-bit arms {info.get('dtype', 'float16')}, "
                               f"commit {info.get('commit', 'unknown')}"
                               + source_caveats(info))
                group = by_gpu.setdefault(info.get("gpu"), ([], []))
                group[0].extend(cells)
                group[1].append(sources[-1])
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                print(f"error: {name} is not a readable kvcap.bench.kernels result ({e})",
                      file=sys.stderr)
                return 2
        try:
            if len([gpu for gpu in by_gpu if gpu is not None]) > 1:
                for gpu, (gpu_rows, gpu_sources) in by_gpu.items():
                    print(f"\n== {gpu or 'unknown GPU'} (each GPU's files judged apart)")
                    print_summary(gpu_rows, gpu_sources)
            else:
                print_summary(rows, sources)
            sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        except BrokenPipeError:  # e.g. `... --summary FILE | head`: the reader left, no traceback
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    cells_error = own_cells_error(args)
    if cells_error:
        ap.error(cells_error)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.block_size < 16:
        ap.error(f"--block-size must be >= 16 (the kernels' smallest block), got "
                 f"{args.block_size}")
    # --out before any GPU work: it was resolved (result_path's mkdir) after the checks and
    # the read ceiling had run, and a path under an existing file was then a traceback
    out_arg = args.out or os.environ.get("OUT", ".")
    try:
        out = result_path(Path(out_arg), "kernels")
    except OSError as e:
        ap.error(f"argument --out: cannot create {out_arg} ({e.filename}: {e.strerror or e})")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        ap.error(f"argument --out: cannot write into {out.parent}")
    BLOCK_SIZE = args.block_size
    CONTIGUOUS_TABLES = args.contiguous_tables
    MIN_GRAPH_CALLS = args.min_graph_calls
    DTYPE = torch.bfloat16 if args.dtype == "bfloat16" or args.compare_bf16 else torch.float16
    info = run_info()
    info["contiguous_tables"] = CONTIGUOUS_TABLES
    info["dtype"] = str(DTYPE).removeprefix("torch.")
    l2 = info["l2_bytes"]
    info["block_size"] = BLOCK_SIZE
    info["min_graph_calls"] = MIN_GRAPH_CALLS
    checks = [] if args.skip_checks else run_checks()
    for line in checks:
        print(line, flush=True)
    ceil = measure_ceilings()
    print(f"read ceiling {ceil['read_tbs']:.2f} TB/s, D2D copy {ceil['copy_rw_tbs']:.2f} TB/s",
          flush=True)
    shapes = [s for s in SHAPES if s[0] in args.shapes]
    batches, contexts = args.batches, args.contexts
    grid = [(name, hq, hkv, d, b, ctx) for name, hq, hkv, d in shapes
            for b in batches for ctx in contexts] if args.grid else None
    sweep: list[dict] = []
    rows: list[dict] = []

    def save() -> None:
        result = {"info": info, "ceilings": ceil, "checks": checks, "sweep": sweep,
                  "cells": rows}
        atomic_write_text(out, json.dumps(result, indent=1))

    if args.compare_words:
        info["compare_words"] = compare_knob(l2, ceil["read_tbs"], "words", WORD_CELLS,
                                             rounds=args.rounds)
        save()
        return 0
    if args.compare_pairs:
        info["compare_pairs"] = compare_knob(l2, ceil["read_tbs"], "pairs",
                                             grid or WORD_CELLS[:2] + [WORD_CELLS[4]],
                                             rounds=args.rounds)
        save()
        return 0
    if args.compare_bf16:
        info["compare_bf16"] = compare_knob(l2, ceil["read_tbs"], "fp16_dots",
                                            grid or FOLD_CELLS[:3] + [WORD_CELLS[1]]
                                            + WORD_CELLS[2:4], rounds=args.rounds)
        save()
        return 0
    if args.compare_fold:
        info["compare_fold"] = compare_knob(l2, ceil["read_tbs"], "fold", grid or FOLD_CELLS,
                                            ("paged_fp16", "e4m3_native", "e4m3_software"),
                                            rounds=args.rounds)
        save()
        return 0
    if args.compare_prewait:
        info["compare_prewait"] = compare_knob(l2, ceil["read_tbs"], "prewait",
                                               grid or FOLD_CELLS,
                                               ("paged_fp16", "e4m3_native", "e4m3_software"),
                                               rounds=args.rounds)
        save()
        return 0
    if args.sweep_occupancy:
        info["sweep_occupancy"] = []
        cells = [c for c in OCCUPANCY_CELLS if c[0] in args.shapes]
        splits = args.occupancy_splits
        if splits or args.grid:
            cells = [(name, hq, hkv, d, b, ctx) for name, hq, hkv, d in shapes
                     for b in batches for ctx in contexts]
        sweep_occupancy(l2, ceil["read_tbs"], info["sweep_occupancy"], save,
                        arms=tuple(args.occupancy_arms), waves=args.occupancy_waves,
                        configs=args.occupancy_configs, cells=cells, splits=splits,
                        route=dict(words=True, pairs=True) if args.occupancy_words else None)
        return 0
    if args.compare_decoders:
        info["compare_decoders"] = compare_decoders(l2, ceil["read_tbs"])
        save()
        return 0
    if args.sweep or args.sweep_only:
        run_sweep(l2, sweep, save)
    if args.sweep_only:
        shapes = []
    save()
    for name, hq, hkv, d in shapes:
        for b in batches:
            for ctx in contexts:
                why = cell_does_not_fit(b, ctx, hkv, d, torch.cuda.mem_get_info()[0])
                if why is None:
                    try:
                        cell = Cell(hq, hkv, d, b, ctx, l2)
                        clocks: dict[str, list] = {}
                        ms, outs, per_round = time_cell(cell, ARMS, args.rounds, clocks)
                    except torch.OutOfMemoryError as e:  # (an arm's own workspace, e.g. SDPA's)
                        why = f"out of memory: {str(e).splitlines()[0]}"
                        cell = outs = None
                if why is not None:
                    torch.cuda.empty_cache()
                    rows.append({"shape": name, "batch": b, "context": ctx, "skipped": why})
                    print(f"{name} B={b} ctx={ctx}: skipped ({why})", flush=True)
                    save()
                    continue
                dev = cell.q[0].device
                splits = default_launch(b, hkv, ctx, d, True, dev)[2]
                splits16 = default_launch(b, hkv, ctx, d, False, dev)[2]
                row = {"shape": name, "hq": hq, "hkv": hkv, "head_dim": d, "batch": b,
                       "context": ctx, "rotations": cell.r, "splits": splits,
                       "splits_fp16": splits16,
                       "err_fp16_vs_sdpa": _rel(outs["paged_fp16"], outs["sdpa_fp16"]),
                       "err_e4m3_vs_sdpa": _rel(outs["e4m3_native"], outs["sdpa_fp16"]),
                       "err_sw_vs_native": _rel(outs["e4m3_software"], outs["e4m3_native"])}
                for arm in ARMS:
                    tbs = cell.kv_bytes(arm) / (ms[arm] * 1e-3) / 1e12
                    row[arm] = {"ms": ms[arm], "tbs": tbs,
                                "pct_ceiling": 100 * tbs / ceil["read_tbs"],
                                "speedup_vs_sdpa": ms["sdpa_fp16"] / ms[arm],
                                "ms_rounds": per_round[arm],
                                "sm_mhz_rounds": clocks[arm],
                                "spread": max(per_round[arm]) / min(per_round[arm]) - 1}
                rows.append(row)
                print(_fmt(row), flush=True)
                save()
                del cell
                torch.cuda.empty_cache()
    save()
    # judged as `--summary FILE` judges the file: a "native" arm that ran the software decoder
    # (KVCAP_FORCE_SOFTWARE_FP8=1, a GPU before SM89) was judged native here, "software within
    # 1.15x of native" then met by two timings of one decoder
    print_summary(judged_cells(rows, info),
                  [f"{out.name}: {info.get('gpu', 'unknown GPU')}, 16-bit arms {info['dtype']}, "
                   f"commit {info.get('commit', 'unknown')}" + source_caveats(info)])
    print(f"wrote {out}")
    return 0


def read_result(name: str) -> dict:
    """A result file of this benchmark, its cells checked: a list of objects with a shape, a
    batch and a context (the cells of other benchmarks' JSONs -- qsa, verify_cost -- have no
    shape). OSError, ValueError or TypeError otherwise."""
    with open(name) as fh:
        result = json.load(fh)
    cells = result.get("cells") if isinstance(result, dict) else None
    if not isinstance(cells, list) or not all(
            isinstance(r, dict) and isinstance(r.get("shape"), str)
            and isinstance(r.get("batch"), int) and isinstance(r.get("context"), int)
            for r in cells):
        raise TypeError("'cells' is not a list of cells with shape, batch and context")
    return result


def cell_does_not_fit(b: int, ctx: int, hkv: int, d: int, free_bytes: int) -> str | None:
    """Why a cell cannot be allocated in `free_bytes` of device memory (None: it fits)."""
    fp16_bytes = b * ctx * hkv * d * 4
    peak = PEAK_PER_FP16_BYTE * fp16_bytes + ctx * hkv * d * 8  # + one sequence's codec
    if peak <= FREE_MEMORY_SHARE * free_bytes:
        return None
    return (f"needs ~{peak / 2**30:.0f} GiB ({fp16_bytes / 2**30:.0f} GiB of FP16 KV), "
            f"{free_bytes / 2**30:.0f} GiB free")


def _ctx(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def markdown_tables(result: dict) -> str:
    """The per-shape decode tables of docs/kernels.md, from a benchmark JSON."""
    out = []
    shapes = dict.fromkeys(r["shape"] for r in result["cells"])
    # the "_fp16" arms ran in the file's --dtype: a BF16 run's tables were headed "FP16 paged"
    dtype = (result.get("info") or {}).get("dtype", "float16")
    kv16 = {"float16": "FP16", "bfloat16": "BF16"}.get(dtype, dtype)
    for shape in shapes:
        out += [f"#### {shape}", "",
                f"| B | ctx | splits E4M3/{kv16} | SDPA µs | {kv16} paged µs (x SDPA) | "
                "E4M3 native µs (x SDPA, % ceil) | E4M3 software µs (x SDPA, % ceil) |",
                "|---|---|---|---|---|---|---|"]
        for r in result["cells"]:
            if r["shape"] != shape:
                continue
            head = f"| {r['batch']} | {_ctx(r['context'])} |"
            if "skipped" in r:
                out.append(f"{head} skipped: {r['skipped']} | | | | |")
                continue
            cols = [f"{r['splits']}/{r['splits_fp16']}", f"{r['sdpa_fp16']['ms'] * 1e3:.1f}",
                    f"{r['paged_fp16']['ms'] * 1e3:.1f} "
                    f"({r['paged_fp16']['speedup_vs_sdpa']:.2f})"]
            for arm in ("e4m3_native", "e4m3_software"):
                c = r[arm]
                cols.append(f"{c['ms'] * 1e3:.1f} ({c['speedup_vs_sdpa']:.2f}, "
                            f"{c['pct_ceiling']:.0f}%)")
            out.append(f"{head} " + " | ".join(cols) + " |")
        out.append("")
    return "\n".join(out)


def _fmt(row: dict) -> str:
    parts = [f"{row['shape']:13s} B={row['batch']:<3d} ctx={row['context']:<6d} "
             f"S={row['splits']:<2d}"]
    for arm in ARMS:
        c = row[arm]
        parts.append(f"{arm} {c['ms']*1e3:8.1f}us {c['tbs']:.2f}TB/s x{c['speedup_vs_sdpa']:.2f}")
    parts.append(f"err16={row['err_fp16_vs_sdpa']:.1e} err8={row['err_e4m3_vs_sdpa']:.1e} "
                 f"sw={row['err_sw_vs_native']:.1e}")
    spreads = [row[arm].get("spread", 0.0) for arm in ARMS]
    parts.append(f"rounds' spread <= {100 * max(spreads):.1f}%")
    return " | ".join(parts)


# Issue 5's targets on the Llama-3.1-8B shape at B >= 8, ctx >= 16K (TARGET_CELL)
TARGET_SPEEDUP, TARGET_PCT, TARGET_SW_RATIO, TARGET_PAGED_RATIO = 1.8, 85.0, 1.15, 1.1
TARGET_SHAPE, TARGET_MIN_BATCH, TARGET_MIN_CONTEXT = "llama31-8b", 8, 16384
NEVER_SLOWER_CONTEXT = 4096  # E4M3 never slower than the 16-bit kernel from here, every shape


def target_cell(row: dict) -> bool:
    return "skipped" not in row and _in_target(row)


def _in_target(row: dict) -> bool:
    """A cell of the targets' domain, measured or skipped."""
    return (row.get("shape") == TARGET_SHAPE and row.get("batch", 0) >= TARGET_MIN_BATCH
            and row.get("context", 0) >= TARGET_MIN_CONTEXT)


def _num(row: dict, arm: str, key: str) -> float:
    """row[arm][key] as a float: NaN where the arm or the value is missing, not a number, or
    (a time) not positive, so every comparison with it is false: a target it feeds is not
    met, never met by default."""
    v = json_number(row[arm].get(key) if isinstance(row.get(arm), dict) else None)
    return v if key != "ms" or v > 0 else math.nan


def _label(r: dict) -> str:
    return f"{r['batch']} x {_ctx(r['context'])}"


def _latest(rows: list[dict]) -> list[dict]:
    """One row per (shape, batch, context): the later file's (as throughput_targets), so a
    cell in two files is judged once, not counted twice; a measured row is never replaced by
    a skipped one (a later run that could not fit the cell does not unjudge a measurement)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r.get("shape"), r.get("batch"), r.get("context"))
        if "skipped" in r and key in out and "skipped" not in out[key]:
            continue
        out[key] = r
    return list(out.values())


def target_verdicts(rows: list[dict]) -> list[str]:
    """One line per target of issue 5: in how many of the measured cells it is met, which
    cells miss it, which were skipped (with the reason: never a pass) and which of the
    issue's cells no file holds (E4M3 never slower than the 16-bit kernel: every shape,
    ctx >= 4K). A value that is missing or NaN misses its target."""
    rows = _latest(rows)
    cells = [r for r in rows if target_cell(r)]
    skipped = [f"{_label(r)} ({r['skipped']})" for r in rows
               if "skipped" in r and _in_target(r)]
    present = {(r["batch"], r["context"]) for r in rows if r.get("shape") == TARGET_SHAPE}
    missing = [f"{b} x {_ctx(c)}" for b in BATCHES if b >= TARGET_MIN_BATCH
               for c in CONTEXTS if c >= TARGET_MIN_CONTEXT and (b, c) not in present]
    tail = ((f"; skipped (not judged): {', '.join(skipped)}" if skipped else "")
            + (f"; missing (no file has it): {', '.join(missing)}" if missing else ""))

    def line(what: str, ok) -> str:
        miss = [_label(r) for r in cells if not ok(r)]
        return (f"{what}: met in {len(cells) - len(miss)} of {len(cells)} cells"
                + (f" (not: {', '.join(miss)})" if miss else "") + tail)

    nat, sw, p16 = "e4m3_native", "e4m3_software", "paged_fp16"
    judged = [r for r in rows if "skipped" not in r and r["context"] >= NEVER_SLOWER_CONTEXT]
    # "never slower": met only where the E4M3 time is known and <= the 16-bit kernel's
    slower = [f"{r['shape']} B={r['batch']} ctx={r['context']} {arm}"
              + ("" if _num(r, arm, "ms") > _num(r, p16, "ms") else " (not measured)")
              for r in judged for arm in (nat, sw)
              if not _num(r, arm, "ms") <= _num(r, p16, "ms")]
    skipped4k = [f"{r['shape']} B={r['batch']} ctx={r['context']} ({r['skipped']})"
                 for r in rows if "skipped" in r and r.get("context", 0) >= NEVER_SLOWER_CONTEXT]
    shapes = {r.get("shape") for r in rows}
    absent = [name for name, *_ in SHAPES if name not in shapes]
    # the cells at ctx >= 4K of the shapes that have cells but not these (only wholly
    # absent shapes were named: a file of the nine 8B target cells read as "0 slower" over
    # B 1 / 4 and every 4K cell, which no file held)
    held = {(r.get("shape"), r.get("batch"), r.get("context")) for r in rows}
    missing4k = [f"{name} B={b} ctx={c}" for name, *_ in SHAPES if name in shapes
                 for b in BATCHES for c in CONTEXTS
                 if c >= NEVER_SLOWER_CONTEXT and (name, b, c) not in held]
    return [
        line(f"native >= {TARGET_SPEEDUP}x SDPA at >= {TARGET_PCT:.0f}% of the ceiling",
             lambda r: (_num(r, nat, "speedup_vs_sdpa") >= TARGET_SPEEDUP
                        and _num(r, nat, "pct_ceiling") >= TARGET_PCT)),
        line(f"software within {TARGET_SW_RATIO}x of native",
             lambda r: _num(r, sw, "ms") / _num(r, nat, "ms") <= TARGET_SW_RATIO),
        line(f"16-bit paged within {TARGET_PAGED_RATIO}x of SDPA",
             lambda r: _num(r, p16, "ms") / _num(r, "sdpa_fp16", "ms") <= TARGET_PAGED_RATIO),
        f"E4M3 slower than kvcap's 16-bit kernel at ctx >= 4K: {len(slower)} cells"
        + (": " + "; ".join(slower[:12]) if slower else "")
        + (f" (+{len(slower) - 12} more)" if len(slower) > 12 else "")
        + f" (of {2 * len(judged)} E4M3 arm-cells judged)"
        + (f"; skipped (not judged): {'; '.join(skipped4k)}" if skipped4k else "")
        + (f"; missing (no file has it): {', '.join(missing4k[:12])}" if missing4k else "")
        + (f" (+{len(missing4k) - 12} more)" if len(missing4k) > 12 else "")
        + (f"; shapes with no cells: {', '.join(absent)}" if absent else ""),
    ]


def print_summary(rows: list[dict], sources: list[str] = ()) -> None:
    print(f"\nTargets (llama31-8b, B>=8, ctx>=16K): native>={TARGET_SPEEDUP}x SDPA at "
          f">={TARGET_PCT:.0f}% ceiling; sw/native<={TARGET_SW_RATIO}; "
          f"paged16/SDPA<={TARGET_PAGED_RATIO}")
    for text in sources:
        print(f"source: {text}")
    for text in target_verdicts(rows):
        print(text)
    print(f"{'B':>3} {'ctx':>6} {'sdpa_us':>8} {'p16_us':>8} {'nat_us':>8} {'sw_us':>8} "
          f"{'nat_x':>6} {'nat%':>5} {'sw/nat':>6} {'p16/sd':>6} {'natMHz':>9}")
    for r in _latest(rows):
        if not target_cell(r):
            continue
        sd, p16 = _num(r, "sdpa_fp16", "ms"), _num(r, "paged_fp16", "ms")
        nat, sw = _num(r, "e4m3_native", "ms"), _num(r, "e4m3_software", "ms")
        print(f"{r['batch']:>3} {r['context']:>6} {sd*1e3:8.1f} {p16*1e3:8.1f} "
              f"{nat*1e3:8.1f} {sw*1e3:8.1f} {_num(r, 'e4m3_native', 'speedup_vs_sdpa'):6.2f} "
              f"{_num(r, 'e4m3_native', 'pct_ceiling'):5.1f} {sw/nat:6.3f} {p16/sd:6.3f} "
              f"{_clock_range((r.get('e4m3_native') or {}).get('sm_mhz_rounds')):>9}")


def _clock_range(mhz: list | None) -> str:
    """'min-max' of the SM clocks read during an arm's rounds ('-' without NVML): rounds
    under ~1,700 MHz ran at the H200's power cap (docs/kernels.md, "Eighteenth change")."""
    mhz = [m for m in mhz or [] if m]
    return f"{min(mhz)}-{max(mhz)}" if mhz else "-"


# (block_n, num_warps, num_stages, prefetch). A transposed ("swap AB") loop that put the cache
# tile on the MMA's M side (warp-group MMAs) was swept at commit 4d3fd33 and lost everywhere;
# see docs/kernels.md.
SWEEP_FP8 = [(64, 4, 2, False), (128, 4, 2, False), (128, 8, 2, False), (64, 4, 3, False),
             (128, 4, 3, False), (64, 8, 2, False), (32, 4, 1, True)]
SWEEP_FP16 = [(64, 4, 2, False), (128, 4, 2, False), (32, 4, 2, False)]
SWEEP_CELLS = [("llama31-8b", 32, 8, 128, 8, 32768), ("llama31-8b", 32, 8, 128, 64, 16384),
               ("gqa6-d256", 24, 4, 256, 8, 32768), ("smollm2-135m", 9, 3, 64, 16, 32768)]


WORD_CELLS = SWEEP_CELLS + [("llama31-8b", 32, 8, 128, 16, 16384),
                            ("gqa6-d256", 24, 4, 256, 64, 16384)]
# cells whose default launch splits the context (the folded merge matters there)
FOLD_CELLS = [("llama31-8b", 32, 8, 128, 8, 16384), ("llama31-8b", 32, 8, 128, 8, 32768),
              ("llama31-8b", 32, 8, 128, 16, 16384), ("llama31-8b", 32, 8, 128, 4, 4096),
              ("gqa6-d256", 24, 4, 256, 8, 32768), ("smollm2-135m", 9, 3, 64, 16, 32768)]


def compare_knob(l2: int, read_tbs: float, knob: str, cells: list,
                 arms=("e4m3_native", "e4m3_software"), rounds: int = 1) -> list[dict]:
    """paged_decode(knob=False) vs (knob=True) for both E4M3 decoders at the default launch
    configuration, e.g. the byte vs the word route (`words`); each row records the relative
    difference of the knob's output from the default's. With rounds > 1 the two settings are
    timed in alternating order that many times (ms: the median; ms_rounds, sm_mhz_rounds)."""
    rows = []
    for name, hq, hkv, d, b, ctx in cells:
        cell = Cell(hq, hkv, d, b, ctx, l2)
        for arm in arms:
            got, times, clocks = {}, {False: [], True: []}, {False: [], True: []}
            try:
                for on in (False, True):
                    got[on] = cell.fns(arm, **{knob: on})[0]().clone()
            except ValueError as e:  # e.g. fold=True past FOLD_MAX_SPLITS splits
                print(f"{knob} {name} B={b} ctx={ctx} {arm}: skipped ({e})", flush=True)
                continue
            for i in range(rounds):
                for on in ((False, True) if i % 2 == 0 else (True, False)):
                    times[on].append(_graph_time(cell.fns(arm, **{knob: on}), reps=20,
                                                 clocks=clocks[on]))
            for on in (False, True):
                ms = statistics.median(times[on])
                tbs = cell.kv_bytes(arm) / (ms * 1e-3) / 1e12
                rows.append({"shape": name, "batch": b, "context": ctx, "arm": arm,
                             knob: on, "ms": ms, "tbs": tbs, "pct_ceiling": 100 * tbs / read_tbs,
                             "ms_rounds": times[on], "sm_mhz_rounds": clocks[on]})
            err = _rel(got[True], got[False])
            rows[-1]["err_vs_off"] = err
            print(f"{knob} {name:13s} B={b:<3d} ctx={ctx:<6d} {arm:14s} off "
                  f"{rows[-2]['ms'] * 1e3:8.1f}us on {rows[-1]['ms'] * 1e3:8.1f}us "
                  f"({rows[-2]['ms'] / rows[-1]['ms']:.3f}x, {rows[-1]['pct_ceiling']:.0f}% ceil) "
                  f"err {err:.1e}", flush=True)
        del cell
        torch.cuda.empty_cache()
    return rows


DECODER_MODES = ("native", "software", "native-k", "native-v")


def compare_decoders(l2: int, read_tbs: float) -> list[dict]:
    """Every E4M3 decoder pairing (paged_decode fp8_mode: both native, both software, K native
    + V software, K software + V native) at the default route and launch configuration; each
    output must equal the native one exactly (the decoders give identical values)."""
    rows = []
    for name, hq, hkv, d, b, ctx in WORD_CELLS:
        cell = Cell(hq, hkv, d, b, ctx, l2)
        ref = None
        for mode in DECODER_MODES:
            fns = cell.fns("e4m3_native", fp8_mode=mode)
            fns[0]()
            got = cell.out[0].clone()
            ref = got if ref is None else ref
            ms = _graph_time(fns, reps=10)
            tbs = cell.kv_bytes("e4m3_native") / (ms * 1e-3) / 1e12
            rows.append({"shape": name, "batch": b, "context": ctx, "fp8_mode": mode, "ms": ms,
                         "tbs": tbs, "pct_ceiling": 100 * tbs / read_tbs,
                         "max_abs_diff_vs_native": float((got.float() - ref.float()).abs().max())})
        line = " ".join(f"{r['fp8_mode']} {r['ms'] * 1e3:7.1f}us ({r['pct_ceiling']:.0f}%)"
                        for r in rows[-len(DECODER_MODES):])
        print(f"decoders {name:13s} B={b:<3d} ctx={ctx:<6d} {line}", flush=True)
        del cell
        torch.cuda.empty_cache()
    return rows


def own_cells_error(args) -> str | None:
    """Why --batches / --contexts / --grid would be ignored, or None. The knob comparisons
    and the occupancy sweep time their own target cells unless --grid (or, for the sweep,
    --occupancy-splits) asks for --shapes x --batches x --contexts; --compare-words,
    --compare-decoders and --sweep-only (the launch sweep without the matrix) always time their
    own. A sweep told `--batches 8` once ran other cells."""
    chose = [flag for flag, value, default in (("--batches", args.batches, BATCHES),
                                               ("--contexts", args.contexts, CONTEXTS))
             if value != default]
    # --shapes too (`--compare-fold --shapes llama31-8b` timed FOLD_CELLS' other shapes),
    # except for --sweep-occupancy, which filters its own cells by it
    if (sorted(args.shapes) != sorted(s[0] for s in SHAPES)
            and not (args.sweep_occupancy and not args.grid)):
        chose.append("--shapes")
    fixed = [f for f, on in (("--compare-words", args.compare_words),
                             ("--compare-decoders", args.compare_decoders),
                             ("--sweep-only", args.sweep_only)) if on]
    if fixed and (chose or args.grid):
        return (f"{fixed[0]} times its own cells: {', '.join(chose + ['--grid'] * args.grid)} "
                f"would be ignored")
    gridded = [f for f, on in (("--compare-pairs", args.compare_pairs),
                               ("--compare-bf16", args.compare_bf16),
                               ("--compare-fold", args.compare_fold),
                               ("--compare-prewait", args.compare_prewait),
                               ("--sweep-occupancy", args.sweep_occupancy
                                and not args.occupancy_splits)) if on]
    if gridded and chose and not args.grid:
        return (f"{gridded[0]} times its own cells unless --grid is given: add --grid to time "
                f"--shapes x --batches x --contexts ({', '.join(chose)} would be ignored)")
    return None


# (block_n, num_warps, num_stages, maxnreg) for the occupancy sweep: at the default 128/4/2 the
# word-route kernel uses 168 registers (ptxas, sm_90a), so an SM holds 3 programs (12 warps);
# a cap of 128 registers holds 4 (44 bytes spilled). Smaller programs trade the cross-warp
# softmax barriers for fewer warps each.
OCCUPANCY_CONFIGS = [(128, 4, 2, None), (128, 4, 2, 128), (128, 4, 3, 128), (64, 4, 2, None),
                     (64, 4, 3, None), (64, 4, 4, None), (128, 8, 2, None), (128, 8, 3, None),
                     (64, 2, 2, None), (64, 2, 3, None), (32, 1, 2, None), (32, 1, 3, None)]
OCCUPANCY_CELLS = [("llama31-8b", 32, 8, 128, 8, 16384), ("llama31-8b", 32, 8, 128, 8, 32768),
                   ("llama31-8b", 32, 8, 128, 16, 16384),
                   ("llama31-8b", 32, 8, 128, 64, 16384), ("gqa6-d256", 24, 4, 256, 8, 32768),
                   ("gqa6-d256", 24, 4, 256, 64, 16384), ("smollm2-135m", 9, 3, 64, 16, 32768)]


def parse_configs(text: str) -> list[tuple]:
    """'BN:W:S:R,...' (R 0 = no register cap) -> OCCUPANCY_CONFIGS-style tuples."""
    try:
        out = []
        for item in text.split(","):
            bn, nw, ns, nreg = (int(x) for x in item.split(":"))
            out.append((bn, nw, ns, nreg or None))
        return out
    except ValueError:
        raise SystemExit(f"--occupancy-configs {text!r}: expected BN:WARPS:STAGES:MAXNREG,... "
                         "(MAXNREG 0 = no cap), e.g. 128:4:3:128,64:4:4:0") from None


# '1,2,3' -> [1, 2, 3] (split counts >= 1) for --occupancy-splits
parse_splits = list_type(positive_int, "split counts >= 1, e.g. 1,2,3,4", "parse_splits")


def parse_names(known: list[str]):
    """An argparse type for 'a,b' -> ['a', 'b'], each one of `known` (--shapes, a name of
    kvcap.bench.throughput's like llama-3.1-8b matched nothing and ran no cell)."""
    def parse(text: str) -> list[str]:
        names = text.split(",")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}: "
                                             f"expected comma-separated names among "
                                             f"{', '.join(known)}")
        return names
    parse.__name__ = "names"
    return parse


def split_candidates(b: int, hkv: int, ctx: int, bn: int, sms: int, waves: bool) -> list[int]:
    """Split counts to time: 0.5x, 1x and 2x the old heuristic (8 programs per SM, rounded
    up), or with `waves` every count that fills whole waves of 2..8 resident programs per SM."""
    if not waves:
        base = choose_num_splits(b, hkv, ctx, bn, sms, 8)
        return sorted({max(1, int(base * m)) for m in (0.5, 1, 2)})
    return sorted({choose_num_splits(b, hkv, ctx, bn, sms, r, whole_waves=True)
                   for r in range(2, 9)})


def sweep_occupancy(l2: int, read_tbs: float, rows: list[dict], save,
                    arms=("e4m3_native", "e4m3_software"), waves: bool = False,
                    configs=OCCUPANCY_CONFIGS, cells=OCCUPANCY_CELLS,
                    route: dict | None = None, splits: list[int] | None = None) -> list[dict]:
    """Launch configurations x register caps x split counts (`splits`, default
    split_candidates) on the target cells, on the default route or on `route` (paged_decode
    keywords, e.g. words=True); every output is compared with the default launch's. Rows are
    appended to `rows` and `save()` runs after every cell."""
    route = route or {}
    for name, hq, hkv, d, b, ctx in cells:
        cell = Cell(hq, hkv, d, b, ctx, l2)
        for arm in arms:
            fns = cell.fns(arm)
            fns[0]()
            ref = cell.out[0].clone()
            base_ms = _graph_time(fns, reps=10)
            for bn, nw, ns, nreg in configs:
                counts = splits or split_candidates(b, hkv, ctx, bn,
                                                    sm_count(cell.q[0].device), waves)
                for n in counts:
                    kw = dict(block_n=bn, num_warps=nw, num_stages=ns, maxnreg=nreg,
                              num_splits=n, **route)
                    try:
                        fns = cell.fns(arm, **kw)
                        fns[0]()
                        err = _rel(cell.out[0], ref)
                        ms = _graph_time(fns, reps=10)
                    except Exception as e:  # noqa: BLE001 - report and continue the sweep
                        print(f"occupancy {name} {arm} {kw} failed: {e!s:.120}", flush=True)
                        break
                    tbs = cell.kv_bytes(arm) / (ms * 1e-3) / 1e12
                    rows.append({"shape": name, "batch": b, "context": ctx, "arm": arm, **kw,
                                 "ms": ms, "default_ms": base_ms, "tbs": tbs,
                                 "pct_ceiling": 100 * tbs / read_tbs, "rel_err_vs_default": err})
            ranked = sorted((r for r in rows if r["arm"] == arm and r["batch"] == b
                             and r["shape"] == name and r["context"] == ctx),
                            key=lambda r: r["ms"])
            for r in ranked[:4]:
                print(f"occupancy {name} B={b} ctx={ctx} {arm}: BN={r['block_n']} "
                      f"W={r['num_warps']} S={r['num_stages']} R={r['maxnreg']} "
                      f"splits={r['num_splits']} {r['ms'] * 1e3:.1f}us "
                      f"({r['pct_ceiling']:.0f}%; default {base_ms * 1e3:.1f}us) "
                      f"err {r['rel_err_vs_default']:.1e}", flush=True)
        del cell
        torch.cuda.empty_cache()
        save()
    return rows


def run_sweep(l2: int, out: list[dict], save) -> list[dict]:
    """Launch-config sweep (grouped route) on the cells the targets name; rows are appended
    to `out` and `save()` runs after every cell (a time-capped run keeps what it measured)."""
    for name, hq, hkv, d, b, ctx in SWEEP_CELLS:
        cell = Cell(hq, hkv, d, b, ctx, l2)
        for arm in ("paged_fp16", "e4m3_native", "e4m3_software"):
            for bn, nw, ns, pf in (SWEEP_FP16 if arm == "paged_fp16" else SWEEP_FP8):
                base = choose_num_splits(b, hkv, ctx, bn, sm_count(cell.q[0].device))
                for mult in (1, 2):
                    splits = max(1, int(base * mult))
                    try:
                        ms = _graph_time(cell.fns(arm, block_n=bn, num_warps=nw, num_stages=ns,
                                                  num_splits=splits, prefetch=pf), reps=10)
                    except Exception as e:  # noqa: BLE001 - report and continue the sweep
                        print(f"sweep {name} {arm} {bn},{nw},{ns},{pf} failed: {e!s:.120}")
                        break
                    tbs = cell.kv_bytes(arm) / (ms * 1e-3) / 1e12
                    out.append({"shape": name, "batch": b, "context": ctx, "arm": arm,
                                "block_n": bn, "num_warps": nw, "num_stages": ns,
                                "prefetch": pf, "splits": splits, "ms": ms,
                                "tbs": tbs})
        rows = [r for r in out if r["shape"] == name and r["batch"] == b]
        for arm in ("paged_fp16", "e4m3_native", "e4m3_software"):
            ranked = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["ms"])
            for r in ranked[:3]:
                print(f"sweep {name} B={b} ctx={ctx} {arm}: BN={r['block_n']} "
                      f"W={r['num_warps']} S={r['num_stages']} PF={r['prefetch']:d} "
                      f"splits={r['splits']} {r['ms']*1e3:.1f}us {r['tbs']:.2f}TB/s", flush=True)
        del cell
        torch.cuda.empty_cache()
        save()
    return out


if __name__ == "__main__":
    sys.exit(main())
