"""What the scheduler tests share: a scheduler config, a deterministic next-token rule and the
output it gives without any cache (the reference every cached, chunked, preempted or
speculative run must reproduce)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvcap.engine.request import Request
from kvcap.sampling_params import SamplingParams

VOCAB = 37
EOS = 0


@dataclass(frozen=True)
class Cfg:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 32
    max_model_len: int | None = 256
    block_size: int = 4


def next_token(context: list[int]) -> int:
    """A hash of the whole context: any wrong token read back changes it."""
    acc = len(context)
    for t in context:
        acc = (acc * 31 + t + 7) % 1_000_003
    return acc % VOCAB


def reference_output(prompt: list[int], p: SamplingParams, max_model_len: int,
                     rule: Callable[[list[int]], int] = next_token) -> list[int]:
    tokens, out = list(prompt), []
    while True:
        t = rule(tokens)
        tokens.append(t)
        out.append(t)
        if (t in p.stop_token_ids or (not p.ignore_eos and t == EOS)
                or len(out) >= p.max_tokens or len(tokens) >= max_model_len):
            return out


def req(rid: str, prompt: list[int], **params: object) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(rid, list(prompt), SamplingParams(**params))
