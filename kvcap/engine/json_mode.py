"""JSON mode (`SamplingParams.json_object`, the server's `response_format: json_object`): every
generated token keeps the output a prefix of one JSON object, and the request ends (EOS) once
the object is complete.

Checking the whole vocabulary each step would cost a Python pass over ~50-130K tokens, so the
engine samples as usual and checks the token it got (`kvcap.sampling.json_prefix`): a token
that does not fit is masked to -inf and the row sampled again from the same logits and the
same random numbers (Gumbel-max: the winner among the tokens left is a sample of the
distribution restricted to them; greedy rows take the next best). After MAX_REJECTIONS misses
the step builds the full mask of fitting tokens once (memoised per recogniser state) and
samples under it, so a model that is poor at JSON still makes progress. Special tokens and
tokens without bytes never fit; EOS fits only, and then alone, once the object is complete.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from kvcap.engine.token_bytes import TokenTexts
from kvcap.sampling import json_prefix

MAX_REJECTIONS = 8
MASK_CACHE_STATES = 512

Resample = Callable[[torch.Tensor], int]  # masked logits row [V] -> token


class JsonMode:
    """Per-engine helper: token bytes of the vocabulary and masks by recogniser state."""

    def __init__(self, texts: TokenTexts, vocab_size: int, eos_ids: set[int]):
        self.texts, self.vocab_size = texts, vocab_size
        self.eos = min(eos_ids) if eos_ids else None
        self.never = set(eos_ids) | texts.special_ids
        self._masks: OrderedDict[json_prefix.State, torch.Tensor] = OrderedDict()
        self.num_rejections = 0  # tokens masked and sampled again, over the engine's life
        self.num_full_masks = 0  # steps that needed the whole-vocabulary mask

    def next_state(self, state: json_prefix.State, tok: int) -> json_prefix.State | None:
        """The state after `tok`, or None when it does not fit."""
        if tok in self.never or not 0 <= tok < self.vocab_size:
            return None
        data = bytes(self.texts(tok)[1])
        return json_prefix.feed(state, data) if data else None

    def choose(self, state: json_prefix.State, tok: int, logits: torch.Tensor,
               resample: Resample) -> tuple[int, json_prefix.State]:
        """The token this row emits (`tok` if it fits) and the state after it."""
        if json_prefix.complete(state):
            if self.eos is None:
                raise ValueError("JSON mode needs an EOS token to end the object with")
            return self.eos, state
        nxt = self.next_state(state, tok)
        row = None
        for _ in range(MAX_REJECTIONS):
            if nxt is not None:
                return tok, nxt
            self.num_rejections += 1
            if row is None:
                row = logits.detach().float().clone()
            row[tok] = float("-inf")
            tok = resample(row)
            nxt = self.next_state(state, tok)
        if nxt is not None:
            return tok, nxt
        self.num_full_masks += 1
        allowed = self._mask(state).to(logits.device)
        tok = resample(torch.where(allowed, logits.detach().float(), float("-inf")))
        nxt = self.next_state(state, tok)
        if nxt is None:  # a row whose logits are all -inf under the mask
            raise RuntimeError("JSON mode: no token of the vocabulary continues the output")
        return tok, nxt

    def _mask(self, state: json_prefix.State) -> torch.Tensor:
        hit = self._masks.get(state)
        if hit is not None:
            self._masks.move_to_end(state)
            return hit
        table = self.texts.vocab_bytes(self.vocab_size)
        ok = [t not in self.never and bool(b) and json_prefix.feed(state, b) is not None
              for t, b in enumerate(table)]
        mask = torch.tensor(ok, dtype=torch.bool)
        self._masks[state] = mask
        if len(self._masks) > MASK_CACHE_STATES:
            self._masks.popitem(last=False)
        return mask
