"""Logit adjustments a request may ask for before sampling: logit bias and repetition, presence
and frequency penalties.

Semantics (those of the OpenAI API and vLLM), applied in this order to a row's FP32 logits:
- `logit_bias` {token: b}: logit += b.
- `repetition_penalty` r (HF / vLLM extension) over every token in the prompt or the output so
  far: a positive logit is divided by r, a negative one multiplied by r.
- `presence_penalty` p and `frequency_penalty` f over the output so far, with c the number of
  times a token was generated: logit -= p * (c > 0) + f * c.
- `min_tokens` m: while fewer than m tokens were generated, the stop tokens (`stop_token_ids`,
  and EOS unless `ignore_eos`) get -inf.

Only the rows that ask are touched and only their tokens' entries are written, from index
lists built on the host (the counts are kept per request and grow by one token a step,
`PenaltyState`), so a batch without adjustments costs nothing and one with them a few small
device ops. The engine applies them to a copy: logprobs stay the model's raw distribution.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from kvcap.sampling_params import SamplingParams


@dataclass
class PenaltyState:
    """One request's token counts: its outputs counted so far, the set of prompt tokens, and
    the tokens that stop it (masked under min_tokens)."""

    stops: list[int] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    counted: int = 0
    prompt: set[int] | None = None

    def update(self, prompt: list[int], outputs: list[int]) -> None:
        self.counts.update(outputs[self.counted:])
        self.counted = len(outputs)
        if self.prompt is None:
            self.prompt = set(prompt)

    def then(self, tokens: list[int]) -> PenaltyState:
        """The state after `tokens` more outputs (a copy; a draft row's view of its request)."""
        counts = self.counts.copy()
        counts.update(tokens)
        return PenaltyState(self.stops, counts, self.counted + len(tokens), self.prompt)


def adjust_logits(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                  states: list[PenaltyState]) -> torch.Tensor:
    """A copy of logits [B, V] with each listed row adjusted by its params and state."""
    out = logits.float().clone()
    bias: tuple[list[int], list[int], list[float]] = ([], [], [])
    rep: tuple[list[int], list[int], list[float]] = ([], [], [])
    pen: tuple[list[int], list[int], list[float]] = ([], [], [])
    mask: tuple[list[int], list[int], list[float]] = ([], [], [])
    for row, sp, st in zip(rows, params, states, strict=True):
        if st.counted < sp.min_tokens:
            for tok in st.stops:
                _add(mask, row, tok, 0.0)
        for tok, b in (sp.logit_bias or {}).items():
            _add(bias, row, int(tok), float(b))
        if sp.repetition_penalty != 1.0:
            for tok in st.prompt | st.counts.keys():
                _add(rep, row, tok, sp.repetition_penalty)
        if sp.presence_penalty or sp.frequency_penalty:
            for tok, c in st.counts.items():
                _add(pen, row, tok, sp.presence_penalty + sp.frequency_penalty * c)
    if bias[0]:
        r, t, v = _tensors(bias, out.device)
        out.index_put_((r, t), v, accumulate=True)
    if rep[0]:
        r, t, v = _tensors(rep, out.device)
        x = out[r, t]
        out[r, t] = torch.where(x > 0, x / v, x * v)
    if pen[0]:
        r, t, v = _tensors(pen, out.device)
        out[r, t] -= v  # (row, token) pairs are unique: each token counted once per row
    if mask[0]:
        r, t, _ = _tensors(mask, out.device)
        out[r, t] = float("-inf")
    return out


def _add(lists: tuple[list[int], list[int], list[float]], row: int, tok: int, v: float) -> None:
    lists[0].append(row)
    lists[1].append(tok)
    lists[2].append(v)


def _tensors(lists, device: torch.device):
    r, t, v = lists
    return (torch.tensor(r, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(t, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(v, dtype=torch.float32).to(device, non_blocking=True))
