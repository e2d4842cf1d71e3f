"""Needle retrieval with the training-free indexer vs dense attention on a real model.

    python -m kvcap.qsa.needle [--model default] [--context 2048] [--topk 128]
        [--first-dense 2] [--summary minmax] [--head-reduce sum] [--depths 0,25,50,75,100]
        [--every 8] [--out docs/benchmarks/qsa-needle-DATE.json]

Two LLMs over the same checkpoint: dense, and QSA on every layer from `first_dense` on
(top-k groups of 4 plus the tail). Passkey cases (kvcap.eval.retrieval) at each depth, greedy
decoding of MAX_NEW_TOKENS; per case both arms' texts and pass/fail. While the QSA arm runs,
a MassRecallProbe records per layer the dense attention mass (from that arm's own q and K)
that its selections capture (rows with more than k groups; positions subsampled by `every`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
from pathlib import Path

from kvcap.commands.common import non_negative_int, percent_list, positive_int
from kvcap.errors import ConfigError
from kvcap.qsa.config import QSAConfig
from kvcap.qsa.enable import check_budget
from kvcap.qsa.quality import MassRecallProbe
from kvcap.scales.fsutil import atomic_write_text

logger = logging.getLogger(__name__)


def run_needle(dense, qsa, config: QSAConfig, context: int, depths: list[int],
               every: int = 8) -> dict:
    """`dense`, `qsa`: LLMs on the same checkpoint, QSA already enabled on `qsa`
    (kvcap.qsa.enable). Returns {"cases": [...], "recall": {layer: mass recall}, ...}."""
    from kvcap.eval.retrieval import MAX_NEW_TOKENS, build_cases, score
    from kvcap.sampling_params import SamplingParams

    cases = build_cases(dense.tokenizer, ["passkey"], [context], depths)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
    probe = MassRecallProbe(config.topk_groups, config.compress_ratio, every=every)
    qsa.runner.backend.probe = probe
    rows = []
    try:
        for case in cases:
            out = {}
            for name, llm in (("dense", dense), ("qsa", qsa)):
                res = llm.generate([case.prompt_ids], params, use_tqdm=False)[0]
                out[name] = {"text": res.text, "pass": score(case, res.text),
                             "token_ids": res.token_ids}
            rows.append({"case": case.case_id, "depth": case.depth, "answer": case.answer,
                         **out, "same_tokens": out["dense"]["token_ids"]
                         == out["qsa"]["token_ids"]})
            logger.info("%s dense=%s qsa=%s (%r / %r)", case.case_id, out["dense"]["pass"],
                        out["qsa"]["pass"], out["dense"]["text"], out["qsa"]["text"])
    finally:
        qsa.runner.backend.probe = None
    recall = {int(k): v for k, v in probe.report().items()}
    return {"context": context, "topk_groups": config.topk_groups,
            "token_budget": config.token_budget, "qsa_layers": sorted(qsa.runner.backend.layers),
            "summary": config.summary, "head_reduce": config.head_reduce, "cases": rows,
            "dense_passed": sum(r["dense"]["pass"] for r in rows),
            "qsa_passed": sum(r["qsa"]["pass"] for r in rows),
            # no counted row (a budget covering the context: QSA selected everything) is no
            # measurement, not a recall of 0
            "recall": recall,
            "recall_mean": sum(recall.values()) / len(recall) if recall else None}


def build_pair(model: str, context: int, config: QSAConfig):
    """(dense LLM, QSA LLM) on the CPU-friendly torch backend, sized for one case."""
    from kvcap import LLM
    from kvcap.qsa.enable import enable_qsa

    kw = dict(model=model, enable_prefix_caching=False, max_num_batched_tokens=context,
              max_model_len=context + 16, num_blocks=-(-(context + 16) // 16) + 1)
    dense, qsa = LLM(**kw), LLM(**kw)
    enable_qsa(qsa, config)
    return dense, qsa


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # (every argument is checked before the two models load: a bad --depths was a ValueError
    # traceback after both had)
    ap.add_argument("--model", default="default")
    ap.add_argument("--context", type=positive_int, default=2048)
    ap.add_argument("--topk", type=positive_int, default=128)
    ap.add_argument("--first-dense", type=non_negative_int, default=2)
    ap.add_argument("--summary", default="minmax")
    ap.add_argument("--head-reduce", default="sum")
    ap.add_argument("--depths", type=percent_list, default="0,25,50,75,100")
    ap.add_argument("--every", type=positive_int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    try:
        cfg = QSAConfig(layer_rule="all_but_first", first_dense=args.first_dense,
                        topk_groups=args.topk, summary=args.summary,
                        head_reduce=args.head_reduce).validate()
        # enable_qsa refuses a budget past build_pair's max_model_len: a traceback after
        # both models had loaded
        check_budget(cfg, args.context + 16)
    except ValueError as e:
        ap.error(str(e))
    try:
        dense, qsa = build_pair(args.model, args.context, cfg)
        res = run_needle(dense, qsa, cfg, args.context, args.depths, args.every)
    except ConfigError as e:
        # --first-dense past the model's layers, a --context too short for a passkey case:
        # one usage line, not a traceback
        ap.error(str(e))
    res["date"] = datetime.date.today().isoformat()
    mean = res["recall_mean"]
    logger.info("dense %d/%d, qsa %d/%d, mean mass recall %s", res["dense_passed"],
                len(res["cases"]), res["qsa_passed"], len(res["cases"]),
                "n/a (no row had more than --topk groups)" if mean is None else f"{mean:.4f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.out), json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
