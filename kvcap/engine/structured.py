"""Structured output (`SamplingParams.json_object` / `json_schema` / `choice`; the server's
`response_format` and vLLM's `guided_json` / `guided_choice`): every generated token keeps the
output a prefix of something the request's grammar allows (kvcap/sampling/json_grammar.py),
and the request ends with EOS once nothing else may follow.

Checking the whole vocabulary each step would cost a pass over ~50-130K tokens, so the engine
samples as usual and checks the token it got: a token that does not fit is masked to -inf and
the row sampled again from the same logits and the same random numbers (Gumbel-max: the winner
among the tokens left is a sample of the distribution restricted to them; greedy rows take the
next best). After MAX_REJECTIONS misses the step builds the full mask of fitting tokens once
(memoised per grammar and state) and samples under it, so a model that is poor at the format
still makes progress. Special tokens and tokens without bytes never fit; EOS fits once the
output is complete, and is forced once nothing but whitespace could follow.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from kvcap.engine.token_bytes import TokenTexts
from kvcap.sampling.json_grammar import Grammar, State

MAX_REJECTIONS = 8
MASK_CACHE_STATES = 512

Resample = Callable[[torch.Tensor], int]  # masked logits row [V] -> token


class NoContinuation(RuntimeError):
    """No token of the vocabulary continues the output (the engine ends that request alone,
    aborted with this as its error)."""


class StructuredOutput:
    """Per-engine helper: token bytes of the vocabulary and masks by (grammar, state)."""

    def __init__(self, texts: TokenTexts, vocab_size: int, eos_ids: set[int]):
        self.texts, self.vocab_size = texts, vocab_size
        self.eos_ids = set(eos_ids)
        self.eos = min(eos_ids) if eos_ids else None
        self.never = texts.special_ids - self.eos_ids
        self._masks: OrderedDict[tuple[Grammar, State], torch.Tensor] = OrderedDict()
        self._walk: tuple[list[int], list[bytes], list[int]] | None = None
        self.num_rejections = 0  # tokens masked and sampled again, over the engine's life
        self.num_full_masks = 0  # steps that needed the whole-vocabulary mask

    def next_state(self, grammar: Grammar, state: State, tok: int) -> State | None:
        """The state after `tok`, or None when it does not fit."""
        if tok in self.eos_ids:
            return state if grammar.complete(state) else None
        if tok in self.never or not 0 <= tok < self.vocab_size:
            return None
        data = self.texts(tok)[1]
        return grammar.feed(state, data) if data else None

    def choose(self, grammar: Grammar, state: State, tok: int, logits: torch.Tensor,
               resample: Resample) -> tuple[int, State]:
        """The token this row emits (`tok` if it fits) and the state after it."""
        if grammar.must_end(state):
            if self.eos is None:
                raise ValueError("structured output needs an EOS token to end the output with")
            if tok in self.eos_ids:  # the model's own end: kept (as next_state would)
                return tok, state
            return self._likeliest_eos(logits), state
        nxt = self.next_state(grammar, state, tok)
        row = None
        for _ in range(MAX_REJECTIONS):
            if nxt is not None:
                return tok, nxt
            self.num_rejections += 1
            if row is None:
                row = logits.detach().float().clone()
            row[tok] = float("-inf")
            tok = resample(row)
            nxt = self.next_state(grammar, state, tok)
        if nxt is not None:
            return tok, nxt
        self.num_full_masks += 1
        allowed = self.mask(grammar, state).to(logits.device)
        tok = resample(torch.where(allowed, logits.detach().float(), float("-inf")))
        nxt = self.next_state(grammar, state, tok)
        if nxt is None:  # no token fits, or a row whose logits are all -inf under the mask
            raise NoContinuation(f"structured output ({grammar.description}): no token of the "
                                 f"vocabulary continues the output")
        return tok, nxt

    def _likeliest_eos(self, logits: torch.Tensor) -> int:
        """The end-of-sequence id the model ranks highest (lowest id on ties). min(eos_ids)
        replaced the model's own: Llama 3 instruct's <|eot_id|> (128009) became
        <|end_of_text|> (128001), Qwen2.5's <|im_end|> <|endoftext|>, in the token ids, the
        logprobs and an include_stop_str_in_output text."""
        ids = sorted(t for t in self.eos_ids if 0 <= t < logits.shape[-1])
        if len(ids) < 2:
            return ids[0] if ids else self.eos
        values = logits.detach()[torch.tensor(ids, device=logits.device)].float().tolist()
        return ids[max(range(len(ids)), key=lambda i: (values[i], -i))]

    def mask(self, grammar: Grammar, state: State) -> torch.Tensor:
        """[V] bool: the tokens that fit after `state`."""
        key = (grammar, state)
        hit = self._masks.get(key)
        if hit is not None:
            self._masks.move_to_end(key)
            return hit
        fits: list[int] = []
        order, data, shared = self._vocab_walk()
        # Tokens in byte order: each shares `shared[i]` leading bytes with the one before, so
        # the states after those bytes are reused (depth d's state in `path[d]`); once a
        # prefix dies, every token below it in the order that shares it dies too.
        path: list[State | None] = [state]
        for tok, raw, common in zip(order, data, shared, strict=True):
            if len(path) <= common:  # the previous token died inside the shared bytes
                continue
            del path[common + 1:]
            cur = path[common]
            for b in raw[common:]:
                cur = grammar.feed(cur, (b,))
                if cur is None:
                    break
                path.append(cur)
            if cur is not None:
                fits.append(tok)
        ok = torch.zeros(self.vocab_size, dtype=torch.bool)
        ok[torch.tensor(fits, dtype=torch.long)] = True  # one indexed write, not one per token
        for t in self.eos_ids:
            if t < self.vocab_size:
                ok[t] = grammar.complete(state)
        self._masks[key] = ok
        if len(self._masks) > MASK_CACHE_STATES:
            self._masks.popitem(last=False)
        return ok

    def _vocab_walk(self) -> tuple[list[int], list[bytes], list[int]]:
        """The vocabulary's ordinary tokens sorted by their bytes, with each one's count of
        leading bytes shared with the previous (computed once)."""
        if self._walk is None:
            table = self.texts.vocab_bytes(self.vocab_size)
            skip = self.never | self.eos_ids
            order = sorted((t for t, b in enumerate(table) if b and t not in skip),
                           key=table.__getitem__)
            data = [table[t] for t in order]
            shared = [0] + [_common_prefix(a, b) for a, b in zip(data, data[1:], strict=False)]
            self._walk = order, data, shared
        return self._walk


def _common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
