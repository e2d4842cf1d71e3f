"""Speculative decoding by prompt lookup: ``python -m kvcap.bench.speculative [--device D]``.

For each number of draft tokens K (0 = off) and each concurrency, generates the same requests
greedily and reports decode tokens per second, the speed-up over K = 0, the share of drafts the
model kept and the output tokens per engine step. Correctness first: every K must give the
token ids of K = 0, or the run stops with an error.

Tasks (chat-templated for the instruct model; text from what is installed, recorded in the
JSON): `code_edit` (a stdlib function's source, asked to be returned with a docstring added:
the answer copies most of the prompt), `list_copy` (a generated inventory asked back in
another order), and `open_story` (free writing: few drafts are right, so this measures what
wrong drafts cost). JSON (date, commit, device) to docs/benchmarks/speculative-<date>.json
(``-2``, ... when taken) or the ``--out`` file.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import platform
import random
import textwrap
import time
from pathlib import Path

import torch

from kvcap.bench.provenance import result_path, stamp
from kvcap.commands.common import (
    non_negative_int_list,
    positive_float,
    positive_int,
    positive_int_list,
    set_threads,
)
from kvcap.errors import ConfigError
from kvcap.scales.fsutil import atomic_write_text


def tasks() -> dict[str, tuple[str, str]]:
    """name -> (user message, where its text came from)."""
    src = inspect.getsource(textwrap.indent)
    rng = random.Random(0)
    items = [f"{name}: {rng.randrange(1, 40)} units at shelf {rng.choice('ABCDEF')}"
             f"{rng.randrange(1, 9)}" for name in ("bolts", "nuts", "washers", "hinges",
                                                   "brackets", "springs", "rivets", "clamps")]
    return {
        "code_edit": ("Add a one-line comment above every statement of this Python function "
                      "and return the whole function:\n\n" + src,
                      f"textwrap.indent from the stdlib ({inspect.getsourcefile(textwrap)})"),
        "list_copy": ("Here is an inventory:\n" + "\n".join(items) +
                      "\n\nWrite the same inventory again, sorted by name, one item per line.",
                      "generated (random.Random(0))"),
        "open_story": ("Write a short story about a lighthouse keeper who finds a map.",
                       "fixed instruction"),
    }


def _generate(llm, prompts, params) -> tuple[list[list[int]], float, int]:
    steps = 0
    step = llm.engine.step

    def counted():
        nonlocal steps
        steps += 1
        return step()

    llm.engine.step = counted
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.sync()
        dt = time.perf_counter() - t0
    finally:
        del llm.engine.step
    return [o.token_ids for o in outs], dt, steps


def _agreement(ids: list[list[int]], ref: list[list[int]]) -> dict:
    """How far these outputs agree with K=0's: whole requests, and the first differing token."""
    def first_diff(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    None if len(a) == len(b) else min(len(a), len(b)))
    diffs = [d for d in map(first_diff, ids, ref) if d is not None]
    return {"requests_equal": len(ids) - len(diffs),
            "first_difference": min(diffs) if diffs else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda if present)")
    ap.add_argument("--k", type=non_negative_int_list, default="0,2,4,8",
                    help="draft tokens per step to compare, comma-separated, 0 (no drafts) first "
                         "(default 0,2,4,8)")
    ap.add_argument("--concurrency", type=positive_int_list, default="1,4",
                    help="requests decoded together")
    ap.add_argument("--max-tokens", type=positive_int, default=128)
    ap.add_argument("--repeats", type=positive_int, default=1,
                    help="scored repeats (the best counts)")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    ap.add_argument("--kv-cache-memory-gib", type=positive_float, default=1.0,
                    help="each engine's KV pool (default 1 GiB: ample for these requests)")
    ap.add_argument("--dtype", default="auto",
                    help="model dtype (default: the engine's; float32 makes the check exact)")
    ap.add_argument("--exact", action="store_true",
                    help="fail when any K changes a token (right in float32; in 16-bit a verify "
                         "chunk's GEMMs round differently from one-token decode, so a near-tie "
                         "may flip: then the rows only record how far outputs agree)")
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args(argv)
    from kvcap import LLM, SamplingParams

    ks = args.k
    if ks[0] != 0:
        raise ConfigError("--k must start with 0: the run without drafts is the reference")
    conc = args.concurrency
    set_threads(args.threads)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows, ref = [], {}
    for k in ks:
        llm = LLM(model=args.model, device=args.device, num_speculative_tokens=k,
                  max_model_len=2048, max_num_seqs=max(conc),
                  kv_cache_memory_gib=args.kv_cache_memory_gib, dtype=args.dtype)
        if llm.tokenizer is None:
            raise ConfigError(f"the speculative bench needs a model with a tokenizer and a chat "
                              f"template (its tasks are text), not {args.model!r}")
        prompts = {name: llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
            for name, (text, _) in tasks().items()}
        _generate(llm, [prompts["open_story"]], SamplingParams(temperature=0, max_tokens=8))
        for name, prompt in prompts.items():
            for c in conc:
                d0, a0 = llm.engine.num_draft_tokens, llm.engine.num_accepted_tokens
                best = None
                for _ in range(args.repeats):
                    ids, dt, steps = _generate(llm, [prompt] * c, params)
                    best = dt if best is None else min(best, dt)
                drafted = (llm.engine.num_draft_tokens - d0) / args.repeats
                kept = (llm.engine.num_accepted_tokens - a0) / args.repeats
                key = (name, c)
                if k == 0:
                    ref[key] = ids
                agree = _agreement(ids, ref[key])
                # The same prompt decoded alone without drafts: batching alone moves 16-bit
                # rounding too, which puts the speculative differences in proportion.
                alone = ref.get((name, min(conc)))
                agree["requests_equal_alone"] = (
                    None if alone is None or len(alone) != 1
                    else _agreement(ids, alone * c)["requests_equal"])
                if args.exact and agree["requests_equal"] < c:
                    raise AssertionError(f"K={k} changed the output of {name} x {c}")
                tokens = sum(map(len, ids))
                row = {"task": name, "concurrency": c, "k": k, "seconds": round(best, 3),
                       "output_tokens": tokens, "tok_s": round(tokens / best, 1),
                       "steps": steps, "tokens_per_step_per_request": round(tokens / steps / c,
                                                                              2),
                       "drafted": drafted, "kept": kept,
                       "acceptance": round(kept / drafted, 3) if drafted else None, **agree}
                rows.append(row)
        llm_dtype = str(llm.dtype).removeprefix("torch.")
        del llm  # one model (and KV pool) in memory at a time
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for r in rows:
        base = next(b for b in rows if b["k"] == 0 and b["task"] == r["task"]
                    and b["concurrency"] == r["concurrency"])
        r["speedup"] = round(r["tok_s"] / base["tok_s"], 3)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev_name = torch.cuda.get_device_name() if device.startswith("cuda") else (
        f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}")
    date = datetime.date.today().isoformat()
    result = {"bench": "speculative", "date": date, **stamp(), "device": dev_name,
              "model": args.model, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "dtype": llm_dtype, "exact": args.exact, "greedy": True,
              "prompt_lookup": {"max": 4, "min": 2},
              "tasks": {n: src for n, (_, src) in tasks().items()}, "rows": rows}
    out = result_path(Path(args.out), f"speculative-{date}")
    atomic_write_text(out, json.dumps(result, indent=1) + "\n")
    print(f"speculative decoding by prompt lookup, {args.model} ({llm_dtype}) on {dev_name}; "
          f"same = requests whose tokens equal K=0's, alone = equal to the prompt decoded alone "
          f"with K=0")
    print(f"{'task':>10} {'conc':>4} {'K':>2} {'tok/s':>8} {'speedup':>7} {'accept':>6} "
          f"{'tok/step':>8} {'same':>5} {'alone':>5}")
    for r in rows:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        print(f"{r['task']:>10} {r['concurrency']:>4} {r['k']:>2} {r['tok_s']:>8.1f} "
              f"{r['speedup']:>7.2f} {acc:>6} {r['tokens_per_step_per_request']:>8.2f} "
              f"{r['requests_equal']:>2}/{r['concurrency']:<2} "
              f"{r['requests_equal_alone'] if r['requests_equal_alone'] is not None else '-':>5}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
