"""The engine's per-token log-probabilities in the two OpenAI shapes.

The engine records, for each generated token (and with `prompt_logprobs` for each prompt token
after the first), a dict token id -> log-probability holding the top N of log_softmax(logits)
plus the chosen token (`ModelRunner._collect_logprobs`). These are the model's raw
distribution, before temperature and top-k/top-p/min-p, as in vLLM.

- completions (`logprobs: N`): `{tokens, token_logprobs, top_logprobs, text_offset}`; each
  `top_logprobs` entry holds the top N and the chosen token (so up to N + 1 entries, as the
  OpenAI API documents), keyed by token text; the first echoed prompt token has `None`s.
  `text_offset[k]` is where token k's text starts in the choice's text (the echoed prompt and
  the completion): the characters the tokens before it decode to (`TextOffsets`; a token
  inside a character split across tokens is at that character).
- chat (`logprobs: true, top_logprobs: N`): `{content: [{token, logprob, bytes, top_logprobs:
  [N x {token, logprob, bytes}]}]}`.

A token's text is its bytes decoded as UTF-8 (a token that ends inside a multi-byte character
shows U+FFFD); `bytes` are the token's own bytes (`kvcap.engine.token_bytes`), so a client can
join them exactly. JSON has no
infinities: a log-probability of -inf (a masked logit) is sent as -9999.0, as vLLM does.
"""

from __future__ import annotations

import codecs
import math

from kvcap.engine.token_bytes import TokenTexts
from kvcap.server import protocol as P

MIN_LOGPROB = -9999.0


def _finite(v: float) -> float:
    return v if math.isfinite(v) else MIN_LOGPROB


def _top(d: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The n most likely entries of one position's dict (it may also hold the chosen token)."""
    return sorted(d.items(), key=lambda kv: -kv[1])[:n]


class TextOffsets:
    """One choice's text offsets, token after token (kept across its stream's events). They
    count the characters the tokens' bytes decode to, as the choice's text is decoded:
    counting each token's own text put every offset after a character split across tokens
    (an emoji, most CJK; each part shown as U+FFFD) past its token in the text."""

    def __init__(self) -> None:
        self.at = 0  # characters decoded so far
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, raw: list[int]) -> int:
        """The offset of the token of bytes `raw`: where the character holding its first byte
        starts -- the last character that the bytes held back (an unfinished character's
        start) and that first byte decode to. Moves past the token."""
        data = bytes(raw)
        held = self._utf8.getstate()[0]
        at = self.at + max(len((held + data[:1]).decode("utf-8", "replace")) - 1, 0)
        self.at += len(self._utf8.decode(data))
        return at


def completion_logprobs(texts: TokenTexts, ids: list[int], lps: list[dict[int, float] | None],
                        offsets: TextOffsets | None = None) -> P.CompletionLogprobs:
    """Tokens `ids` with their dicts `lps` (None: no logprob, the first prompt token);
    `offsets`: where the choice's text is at the first of them (a fresh one: its start)."""
    offsets = TextOffsets() if offsets is None else offsets
    out = P.CompletionLogprobs()
    for tok, d in zip(ids, lps, strict=True):
        text, raw = texts(tok)
        out.tokens.append(text)
        out.text_offset.append(offsets.next(raw))
        if d is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_finite(d[tok]))
        top: dict[str, float] = {}
        for t, v in _top(d, len(d)):  # most likely first; equal texts keep the likelier
            top.setdefault(texts(t)[0], _finite(v))
        out.top_logprobs.append(top)
    return out


def chat_logprobs(texts: TokenTexts, ids: list[int], lps: list[dict[int, float]],
                  top_n: int) -> P.ChatLogprobs:
    """Generated tokens `ids` with their dicts, each with its `top_n` alternatives."""
    content = []
    for tok, d in zip(ids, lps, strict=True):
        text, raw = texts(tok)
        alts = []
        for t, v in _top(d, top_n):
            t_text, t_raw = texts(t)
            alts.append(P.TopLogprob(token=t_text, logprob=_finite(v), bytes=t_raw))
        content.append(P.ChatTokenLogprob(token=text, logprob=_finite(d[tok]), bytes=raw,
                                          top_logprobs=alts))
    return P.ChatLogprobs(content=content)
