"""Greedy generation A/B: first-token equality, sequence identity and first divergence, on
held-out plain and chat prompts; and the long-context retrieval grid with paired outcomes."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcap.eval import metrics, retrieval, sources, synth
from kvcap.eval.ab import greedy_all
from kvcap.eval.corpora import record_hash
from kvcap.models.text_prompt import encode_prompt

logger = logging.getLogger(__name__)

PLAIN_PROMPT_TOKENS = 64


@dataclass(frozen=True)
class Prompt:
    kind: str  # "plain" | "chat" | "tool"
    ids: list[int] = field(repr=False)
    provenance: dict[str, Any] = field(default_factory=dict)


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_prompts(tokenizer: Any, n_plain: int, n_chat: int, seed: int = 0) -> list[Prompt]:
    """Held-out prompts from evaluation-split documents only: plain = the first
    PLAIN_PROMPT_TOKENS tokens of prose/code documents (alternating); chat = system + first user
    turn of document conversations and tool-call conversations (alternating)."""
    prose = sources.select_split("prose", sources.prose_documents(), "evaluation")
    code = sources.select_split("code", sources.code_documents(), "evaluation")
    prompts: list[Prompt] = []
    pools = [prose, code]
    i = 0
    while len(prompts) < n_plain and any(pools):
        pool = pools[i % 2] or pools[(i + 1) % 2]
        doc = pool.pop(0)
        ids = encode_prompt(tokenizer, doc.text)  # as serving encodes a text prompt
        i += 1
        if len(ids) >= PLAIN_PROMPT_TOKENS:
            prompts.append(
                Prompt("plain", ids[:PLAIN_PROMPT_TOKENS], {**doc.provenance, "doc_id": doc.doc_id})
            )
    chat_docs = sources.select_split("prose", sources.prose_documents(), "evaluation")
    chat_docs += sources.select_split("code", sources.code_documents(), "evaluation")
    convs = synth.chat_conversations(chat_docs, seed)
    n_tool = n_chat // 2
    for _ in range(n_chat - n_tool):
        conv = next(convs, None)
        if conv is None:
            break
        messages, prov = conv
        prompts.append(Prompt("chat", _chat_ids(tokenizer, messages[:2]), prov))
    for k in range(n_tool):
        messages, prov = synth.tool_conversation(seed, "evaluation", k)
        prompts.append(Prompt("tool", _chat_ids(tokenizer, messages[:2]), prov))
    return prompts


def _compare(ref: Sequence[int], arm: Sequence[int]) -> dict[str, Any]:
    div = metrics.first_divergence(ref, arm)
    return {
        "first_token_equal": bool(ref[:1] == arm[:1]),
        "identical": div is None,
        "first_divergence": div,
        "unigram_jaccard": metrics.ngram_jaccard(ref, arm, 1),
        "bigram_jaccard": metrics.ngram_jaccard(ref, arm, 2),
        "length": len(arm),
    }


def run_generation(
    llms: dict[str, Any], reference: str, prompts: list[Prompt], max_new_tokens: int, tokenizer: Any
) -> dict[str, Any]:
    outs = greedy_all(llms, [p.ids for p in prompts], max_new_tokens, "generation")
    ref = outs[reference]
    result: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "prompts": [
            {
                "kind": p.kind,
                "tokens": len(p.ids),
                "hash": record_hash(p.ids),
                "provenance": p.provenance,
            }
            for p in prompts
        ],
        "reference_lengths": [len(r) for r in ref],
        "arms": {},
    }
    for name, seqs in outs.items():
        if name == reference:
            continue
        cases = [_compare(r, s) for r, s in zip(ref, seqs, strict=True)]
        by_kind: dict[str, dict[str, int]] = {}
        for p, c in zip(prompts, cases, strict=True):
            k = by_kind.setdefault(p.kind, {"n": 0, "first_token_equal": 0, "identical": 0})
            k["n"] += 1
            k["first_token_equal"] += c["first_token_equal"]
            k["identical"] += c["identical"]
        divs = [c["first_divergence"] for c in cases if c["first_divergence"] is not None]
        examples = [
            {
                "prompt": i,
                "kind": prompts[i].kind,
                "first_divergence": c["first_divergence"],
                "reference": tokenizer.decode(ref[i]),
                "arm": tokenizer.decode(seqs[i]),
            }
            for i, c in enumerate(cases)
            if not c["identical"]
        ][:3]
        result["arms"][name] = {
            "n": len(cases),
            "first_token_equal": sum(c["first_token_equal"] for c in cases),
            "identical": sum(c["identical"] for c in cases),
            "first_divergences": divs,
            "by_kind": by_kind,
            "cases": cases,
            "mean_unigram_jaccard": sum(c["unigram_jaccard"] for c in cases) / max(len(cases), 1),
            "divergence_examples": examples,
        }
    return result


def run_retrieval(
    llms: dict[str, Any], reference: str, cases: list[retrieval.RetrievalCase], tokenizer: Any
) -> dict[str, Any]:
    outs = greedy_all(llms, [c.prompt_ids for c in cases], retrieval.MAX_NEW_TOKENS, "retrieval")
    result: dict[str, Any] = {
        "cases": [
            {
                "id": c.case_id,
                "task": c.task,
                "context": c.context,
                "depth": c.depth,
                "answer": c.answer,
                "needle_token": c.needle_token,
                "hash": record_hash(c.prompt_ids),
                "provenance": c.provenance,
            }
            for c in cases
        ],
        "arms": {},
    }
    correct: dict[str, list[bool]] = {}
    for name, seqs in outs.items():
        texts = [tokenizer.decode(s, skip_special_tokens=True) for s in seqs]
        correct[name] = [retrieval.score(c, t) for c, t in zip(cases, texts, strict=True)]
        result["arms"][name] = {
            "correct": correct[name],
            "score": sum(correct[name]),
            "n": len(cases),
            "outputs": texts,
        }
    for name in outs:
        if name != reference:
            paired = metrics.paired_outcomes(correct[reference], correct[name])
            result["arms"][name]["regressions"] = [cases[i].case_id for i in paired["regressions"]]
            result["arms"][name]["improvements"] = [
                cases[i].case_id for i in paired["improvements"]
            ]
    return result
