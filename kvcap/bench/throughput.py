"""End-to-end throughput matrix: concurrency x context x KV mode, with capacity and HF baseline.

    python -m kvcap.bench.throughput --shapes llama-3.1-8b --concurrency 1 16 64 \
        --context 1024 16384 --kv fp16 fp8 fp8-software --out docs/benchmarks/

Per cell: all requests are submitted at once with random prompts of `context - out` tokens
and generate `out` tokens (ignore_eos, greedy). TTFT = until every request has a first token;
decode tok/s = tokens computed after that / time after that (a step the overlapped engine had
already run by then is left out: `steps_run_ahead`). Roofline: a decode step must
read the weights once and each sequence's KV once; we divide those bytes by a read ceiling
measured in the same run. E4M3 arms use scales calibrated in the run, so the gate runs as in
production: ceil_fp32(max_abs / 448) per layer (`kvcap calibrate`'s default policy) over a short
prefill of random ids for dummy weights, and over the calibration split of kvcap's built-in
corpora (CALIBRATION_TOKENS, 1K-token records) for a real checkpoint (the embedded model).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from kvcap.bench.provenance import result_path, stamp
from kvcap.bench.telemetry import Sampler
from kvcap.commands.common import positive_float, positive_int, require_cuda
from kvcap.kv_cache.spec import admissible_concurrency

CONFIGS = Path(__file__).parent / "configs"
SHAPES = {"llama-3.1-8b": f"dummy:{CONFIGS / 'llama-3.1-8b.json'}",
          "gqa6-d256": f"dummy:{CONFIGS / 'gqa6-d256.json'}", "embedded": "default",
          # Mistral-7B-v0.1's shape: every layer slides over 4,096 tokens
          "mistral-7b-sw4k": f"dummy:{CONFIGS / 'mistral-7b-sw4k.json'}",
          # the 8B shape with FP8 (E4M3) linear weights kept in FP8: one scale a row
          # (compressed-tensors, as Llama-3.1-8B-Instruct-FP8 ships), or 128 x 128 blocks
          # (transformers' fine-grained FP8)
          "llama-3.1-8b-fp8": f"dummy:{CONFIGS / 'llama-3.1-8b-fp8.json'}",
          "llama-3.1-8b-fp8-block": f"dummy:{CONFIGS / 'llama-3.1-8b-fp8-block.json'}"}
# KV mode -> (kv_cache_dtype, environment for the arm); "fp8" is the default E4M3 decode,
# "fp8-mixed" K by the hardware conversion and V by the software decoder.
KV_MODES = {"fp16": ("auto", {}), "fp8": ("fp8_e4m3", {}),
            "fp8-software": ("fp8_e4m3", {"KVCAP_FORCE_SOFTWARE_FP8": "1"}),
            "fp8-mixed": ("fp8_e4m3", {"KVCAP_MIXED_DECODERS": "1"})}
ARM_ENV = ("KVCAP_FORCE_SOFTWARE_FP8", "KVCAP_MIXED_DECODERS")
logger = logging.getLogger("kvcap.bench.throughput")


@contextlib.contextmanager
def kv_arm(mode: str) -> Iterator[str]:
    """Set the arm's environment switches (read when an LLM is built and graphs are captured,
    and at every eager launch) for the block; yields its kv_cache_dtype. Restores them after."""
    if mode not in KV_MODES:
        raise ValueError(f"KV mode {mode!r} is not one of {', '.join(KV_MODES)}")
    kv_dtype, env = KV_MODES[mode]
    saved = {key: os.environ.get(key) for key in ARM_ENV}
    for key in ARM_ENV:
        os.environ[key] = env.get(key, "0")
    try:
        yield kv_dtype
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def read_ceiling_tbs(device: torch.device) -> float:
    """Streaming-read ceiling (TB/s), the same Triton read kernel as the kernel benchmark (so
    every roofline in docs/benchmarks uses one ceiling)."""
    from kvcap.bench.kernels import measure_ceilings

    with torch.cuda.device(device):
        return measure_ceilings()["read_tbs"]


CALIBRATION_TOKENS = 65536  # a real checkpoint's calibration prefill, in tokens


def calibrated_scales(model: str, dtype: str, tokens: int = CALIBRATION_TOKENS
                      ) -> dict[str, float]:
    """Per-layer K/V scales (ceil_fp32(max_abs / 448)) from the model's own prefill: random
    ids for dummy weights, the built-in corpora's calibration split for a real checkpoint."""
    from kvcap import LLM, SamplingParams
    from kvcap.errors import CalibrationError
    from kvcap.eval import corpora
    from kvcap.scales.report import scale_for

    maxes: dict[tuple[int, str], float] = {}

    def observe(layer, k, v):
        for name, x in (("k", k), ("v", v)):
            m = float(x.abs().max())
            maxes[(layer, name)] = max(maxes.get((layer, name), 0.0), m)

    llm = LLM(model=model, dtype=dtype, kv_cache_memory_gib=2, enforce_eager=True,
              fp8_weights="auto",
              kv_observer=observe)
    if model.startswith("dummy:"):
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, llm.spec.vocab_size, (4, 512), generator=gen).tolist()
    else:
        shards = corpora.build_shards(llm.tokenizer, None, tokens, "calibration", 1024,
                                      progress=False)
        ids = [r for s in shards for r in s.records]
        if not ids:
            raise CalibrationError("the built-in calibration corpora produced no records on "
                                   "this machine: the E4M3 arms of a real checkpoint cannot be "
                                   "calibrated (run `kvcap calibrate --corpus FILE` instead)")
    llm.generate(ids, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    prefix = llm.spec.layer_prefix
    out = {f"{prefix}.{layer}.self_attn.{n}_scale": scale_for(m) for (layer, n), m in maxes.items()}
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


def run_cell(llm, concurrency: int, context: int, out_tokens: int, repeats: int,
             long_warmup: bool = True) -> dict:
    """One cell, as two phases per repeat (the first repeat is a warm-up):

    1. cold prefill: every prompt with max_tokens=1 -> TTFT (until every request has its
       token) and prefill tok/s;
    2. decode: the same prompts again with max_tokens=out_tokens. Their full blocks are in the
       prefix cache, so after one short step (the partial tail block) every request decodes
       in lockstep and the decode rate is measured over steps where all `concurrency`
       requests decode. (Timing decode inside one cold run mixes it with the staggered
       prefill: early requests finish before late ones start, which overstates the rate.)

    End-to-end time (`e2e_s`) is composed of the two measured phases: TTFT plus out_tokens - 1
    decode steps at the measured step time -- from submission until every request has all its
    tokens, for a batch whose prefills and decodes do not overlap. (The decode phase's own
    wall time starts from cached prompts, so it is no end-to-end time.)

    `long_warmup=False` leaves out the warm-up's full-length request (the protocol before
    2026-12-02), to check that no kernel compiles inside the scored repeats without it.
    """
    from kvcap import SamplingParams

    gen = torch.Generator().manual_seed(context + concurrency)
    prompt_len = context - out_tokens
    results = []
    for rep in range(repeats + 1):
        n = prompt_len if rep else min(prompt_len, 2048)
        if not rep and long_warmup:
            # The first repeat is a warm-up (kernels, graphs) on prompts of at most 2K tokens
            # (at 64 x 16K a full-size warm-up would cost a minute of prefill for nothing),
            # after one full-length request: the long tables and chunks compile kernel
            # variants the short prompts never meet, which the first scored repeat paid for
            # (up to 1.5 s of TTFT at 16 x 16K) until 2026-12-02.
            _run_requests(llm, "wlong", torch.randint(
                100, llm.spec.vocab_size - 100, (1, prompt_len), generator=gen).tolist(),
                SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        ids = torch.randint(100, llm.spec.vocab_size - 100, (concurrency, n),
                            generator=gen).tolist()
        llm.block_manager.reset_prefix_cache()
        t_first = _run_requests(llm, f"p{rep}", ids, SamplingParams(
            temperature=0, max_tokens=1, ignore_eos=True))[0]
        gpu = Sampler()
        t_start, t_end, before = _run_requests(llm, f"d{rep}", ids, SamplingParams(
            temperature=0, max_tokens=out_tokens, ignore_eos=True), gpu)
        # the tokens computed after the decode clock started: the overlapped engine had the
        # step after the first token launched before that token was read, and the sync that
        # started the clock waited for it (files without `steps_run_ahead` counted it: their
        # rates read high by (out - 1) / (out - 2), 1.6% at 64 output tokens, 0.4% at 256)
        timed = concurrency * out_tokens - before
        if timed <= 0:
            raise ValueError(f"{out_tokens} output tokens leave no decode step to time")
        step_s = max(t_end - t_start, 1e-9) * concurrency / timed
        results.append({"ttft_s": t_first, "prefill_tok_s": concurrency * n / t_first,
                        "e2e_s": t_first + (out_tokens - 1) * step_s,
                        "decode_tok_s": timed / max(t_end - t_start, 1e-9),
                        "decode_steps": timed / concurrency,
                        "steps_run_ahead": before / concurrency - 1, **gpu.summary()})
    scored = results[1:]
    cell = {k: _median(r[k] for r in scored) for k in scored[0]}
    # every scored repeat too: the spread, and a first repeat that paid for something the
    # warm-up did not (a kernel compiled for a new specialization) shows there; the decode
    # phase's SM clock and power (None without NVML) tell a power-capped repeat apart
    cell["repeats"] = {k: [None if r[k] is None else round(r[k], 4) for r in scored]
                       for k in ("ttft_s", "decode_tok_s", "prefill_tok_s", "e2e_s", "sm_mhz",
                                 "power_w")}
    return cell


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def merge_passes(runs: list[dict]) -> dict:
    """One cell measured in several passes (--passes): medians over every pass's scored
    repeats, each pass's repeats kept in order."""
    if len(runs) == 1:
        return runs[0]
    merged = dict(runs[0])
    rep = {k: [x for r in runs for x in r["repeats"][k]] for k in runs[0]["repeats"]}
    for k, xs in rep.items():
        merged[k] = _median(xs)
    merged["repeats"] = rep
    merged["passes"] = len(runs)
    return merged


def _sync(llm) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


def _run_requests(llm, tag: str, ids: list[list[int]], params,
                  gpu: Sampler | None = None) -> tuple[float, float, int]:
    """Run requests to completion: (seconds until every request had its first token,
    seconds until all finished, both from submission; the tokens computed by then: those
    returned, and those of a step the engine had launched ahead, `_tokens_ahead`); `gpu`
    samples clock and power between engine steps."""
    _sync(llm)
    t0 = time.perf_counter()
    for i, p in enumerate(ids):
        llm.engine.add_request(f"{tag}-{i}", p, params)
    seen: dict[str, int] = {}  # request -> tokens returned
    t_first, before = None, 0
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            if o.token_ids:
                seen[o.request_id] = len(o.token_ids)
        if gpu is not None and llm.device.type == "cuda":
            gpu.sample()
        if t_first is None and len(seen) == len(ids):
            before = sum(seen.values()) + _tokens_ahead(llm)
            _sync(llm)  # (waits for the step launched ahead too)
            t_first = time.perf_counter() - t0
    _sync(llm)
    t_end = time.perf_counter() - t0
    return (t_first if t_first is not None else t_end), t_end, before


def _tokens_ahead(llm) -> int:
    """Tokens of the step the engine launched before the last one's tokens were read
    (Engine.overlap, on by default on CUDA): queued on the device, not yet returned."""
    pending = getattr(llm.engine, "_ahead", None)
    return len(pending[0].chunks) if pending is not None else 0


def weight_bytes(llm) -> int:
    """Bytes of the parameters every decode step reads in full: all of them except an untied
    input embedding table, of which a step gathers one row per token (a tied one is read in
    full by the LM head). Rooflines before 2026-12-01 counted the whole table too (1 GiB more
    for Llama-3.1-8B, so their roofline fractions read ~6% higher)."""
    emb = llm.model.embed_tokens.weight
    tied = getattr(llm.model.lm_head, "weight", None) is emb
    return sum(p.numel() * p.element_size() for p in llm.model.parameters()
               if tied or p is not emb)


def startup_seconds(llm, started: float) -> dict[str, float | None]:
    """What the engine's start cost: `LLM(...)` in all (weights, KV pool, decoder self-check,
    graph captures) and the two CUDA graph captures in it (None where not captured)."""
    runner = llm.runner
    return {"startup_s": round(time.perf_counter() - started, 2),
            "decode_graphs_capture_s": _capture_s(runner.graphs),
            "piecewise_graphs_capture_s": _capture_s(runner.piecewise)}


def _capture_s(graphs) -> float | None:
    s = getattr(graphs, "capture_s", None)
    return None if s is None else round(s, 2)


def kv_read_tokens(spec, context: int, out_tokens: int | None = None,
                   timed_steps: int | None = None) -> float:
    """Cached tokens a decode step reads per sequence, averaged over the layers: a sliding
    layer (KVCacheSpec.layer_windows) reads at most its window. With `out_tokens` (a cell of
    run_cell: prompts of context - out_tokens tokens, out_tokens generated), also averaged
    over the cell's timed decode steps: step i (1 <= i < out_tokens) attends over
    context - out_tokens + i tokens, so the mean is context - out_tokens / 2, not `context`
    (counting `context` overstated the KV bytes, and so the roofline fraction, by up to
    out_tokens / 2 tokens a sequence: 2.6% at 64 x 1K with 256 output tokens).
    `timed_steps`: the last that many of those steps were timed (run_cell's decode_steps;
    default all out_tokens - 1)."""
    if out_tokens is None or out_tokens < 2:
        steps = [context]
    else:
        n = out_tokens - 1 if timed_steps is None else max(1, min(timed_steps, out_tokens - 1))
        steps = range(context - n, context)
    windows = spec.layer_windows or (None,)
    per_window = {w: sum(min(t, w or t) for t in steps) / len(steps) for w in set(windows)}
    return sum(per_window[w] for w in windows) / len(windows)


def roofline_step_s(llm, concurrency: int, context: int, ceiling_tbs: float,
                    out_tokens: int | None = None, timed_steps: int | None = None) -> float:
    """A decode step's roofline: the weights it reads in full (weight_bytes) plus every
    sequence's KV (kv_read_tokens) over the read ceiling."""
    spec = llm.pool.spec
    kv = spec.bytes_per_token * concurrency * kv_read_tokens(spec, context, out_tokens,
                                                             timed_steps)
    return (weight_bytes(llm) + kv) / (ceiling_tbs * 1e12)


def hf_baseline(model: str, batch: int, context: int, out_tokens: int,
                device: str = "cuda") -> dict:
    """HF transformers generate (FP16, SDPA) on the same model: random weights of the same
    config for a dummy shape ("dummy:CONFIG"), else the checkpoint itself (the embedded model
    through its converted HF-format directory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvcap.models.loader import resolve_model_dir

    kw = dict(dtype=torch.float16, attn_implementation="sdpa")
    if model.startswith("dummy:"):
        cfg = AutoConfig.from_pretrained(model[len("dummy:"):])
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(cfg, **kw).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(model), **kw).to(device).eval()
        cfg = hf.config
    ids = torch.randint(100, cfg.vocab_size - 100, (batch, context - out_tokens), device=device)
    on_cuda = torch.device(device).type == "cuda"

    def timed(m, n: int) -> float:
        if on_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        if on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    with torch.no_grad():
        timed(hf, 4)  # warm-up
        first = timed(hf, 1)  # prefill + one token, subtracted for a decode-only rate
        dt = timed(hf, out_tokens)
    del hf
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    return {"batch": batch, "context": context, "out_tokens": out_tokens, "e2e_s": dt,
            "tok_s": batch * out_tokens / dt, "prefill_plus_one_s": first,
            "decode_tok_s": batch * (out_tokens - 1) / max(dt - first, 1e-9)}


HF_CONTEXT = 1024  # the HF transformers baseline's context (--hf-baseline, --hf-only)
MAX_NUM_BATCHED_TOKENS = 8192  # every arm's step budget (the engine takes no larger block)


def decode_out_tokens(text: str) -> int:
    """--out-tokens: decode is timed after the first token, when the overlapped engine (on
    CUDA) has computed the second as well, so at least 3."""
    n = positive_int(text)
    if n < 3:
        raise argparse.ArgumentTypeError(f"must be >= 3 (decode is timed after the first "
                                         f"token, and the step after it already ran), got {n}")
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-3.1-8b"], choices=list(SHAPES))
    ap.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 4, 8, 16, 64])
    ap.add_argument("--context", type=positive_int, nargs="+",
                    default=[1024, 4096, 16384, 32768, 131072])
    ap.add_argument("--kv", nargs="+", default=["fp16", "fp8", "fp8-software"],
                    choices=list(KV_MODES))
    ap.add_argument("--out-tokens", type=decode_out_tokens, default=256)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--kv-gib", type=positive_float, default=None,
                    help="fixed KV budget for every arm")
    ap.add_argument("--passes", type=positive_int, default=1,
                    help="measure every arm this many times, in order then reversed (each "
                         "pass builds the engine anew and runs its warm-up and repeats); cells "
                         "take the median over all passes' repeats")
    ap.add_argument("--short-warmup", action="store_true",
                    help="warm up on 2K-token prompts only (no full-length request): the "
                         "protocol before 2026-12-02, to see whether a scored repeat compiles")
    ap.add_argument("--hf-baseline", action="store_true")
    ap.add_argument("--hf-only", action="store_true", help="only the HF baseline (no kvcap arms)")
    ap.add_argument("--tensor-parallel-size", type=positive_int, default=1)
    ap.add_argument("--qsa", default=None, metavar="PRESET",
                    help="QSA on every arm, e.g. every4 (kvcap.qsa.enable.PRESET_HELP)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"],
                    help="model (and unquantized KV) dtype of every arm; kvcap's own default on "
                         "a BF16-capable GPU is bfloat16")
    ap.add_argument("--block-size", type=positive_int, default=16,
                    help="tokens per KV cache block of every arm (a power of two)")
    ap.add_argument("--max-model-len", type=positive_int, default=None,
                    help="every arm's maximum sequence length (default: the longest --context); "
                         "a server's is the model's (e.g. 131072), and decode graphs are "
                         "captured for context classes up to it, so a step of short sequences "
                         "runs its class's launch (engine/cuda_graph.py)")
    ap.add_argument("--out", default="docs/benchmarks",
                    help="a .json file, or a directory for throughput-DATE.json (-2, -3, ... "
                         "when that exists: an earlier run is never overwritten)")
    args = ap.parse_args(argv)
    for flag in ("shapes", "concurrency", "context", "kv"):
        values = getattr(args, flag)
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:  # (each ran its cells again and the report counted them as passes)
            ap.error(f"--{flag} names {', '.join(twice)} more than once")
    if args.block_size & (args.block_size - 1):
        ap.error(f"--block-size must be a power of two, got {args.block_size}")
    if args.block_size > MAX_NUM_BATCHED_TOKENS:
        # (EngineConfig refuses it: a ConfigError from the first LLM, after the calibration)
        ap.error(f"--block-size {args.block_size} is larger than a step's "
                 f"{MAX_NUM_BATCHED_TOKENS} tokens (max_num_batched_tokens of every arm)")
    if args.max_model_len is not None and args.max_model_len < max(args.context):
        ap.error(f"--max-model-len {args.max_model_len} is shorter than the longest --context "
                 f"({max(args.context)})")
    if not args.hf_only and min(args.context) <= args.out_tokens:
        ap.error(f"--context {min(args.context)} leaves no prompt: a cell's prompt is --context "
                 f"minus --out-tokens ({args.out_tokens}) tokens; raise --context or lower "
                 "--out-tokens")
    if (args.hf_baseline or args.hf_only) and args.out_tokens >= HF_CONTEXT:
        ap.error(f"--out-tokens {args.out_tokens} leaves the HF baseline no prompt (it runs "
                 f"at {HF_CONTEXT} tokens of context): lower --out-tokens")
    require_cuda(ap, "; the CPU path of the pipeline is `kvcap demo`")
    # --out before any GPU work (as kernels --out): a path under an existing file was a
    # FileExistsError / NotADirectoryError traceback after the read ceiling, and a .json that
    # is a directory an IsADirectoryError at the first save. (The name is taken below.)
    date = time.strftime("%Y-%m-%d")
    try:
        out_path = result_path(Path(args.out), f"throughput-{date}")
    except OSError as e:
        ap.error(f"argument --out: cannot create {args.out} ({e.filename}: {e.strerror or e})")
    if out_path.is_dir() or not os.access(out_path.parent, os.W_OK | os.X_OK):
        ap.error(f"argument --out: cannot write {out_path}")
    logging.basicConfig(level=logging.WARNING)
    from kvcap import LLM

    dev = torch.device("cuda")
    ceiling = read_ceiling_tbs(dev)
    report = {"date": date, "gpu": torch.cuda.get_device_name(dev),
              **stamp(), "read_ceiling_tbs": ceiling, "torch": torch.__version__,
              "args": vars(args), "cells": [], "capacity": [], "hf_baseline": []}
    max_ctx = args.max_model_len or max(args.context)
    path = result_path(Path(args.out), f"throughput-{report['date']}")
    # Take the name now (result_path picks the first one not on disk): written only with the
    # first cell, minutes later, it was free for a run started meanwhile with the same --out,
    # and each run's saves then replaced the other's report.
    _save(report, path)
    runs: dict[tuple, list[dict]] = {}  # (shape, kv, c, ctx) -> one result per pass
    for shape in args.shapes:
        model = SHAPES[shape]
        # (not for --hf-only: no arm reads them, and a calibration failure ended the run)
        scales = (calibrated_scales(model, args.dtype)
                  if not args.hf_only and any(KV_MODES[m][0] == "fp8_e4m3" for m in args.kv)
                  else None)
        # --passes: the arms in order, then reversed, ...: a GPU whose speed drifts during a
        # run (H200, 2026-12-02: 3% over four minutes) then biases no arm against another
        arm_passes = [] if args.hf_only else [
            (i, mode) for i in range(args.passes)
            for mode in (args.kv if i % 2 == 0 else args.kv[::-1])]
        for pass_i, mode in arm_passes:
            with kv_arm(mode) as kv_dtype:
                kw = dict(kv_cache_memory_gib=args.kv_gib) if args.kv_gib else {}
                started = time.perf_counter()
                llm = LLM(model=model, dtype=args.dtype, kv_cache_dtype=kv_dtype,
                          kv_scales=scales if kv_dtype == "fp8_e4m3" else None,
                          max_num_seqs=max(args.concurrency), max_model_len=max_ctx,
                          max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                          block_size=args.block_size,
                          tensor_parallel_size=args.tensor_parallel_size, qsa=args.qsa,
                          fp8_weights="auto", **kw)  # the -fp8 shapes keep FP8 weights
                if pass_i == 0:
                    report["capacity"].append({"shape": shape, "kv": mode,
                                               "tokens": llm.pool.num_tokens,
                                               "bytes_per_token": llm.pool.spec.bytes_per_token,
                                               **startup_seconds(llm, started)})
                for ctx in args.context:
                    for c in args.concurrency:
                        cell = {"shape": shape, "kv": mode, "concurrency": c, "context": ctx,
                                "fp8_weights": llm.keep_fp8}
                        # Every block of the context, also under a sliding window whose
                        # blocks behind it the engine releases: the decode phase reads its
                        # prompts from the prefix cache, which must hold all of them (with
                        # fewer blocks it would prefill again inside the timed decode).
                        need = c * (-(-ctx // llm.config.block_size))
                        # The scheduler admits a request beside running ones only while its
                        # prompt leaves the admission watermark free: a pool of `need` blocks
                        # or a few more ran the last prompts after the first ones had
                        # finished, and the cell was reported as c sequences decoding in
                        # lockstep when it was not.
                        prompt_blocks = -(-(ctx - args.out_tokens) // llm.config.block_size)
                        together = admissible_concurrency(llm.pool.num_blocks, prompt_blocks)
                        if ctx > llm.max_model_len:  # the embedded model holds 8K tokens
                            cell["skip"] = (f"context {ctx} is over the model's maximum length "
                                            f"({llm.max_model_len} tokens)")
                        elif need > llm.pool.num_blocks:
                            cell["skip"] = (f"needs {need} KV blocks, pool has "
                                            f"{llm.pool.num_blocks}")
                            cell["pool_tokens"] = llm.pool.num_tokens
                        elif c > 1 and together < c:
                            cell["skip"] = (f"needs {need} KV blocks, pool has "
                                            f"{llm.pool.num_blocks} (not all {c} at once: the "
                                            f"scheduler's admission watermark runs {together} "
                                            f"prompts of {prompt_blocks} blocks together)")
                            cell["pool_tokens"] = llm.pool.num_tokens
                        else:
                            key = (shape, mode, c, ctx)
                            runs.setdefault(key, []).append(run_cell(
                                llm, c, ctx, args.out_tokens, args.repeats,
                                long_warmup=not args.short_warmup))
                            cell.update(merge_passes(runs[key]))
                            step = c / cell["decode_tok_s"]
                            timed = round(cell["decode_steps"])
                            cell["roofline_fraction"] = roofline_step_s(
                                llm, c, ctx, ceiling, args.out_tokens, timed) / step
                            # the model that fraction used (throughput_targets restates
                            # files without it: they counted `context` tokens a step)
                            cell["roofline_kv_tokens"] = kv_read_tokens(
                                llm.pool.spec, ctx, args.out_tokens, timed)
                        report["cells"] = [x for x in report["cells"] if not (
                            x["shape"] == shape and x["kv"] == mode and x["concurrency"] == c
                            and x["context"] == ctx)] + [cell]
                        print(json.dumps(cell), flush=True)
                        _save(report, path)  # every cell: a cut-short run keeps what it has
                llm.shutdown()  # a process holds one tensor-parallel LLM at a time
                del llm
                gc.collect()
                torch.cuda.empty_cache()
        if args.hf_baseline or args.hf_only:
            for b in (1, 16):  # kvcap's output length too: the same mean context per step
                report["hf_baseline"].append({"shape": shape, **hf_baseline(
                    model, b, HF_CONTEXT, args.out_tokens)})
                _save(report, path)
    _mark_fp8_only(report)
    report["complete"] = True
    _save(report, path)
    _print_table(report)
    print(f"wrote {path}")
    write_table_and_png(report, path)
    return 0


def write_table_and_png(report: dict, path: Path) -> list[Path]:
    """Print the README table (kvcap.bench.throughput_report) of each shape measured and
    write its bar chart next to the JSON: the same stem with .png (-SHAPE.png per shape where
    there are several). Without matplotlib, a warning and no PNG: the JSON is what counts."""
    from kvcap.bench import throughput_report

    cells = throughput_report.cells_from_report(report, path.name)
    shapes = list(dict.fromkeys(c["shape"] for c in cells))
    written = []
    for shape in shapes:
        print(f"\n{throughput_report.markdown_table(cells, shape)}")
        png = path.with_suffix(".png") if len(shapes) == 1 else path.with_name(
            f"{path.stem}-{shape}.png")
        try:
            written.append(throughput_report.plot(cells, png, shape=shape))
        except ImportError as e:
            logger.warning("no throughput PNG (matplotlib is not available: %s)", e)
            continue
        print(f"wrote {png}")
    return written


def _save(report: dict, path: Path) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)


def _mark_fp8_only(report: dict) -> None:
    fp16_skips = {(c["shape"], c["concurrency"], c["context"]) for c in report["cells"]
                  if c["kv"] == "fp16" and "skip" in c}
    for c in report["cells"]:
        key = (c["shape"], c["concurrency"], c["context"])
        c["fits_only_in_e4m3"] = c["kv"] != "fp16" and "skip" not in c and key in fp16_skips


def _print_table(report: dict) -> None:
    print(f"\n{report['gpu']}  read ceiling {report['read_ceiling_tbs']:.2f} TB/s")
    print(f"{'shape':14} {'kv':13} {'conc':>4} {'ctx':>7} {'decode tok/s':>12} {'TTFT s':>7} "
          f"{'e2e s':>7} {'roofline':>8} {'SM MHz':>7}")
    for c in report["cells"]:
        if "skip" in c:
            print(f"{c['shape']:14} {c['kv']:13} {c['concurrency']:>4} {c['context']:>7}  skip: "
                  f"{c['skip']}")
        else:
            print(f"{c['shape']:14} {c['kv']:13} {c['concurrency']:>4} {c['context']:>7} "
                  f"{c['decode_tok_s']:12.1f} {c['ttft_s']:7.2f} {c.get('e2e_s') or 0:7.2f} "
                  f"{c['roofline_fraction']:8.2f} "
                  f"{c.get('sm_mhz') or '-':>7}")
    for cap in report["capacity"]:
        print(f"capacity {cap['shape']} {cap['kv']}: {cap['tokens']:,} tokens")
    for h in report["hf_baseline"]:
        print(f"HF generate {h['shape']} B={h['batch']} ctx={h['context']}: "
              f"{h['tok_s']:.1f} tok/s end to end, decode {h['decode_tok_s']:.1f} tok/s")


if __name__ == "__main__":
    raise SystemExit(main())

