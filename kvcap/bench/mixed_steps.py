"""What steps that the decode graphs cannot take cost -- prompts arriving while others decode --
with and without piecewise CUDA graphs (kvcap.engine.piecewise_graph).

    python -m kvcap.bench.mixed_steps --shape llama-3.1-8b --decoders 0 16 \
        --prompts 16 128 512 --context 1024 --out docs/benchmarks/

Per arm ("pieces": the default engine; "eager": KVCAP_DISABLE_PIECEWISE_GRAPHS=1, the engine
before the pieces) one engine is built; per cell, `decoders` requests of `context` random
tokens are prefilled and decode, then every timed step admits one new request of `prompt`
random tokens (max_tokens 1), so each timed step is a mixed step: the decode rows plus that
prompt's prefill (with no decoders: back-to-back prefills, the time to first token of short
prompts). The result is milliseconds per step per arm (the mean of its runs; by default the
arms alternate, pieces / eager / eager / pieces), eager / pieces, and each timed forward's
rows and route (decode graph, pieces, or eager past the largest bucket).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import logging
import os
import time
from pathlib import Path

import torch

from kvcap.bench.provenance import result_path, stamp
from kvcap.bench.throughput import SHAPES, _sync
from kvcap.commands.common import positive_int, require_cuda
from kvcap.engine.piecewise_graph import DISABLE_ENV
from kvcap.scales.fsutil import atomic_write_text

ARMS = {"pieces": "0", "eager": "1"}  # arm -> KVCAP_DISABLE_PIECEWISE_GRAPHS


def run_cell(llm, decoders: int, context: int, prompt: int, warmup: int, steps: int
             ) -> tuple[float, list[tuple[int, str]]]:
    """Milliseconds per step while every step admits a new `prompt`-token request beside
    `decoders` decoding requests of `context` tokens, and each timed forward's (rows, route:
    graph | pieces | eager)."""
    from kvcap import SamplingParams

    eng = llm.engine
    gen = torch.Generator().manual_seed(decoders * 7919 + context + prompt)
    vocab = llm.spec.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    long = SamplingParams(max_tokens=4 * (warmup + steps) + 16, ignore_eos=True, temperature=0)
    for i in range(decoders):
        eng.add_request(f"d{decoders}x{prompt}-{i}", ids(context), long, stream=False)
    while any(not r.output_token_ids for r in list(eng.requests.values())):
        eng.step()
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    arrivals = iter(range(10**9))

    def mixed_step() -> None:
        eng.add_request(f"p{decoders}x{prompt}-{next(arrivals)}", ids(prompt), one,
                        stream=False)
        eng.step()

    for _ in range(warmup):
        mixed_step()
    _sync(llm)
    runner = llm.runner
    forward, kinds = runner._forward, []

    def recorded(plan, *args):  # what each timed step ran: rows, and graph / pieces / eager
        pw = runner.piecewise
        pieces = (not plan.use_graph and pw is not None and runner.kv_observer is None
                  and pw.can_run(len(plan.ids)))
        kinds.append((len(plan.ids), "graph" if plan.use_graph else
                      "pieces" if pieces else "eager"))
        return forward(plan, *args)

    runner._forward = recorded
    try:
        t = time.perf_counter()
        for _ in range(steps):
            mixed_step()
        _sync(llm)
        ms = (time.perf_counter() - t) * 1e3 / steps
    finally:
        del runner._forward
    for rid in list(eng.requests):
        eng.abort_request(rid)
    while eng.has_unfinished():
        eng.step()
    return ms, kinds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=list(SHAPES))
    ap.add_argument("--decoders", type=int, nargs="+", default=[0, 16])
    ap.add_argument("--prompts", type=positive_int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--context", type=positive_int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--warmup", type=positive_int, default=4)
    ap.add_argument("--steps", type=positive_int, default=16)
    ap.add_argument("--arms", nargs="+", choices=list(ARMS),
                    default=["pieces", "eager", "eager", "pieces"],
                    help="arms in the order they run, each building its own engine; an arm "
                         "named more than once is averaged (the default alternates them: "
                         "the first engine of a process measured up to 1.3x slower)")
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args(argv)
    require_cuda(ap, "; piecewise graphs are CUDA graphs")
    if min(args.decoders) < 0:
        ap.error("--decoders must be >= 0")
    logging.basicConfig(level=logging.WARNING)
    from kvcap import LLM

    runs: dict[tuple[int, int], dict[str, list[float]]] = {}
    routes: dict[tuple[int, int], dict[str, list]] = {}
    before = os.environ.get(DISABLE_ENV)
    try:
        for arm in args.arms:
            os.environ[DISABLE_ENV] = ARMS[arm]  # read when the engine captures its graphs
            llm = LLM(model=SHAPES[args.shape], dtype=args.dtype,
                      max_num_seqs=max(args.decoders) + 1,
                      max_model_len=(max(args.context, *args.prompts)
                                     + 4 * (args.warmup + args.steps) + 64),
                      max_num_batched_tokens=8192)
            if (llm.runner.piecewise is None) != (arm == "eager"):
                raise SystemExit(f"arm {arm}: piecewise graphs "
                                 f"{'missing' if arm == 'pieces' else 'present'}")
            for d in args.decoders:
                for p in args.prompts:
                    t, kinds = run_cell(llm, d, args.context, p, args.warmup, args.steps)
                    runs.setdefault((d, p), {}).setdefault(arm, []).append(round(t, 3))
                    routes.setdefault((d, p), {})[arm] = kinds
                    seen = collections.Counter(f"{rows} rows {route}" for rows, route in kinds)
                    print(f"{arm:>6}  {d:>3} decoding + {p:>4}-token prompt: {t:8.2f} ms/step  "
                          f"({', '.join(f'{n} x {k}' for k, n in seen.items())})", flush=True)
            llm.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        if before is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = before
    ms = {cell: {arm: round(sum(ts) / len(ts), 3) for arm, ts in arms.items()}
          for cell, arms in runs.items()}
    cells = [{"decoders": d, "context": args.context, "prompt": p, "ms_per_step": arms,
              "eager_over_pieces": (round(arms["eager"] / arms["pieces"], 3)
                                    if len(arms) == 2 else None),
              "runs_ms": runs[(d, p)],
              "forwards": {arm: [list(k) for k in ks] for arm, ks in routes[(d, p)].items()}}
             for (d, p), arms in ms.items()]
    result = {"bench": "mixed_steps", "date": time.strftime("%Y-%m-%d"),
              "gpu": torch.cuda.get_device_name(), **stamp(), "shape": args.shape,
              "dtype": args.dtype, "warmup": args.warmup, "steps": args.steps, "cells": cells}
    out = result_path(Path(args.out), f"mixed-steps-{result['date']}")
    atomic_write_text(out, json.dumps(result, indent=1) + "\n")
    print("decoders  prompt   pieces ms    eager ms   eager/pieces")
    for c in cells:
        a = c["ms_per_step"]
        ratio = c["eager_over_pieces"]
        print(f"{c['decoders']:>8} {c['prompt']:>7} {a.get('pieces', float('nan')):>11.2f} "
              f"{a.get('eager', float('nan')):>11.2f} "
              f"{ratio if ratio is not None else float('nan'):>13.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
