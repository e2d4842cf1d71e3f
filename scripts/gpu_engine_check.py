"""GPU engine checks (run on the H200): Triton vs torch backend and CUDA graphs vs eager on the
embedded model (greedy tokens), E4M3 end to end, then print a short table. JSON to $OUT."""

from __future__ import annotations

import json
import os
import time

import torch

from kvcap import LLM, SamplingParams
from kvcap.bench.provenance import stamp

PROMPTS = ["The capital of France is", "def quicksort(arr):", "Once upon a time,",
           "List three primary colors:", "The quick brown fox", "In mathematics, a prime is",
           "Water boils at", "The history of computing spans centuries. " * 20]


def greedy(llm, n=64, logprobs=True):
    """(greedy tokens, each step's top-1 minus top-2 logprob, seconds) per prompt."""
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    t = time.perf_counter()
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                            logprobs=2 if logprobs else None), use_tqdm=False)
    dt = time.perf_counter() - t
    margins = [[(lambda v: round(v[0] - v[1], 5) if len(v) > 1 else None)(
        sorted(lp.values(), reverse=True)) for lp in (o.logprobs or [])] for o in outs]
    return [o.token_ids for o in outs], margins, dt


def divergences(ref, ref_margins, run, run_margins):
    """Per prompt: None when identical, else the first differing step and both margins there
    (a near-tie shows as a margin near 0 in the reference run)."""
    out = []
    for a, b, ma, mb in zip(ref, run, ref_margins, run_margins, strict=True):
        i = first_div(a, b)
        out.append(None if i is None else {
            "step": i, "ref_margin": ma[i] if i < len(ma) else None,
            "margin": mb[i] if i < len(mb) else None})
    return out


def first_div(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


res = {}
common = dict(model="default", dtype="float16", kv_cache_memory_gib=4, max_num_seqs=16)
ref, ref_m, _ = greedy(LLM(attention_backend="torch", enforce_eager=True, **common))
eager, eager_m, _ = greedy(LLM(attention_backend="triton", enforce_eager=True, **common))
llm = LLM(attention_backend="triton", **common)
graph, _, t_graph = greedy(llm)
res["triton_eager_vs_torch_identical"] = sum(a == b for a, b in zip(ref, eager, strict=True))
res["triton_eager_vs_torch_first_div"] = divergences(ref, ref_m, eager, eager_m)
res["graph_vs_eager_identical"] = sum(a == b for a, b in zip(eager, graph, strict=True))
res["graph_s_8x64"] = t_graph
# Overlap (a decode step launched before the previous step's tokens are read) vs the serial
# loop, both with graphs; sampled requests too (seeded), where the device feed matters most.
sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, max_tokens=48)
ids = [llm.tokenizer.encode(p) for p in PROMPTS]
runs = {}
for overlap in (True, False):
    llm.engine.overlap = overlap
    ahead0 = llm.engine.num_steps_ahead
    toks, _, dt = greedy(llm, logprobs=False)  # (logprobs turn the overlap off)
    smp = [o.token_ids for o in llm.generate(ids, sampled, use_tqdm=False)]
    runs[overlap] = (toks, smp, dt, llm.engine.num_steps_ahead - ahead0)
llm.engine.overlap = True
res["overlap_vs_serial_greedy_identical"] = sum(
    a == b for a, b in zip(runs[True][0], runs[False][0], strict=True))
res["overlap_vs_serial_sampled_identical"] = sum(
    a == b for a, b in zip(runs[True][1], runs[False][1], strict=True))
res["overlap_steps_ahead"] = runs[True][3]
res["overlap_s_8x64"], res["serial_s_8x64"] = runs[True][2], runs[False][2]
print(repr(llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=20))[0].text))
res = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
       **stamp()} | res
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "engine_check.json"), "w") as f:
    json.dump(res, f, indent=1)
print(json.dumps(res))
