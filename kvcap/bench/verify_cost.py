"""What verifying speculative drafts costs a decode step, by route: graphed decode rows vs the
eager chunk, against a plain one-token step, at real model sizes and contexts.

    python -m kvcap.bench.verify_cost --shape llama-3.1-8b --batches 1 16 \
        --contexts 1024 4096 16384 --k 4 --out docs/benchmarks/

Per (batch, context) the requests are prefilled once with random prompts, then three arms run
on them in turn, `--steps` engine steps each after a few untimed ones: no drafts (the plain
decode step, overlapped as in production), drafts verified as decode rows
(KVCAP_SPEC_VERIFY=rows) and as one chunk (=chunk). The drafts come from a stand-in proposer
that always offers K tokens (with dummy weights prompt lookup would find nothing), so the
verify work per step is fixed; every draft is then rejected, which changes what a step yields,
not what it costs. The result is milliseconds per step per arm and the rows' K/V re-reads (in
bytes, and in K/V values: the quantity `SPEC_ROWS_MAX_EXTRA_KV_VALUES` bounds); where rows
stop beating the chunk is the bound to set.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from pathlib import Path

import torch

from kvcap.bench.provenance import result_path, stamp
from kvcap.bench.throughput import SHAPES, _sync, calibrated_scales
from kvcap.commands.common import positive_int, require_cuda
from kvcap.scales.fsutil import atomic_write_text

ARMS = ("plain", "rows", "chunk")


class AlwaysDraft:
    """A proposer that offers K copies of the request's last token, whatever it is."""

    def __init__(self, k: int):
        self.num_tokens = k

    def propose(self, req, limit: int) -> list[int]:
        return [req.output_token_ids[-1] if req.output_token_ids
                else req.prompt_token_ids[-1]] * min(limit, self.num_tokens)

    def forget(self, request_id: str) -> None:
        pass


def tokens_per_request(k: int, warmup: int, steps: int) -> int:
    """Output tokens a cell's request may take: every arm's steps, each keeping all K drafts."""
    return len(ARMS) * (warmup + steps) * (k + 1) + 8


def rows_reread_tokens(batch: int, context: int, k: int) -> int:
    """The K/V tokens the decode-row route reads beyond the chunk's, per step (see
    ModelRunner._draft_rows): each request's rows 1..K re-read its context."""
    return batch * k * (context + (k + 1) // 2)


def time_arm(llm, arm: str, k: int, warmup: int, steps: int) -> float:
    """Milliseconds per engine step with the arm's drafts (none for "plain")."""
    eng = llm.engine
    eng.scheduler.proposer = None if arm == "plain" else AlwaysDraft(k)
    if arm != "plain":
        llm.runner.verify_route = arm
    for _ in range(warmup):
        eng.step()
    _sync(llm)
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    _sync(llm)
    return (time.perf_counter() - t) * 1e3 / steps


def run_cell(llm, batch: int, context: int, k: int, warmup: int, steps: int) -> dict:
    from kvcap import SamplingParams

    eng = llm.engine
    gen = torch.Generator().manual_seed(batch * 100003 + context)
    params = SamplingParams(max_tokens=tokens_per_request(k, warmup, steps), ignore_eos=True,
                            temperature=0)
    for i in range(batch):
        ids = torch.randint(0, llm.spec.vocab_size, (context,), generator=gen).tolist()
        eng.add_request(f"c{batch}x{context}-{i}", ids, params, stream=False)
    eng.scheduler.proposer = None  # prompts that take several steps get no drafts meanwhile
    while any(not r.output_token_ids for r in list(eng.requests.values())):
        eng.step()  # prefill every prompt (and a first token each)
    ms = {arm: round(time_arm(llm, arm, k, warmup, steps), 3) for arm in ARMS}
    for rid in list(eng.requests):
        eng.abort_request(rid)
    while eng.has_unfinished():
        eng.step()
    reread = rows_reread_tokens(batch, context, k)
    spec = llm.pool.spec
    return {"batch": batch, "context": context, "k": k, "ms_per_step": ms,
            "rows_over_chunk": round(ms["rows"] / ms["chunk"], 3),
            "rows_reread_gib": round(reread * spec.bytes_per_token / 2**30, 3),
            "rows_reread_gi_values": round(reread * spec.values_per_token / 2**30, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=list(SHAPES))
    ap.add_argument("--batches", type=positive_int, nargs="+", default=[1, 16])
    ap.add_argument("--contexts", type=positive_int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--k", type=positive_int, default=4)
    ap.add_argument("--kv", default="fp16", choices=["fp16", "fp8"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--warmup", type=positive_int, default=3)
    ap.add_argument("--steps", type=positive_int, default=10)
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args(argv)
    require_cuda(ap, "; the verify routes differ only where decode graphs run")
    logging.basicConfig(level=logging.WARNING)
    from kvcap import LLM

    model = SHAPES[args.shape]
    fp8 = args.kv == "fp8"
    scales = calibrated_scales(model, args.dtype) if fp8 else None
    budget = tokens_per_request(args.k, args.warmup, args.steps)
    llm = LLM(model=model, dtype=args.dtype, kv_cache_dtype="fp8_e4m3" if fp8 else "auto",
              kv_scales=scales, max_num_seqs=max(args.batches),
              max_model_len=max(args.contexts) + budget + 16, max_num_batched_tokens=8192,
              num_speculative_tokens=args.k)
    cells = []
    for batch in args.batches:
        for context in args.contexts:
            if batch * (context + budget) > llm.pool.num_tokens:
                print(f"skip {batch} x {context}: {llm.pool.num_tokens} tokens of KV pool")
                continue
            cells.append(run_cell(llm, batch, context, args.k, args.warmup, args.steps))
            c = cells[-1]
            print(f"{batch:>3} x {context:>6}  plain {c['ms_per_step']['plain']:8.2f} ms  rows "
                  f"{c['ms_per_step']['rows']:8.2f}  chunk {c['ms_per_step']['chunk']:8.2f}  "
                  f"rows/chunk {c['rows_over_chunk']:.2f}  re-read {c['rows_reread_gib']} GiB "
                  f"({c['rows_reread_gi_values']} Gi values)")
    result = {"bench": "verify_cost", "date": time.strftime("%Y-%m-%d"),
              "gpu": torch.cuda.get_device_name(), **stamp(), "shape": args.shape,
              "kv": args.kv, "dtype": args.dtype, "k": args.k, "warmup": args.warmup,
              "steps": args.steps, "bytes_per_token": llm.pool.spec.bytes_per_token,
              "cells": cells}
    out = result_path(Path(args.out), f"verify-cost-{result['date']}")
    atomic_write_text(out, json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    del llm
    gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
