"""Measure training-free indexer designs: recall of the exact attention mass on a real model.

    python -m kvcap.qsa.recall [--model default] [--context 2048] [--budgets 128,64]
        [--depths 50] [--every 8] [--out docs/benchmarks/qsa-recall-DATE.json]

The model runs dense (kvcap.qsa.quality.ShadowSelect), so every candidate sees the same q/k;
on every layer each candidate (summary mean|minmax x head reduction sum|max x top-k budget)
keeps its own side caches and selects, and the probe adds up the dense softmax mass that
falls on the selected tokens, per query head and row, over rows that had more than k groups
to choose from (subsampled: positions p with p % every == every - 1). Prompts are the
passkey retrieval cases of kvcap.eval.retrieval at the given depths. Writes per-layer
recall per candidate and prints a summary line per candidate.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
from pathlib import Path

import torch

from kvcap.commands.common import percent_list, positive_int, positive_int_list
from kvcap.errors import ConfigError
from kvcap.qsa.config import QSAConfig
from kvcap.qsa.indexer import QSASideCaches
from kvcap.qsa.quality import MassRecallProbe, ShadowSelect
from kvcap.scales.fsutil import atomic_write_text

logger = logging.getLogger(__name__)

DESIGNS = [("mean", "sum"), ("mean", "max"), ("minmax", "sum"), ("minmax", "max")]


def build_candidates(llm, budgets: list[int], designs=DESIGNS) -> dict:
    from kvcap.qsa.backend import QSABackend

    pool = llm.pool
    cspec = pool.spec
    layers = tuple(range(llm.spec.num_layers))
    out = {}
    for k in budgets:
        for summary, reduce in designs:
            cfg = QSAConfig(layer_rule="explicit", layers=layers, topk_groups=k,
                            summary=summary, head_reduce=reduce, path="torch")
            side = QSASideCaches(layers, pool.num_blocks, cspec.block_size, 4,
                                 cspec.num_kv_heads, cspec.head_dim, torch.float16,
                                 pool.device, bounds=summary == "minmax")
            out[f"{summary}-{reduce}-k{k}"] = QSABackend(llm.runner.backend, cfg, side,
                                                         pool.device)
    return out


def measure(llm, prompts: list[list[int]], budgets: list[int], every: int) -> dict:
    """Per candidate: {"layers": {layer: recall}, "mean": ..., "mean_from_layer_2": ... (None
    without a layer past 1)}."""
    from kvcap.sampling_params import SamplingParams

    cands = build_candidates(llm, budgets)
    probes = {name: MassRecallProbe(c.config.topk_groups, every=every)
              for name, c in cands.items()}

    def probe(name, layer, q, cache, meta, tokens, scale):
        probes[name](layer, q, cache, meta, tokens, scale)

    dense = llm.runner.backend
    llm.runner.backend = ShadowSelect(dense, cands, probe)
    try:
        for p in prompts:
            llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    finally:
        llm.runner.backend = dense
    res = {}
    for name, pr in probes.items():
        per = {int(k): v for k, v in pr.report().items()}
        if not per:
            # recall is counted only on rows with more than k groups to choose from: a budget
            # covering every prompt has none (this was a ZeroDivisionError)
            cfg = cands[name].config
            k = cfg.topk_groups
            longest = max(map(len, prompts), default=0)
            raise ConfigError(f"budget {k} groups ({cfg.compress_ratio * k} tokens) covers "
                              f"every row of the prompts (longest {longest} tokens): nothing "
                              "to measure; use a smaller budget or a longer context")
        vals = [per[k] for k in sorted(per)]
        late = [per[k] for k in sorted(per) if k >= 2]
        # (None on a model under 3 layers, or with QSA on layers 0-1 only: no such layer,
        # once a ZeroDivisionError after the whole run)
        res[name] = {"layers": per, "mean": sum(vals) / len(vals),
                     "mean_from_layer_2": sum(late) / len(late) if late else None,
                     "min": min(vals)}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    # (checked before the model loads: a bad --depths or --budgets was a traceback after it)
    ap.add_argument("--context", type=positive_int, default=2048)
    ap.add_argument("--budgets", type=positive_int_list, default="128,64",
                    help="top-k groups (x4 tokens)")
    ap.add_argument("--depths", type=percent_list, default="50")
    ap.add_argument("--every", type=positive_int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    # rows choose only past k complete groups: refuse budgets covering the context before
    # the model loads (measure() checks the real prompts too)
    ratio = QSAConfig().compress_ratio
    covering = [k for k in args.budgets if args.context // ratio <= k]
    if covering:
        ap.error(f"--budgets {','.join(map(str, covering))} (groups of {ratio}) cover the "
                 f"whole --context {args.context}: no row would choose; use budgets below "
                 f"{args.context // ratio}")
    logging.basicConfig(level=logging.INFO)
    from kvcap import LLM
    from kvcap.eval.retrieval import build_cases

    torch.set_grad_enabled(False)
    llm = LLM(model=args.model, attention_backend="torch", enable_prefix_caching=False,
              max_num_batched_tokens=args.context, max_model_len=args.context + 16,
              num_blocks=-(-(args.context + 16) // 16) + 1)
    depths, budgets = args.depths, args.budgets
    try:
        cases = build_cases(llm.tokenizer, ["passkey"], [args.context], depths)
        res = measure(llm, [c.prompt_ids for c in cases], budgets, args.every)
    except ConfigError as e:  # a context too short for a passkey case, a budget covering
        ap.error(str(e))      # the real prompts: one usage line, not a traceback
    for name, r in res.items():
        late = r["mean_from_layer_2"]
        logger.info("%-18s mean %.4f  mean(layers>=2) %s  min %.4f", name, r["mean"],
                    "n/a" if late is None else f"{late:.4f}", r["min"])
    doc = {"date": datetime.date.today().isoformat(), "model": args.model,
           "context": args.context, "depths": depths, "every": args.every,
           "budgets_groups": budgets, "candidates": res}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.out), json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
