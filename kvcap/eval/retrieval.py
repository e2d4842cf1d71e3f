"""Deterministic long-context retrieval cases: passkey-in-a-haystack and key-value lookup.

Every case is built in token space so its length is exact: `context` = prompt tokens +
`MAX_NEW_TOKENS` generated ones. The needle (or the target key-value pair) sits at `depth`% of
the filler. Secrets come from `random.Random(f"retrieval:{seed}:{task}:{context}:{depth}")`; the
passkey haystack is evaluation-split prose (never calibration text), so a case is reproducible
from (task, context, depth, seed) and the installed sources recorded in its provenance.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcap.errors import ConfigError
from kvcap.eval import sources
from kvcap.models.text_prompt import encode_prompt

TASKS = ("passkey", "kv")
DEPTHS = (0, 25, 50, 75, 100)
MAX_NEW_TOKENS = 12
MIN_CONTEXT = 256

_PASSKEY_INTRO = (
    "There is an important pass key hidden inside a lot of irrelevant text. "
    "Find it and memorize it.\n\n"
)
_PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
_KV_INTRO = "Below is a JSON object of records. Each key maps to a value. Memorize them.\n\n{\n"
_HEX = "0123456789abcdef"


@dataclass(frozen=True)
class RetrievalCase:
    task: str
    context: int
    depth: int
    prompt_ids: list[int] = field(repr=False)
    answer: str
    needle_token: int  # index of the needle's first token in the prompt
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def case_id(self) -> str:
        return f"{self.task}@{self.context}/{self.depth}"


def validate_contexts(contexts: Sequence[int], window: int) -> list[int]:
    """Fail before any work when a context does not fit the model's window."""
    out = sorted(set(int(c) for c in contexts))
    for c in out:
        if c > window:
            raise ConfigError(
                f"retrieval context {c} exceeds the model's window of {window} tokens"
            )
        if c < MIN_CONTEXT:
            raise ConfigError(f"retrieval context {c} is below the minimum of {MIN_CONTEXT}")
    return out


def haystack_ids(tokenizer: Any, min_tokens: int) -> tuple[list[int], list[str]]:
    """Evaluation-split prose as one token stream (repeated if shorter than `min_tokens`)."""
    docs = sources.select_split("prose", sources.prose_documents(), "evaluation")
    if not docs:
        raise ConfigError("no evaluation-split prose is installed to build a haystack")
    ids = tokenizer("\n\n".join(d.text for d in docs), add_special_tokens=False)["input_ids"]
    ids = list(ids)
    reps = -(-min_tokens // max(len(ids), 1))
    return (ids * max(reps, 1)), [d.doc_id for d in docs]


def _enc(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def passkey_case(
    tokenizer: Any, hay: list[int], hay_docs: list[str], context: int, depth: int, seed: int
) -> RetrievalCase:
    rng = random.Random(f"retrieval:{seed}:passkey:{context}:{depth}")
    key = str(rng.randint(10000, 99999))
    intro = encode_prompt(tokenizer, _PASSKEY_INTRO)  # the prompt's start: as served
    question = _enc(tokenizer, _PASSKEY_QUESTION)
    needle = _enc(tokenizer, f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n")
    n_fill = context - MAX_NEW_TOKENS - len(intro) - len(needle) - len(question)
    if n_fill < 16:
        raise ConfigError(f"context {context} is too short for a passkey case")
    start = rng.randrange(0, max(len(hay) - n_fill, 1))
    filler = hay[start : start + n_fill]
    at = round(depth / 100 * n_fill)
    prompt = intro + filler[:at] + needle + filler[at:] + question
    prov = {
        "generator": "retrieval.passkey",
        "seed": seed,
        "haystack": "prose/evaluation",
        "haystack_docs": hay_docs,
        "haystack_offset": start,
    }
    return RetrievalCase("passkey", context, depth, prompt, key, len(intro) + at, prov)


def _hex(rng: random.Random, n: int = 6) -> str:
    return "".join(rng.choice(_HEX) for _ in range(n))


def newline_token(tokenizer: Any) -> int:
    """The token that decodes to exactly "\n", the padding of a key-value case. A
    SentencePiece tokenizer encodes "\n" as a leading-space piece and the newline byte, so
    the encoding's first token padded with spaces."""
    ids = _enc(tokenizer, "\n")
    for t in ids:
        if tokenizer.decode([t]) == "\n":
            return t
    raise ConfigError(f"no token of this tokenizer decodes to a newline on its own ('\\n' "
                      f"encodes as {ids}): the key-value retrieval task pads with newlines")


def kv_case(tokenizer: Any, context: int, depth: int, seed: int) -> RetrievalCase:
    rng = random.Random(f"retrieval:{seed}:kv:{context}:{depth}")
    intro = encode_prompt(tokenizer, _KV_INTRO)  # the prompt's start: as served
    target_key, answer = _hex(rng), _hex(rng)
    question = _enc(
        tokenizer,
        f'}}\n\nWhat is the value of key "{target_key}"? The value of key "{target_key}" is "',
    )
    budget = context - MAX_NEW_TOKENS - len(intro) - len(question)
    seen = {target_key}
    lines: list[list[int]] = []
    used = 0
    target_line = _enc(tokenizer, f'  "{target_key}": "{answer}",\n')
    used += len(target_line)
    while True:
        k = _hex(rng)
        if k in seen:
            continue
        seen.add(k)
        line = _enc(tokenizer, f'  "{k}": "{_hex(rng)}",\n')
        if used + len(line) > budget:
            break
        lines.append(line)
        used += len(line)
    if not lines:
        raise ConfigError(f"context {context} is too short for a key-value case")
    at = round(depth / 100 * len(lines))
    before = [t for ln in lines[:at] for t in ln]
    after = [t for ln in lines[at:] for t in ln]
    pad = [newline_token(tokenizer)] * (budget - used)  # exact length: newline tokens
    prompt = intro + before + target_line + after + pad + question
    prov = {"generator": "retrieval.kv", "seed": seed, "pairs": len(lines) + 1}
    return RetrievalCase("kv", context, depth, prompt, answer, len(intro) + len(before), prov)


def build_cases(
    tokenizer: Any,
    tasks: Sequence[str],
    contexts: Sequence[int],
    depths: Sequence[int] = DEPTHS,
    seed: int = 0,
) -> list[RetrievalCase]:
    for t in tasks:
        if t not in TASKS:
            raise ConfigError(f"unknown retrieval task {t!r}: choose from {', '.join(TASKS)}")
    hay, hay_docs = haystack_ids(tokenizer, max(contexts)) if "passkey" in tasks else ([], [])
    cases = []
    for task in tasks:
        for ctx in contexts:
            for d in depths:
                cases.append(
                    passkey_case(tokenizer, hay, hay_docs, ctx, d, seed)
                    if task == "passkey"
                    else kv_case(tokenizer, ctx, d, seed)
                )
    return cases


def score(case: RetrievalCase, generated_text: str) -> bool:
    """Passkey: the first run of digits equals the key. KV: the text starts with the value,
    whole (a longer run of hex digits is another value, as a longer number is another key)."""
    if case.task == "passkey":
        m = re.search(r"\d+", generated_text)
        return m is not None and m.group(0) == case.answer
    m = re.match(r"[0-9a-fA-F]*", generated_text.strip())
    return m.group(0) == case.answer
