"""A reasoning model's thinking, split from its answer (`kvcap serve --reasoning-parser`): the
chat reply's `reasoning_content` holds the text inside `<think> ... </think>`, `content` the
rest, as vLLM's reasoning parsers answer.

  qwen3        the reply thinks only if it opens with `<think>`; otherwise it is all answer
               (what Qwen3 writes with thinking off), a `</think>` in it included
  deepseek_r1  the chat template opens `<think>` in the prompt, so the reply starts inside
               the thinking (its own `<think>` is optional); without `</think>` it is all
               thinking (a reply cut short while thinking)

Streaming sends thinking as `reasoning_content` deltas and the rest as `content`; the text of a
tag that may be starting is held back until it is known. The answer part is what tool-call
parsing sees; a structured-output format (schema, regex, tool arguments) applies to it alone
(kvcap/sampling/reasoning_gate.py).
"""

from __future__ import annotations

from kvcap.sampling.reasoning_gate import REASONING_STYLES as PARSERS

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, answer) of a whole reply."""
    if parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r} (known: {', '.join(PARSERS)})")
    head = text.lstrip()
    opened = head.startswith(OPEN)
    if not opened and parser == "qwen3":
        # no thinking, a later </think> included: so reads the grammar gate
        # (kvcap/sampling/reasoning_gate.py), and a stream that has already sent the text as
        # answer cannot take it back
        return None, text
    body = head[len(OPEN):] if opened else text
    end = body.find(CLOSE)
    if end < 0:  # still thinking
        return body, ""
    return body[:end], body[end + len(CLOSE):].lstrip("\n")


class ReasoningStream:
    """Splits a streamed reply into (reasoning delta, answer delta) pieces."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self.parser, self.text = parser, ""
        self.sent_reasoning = self.sent_answer = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """The new (reasoning, answer) text after `delta`; `final` releases what was held."""
        self.text += delta
        reasoning, answer = self._split(final)
        out = (reasoning[self.sent_reasoning:], answer[self.sent_answer:])
        self.sent_reasoning, self.sent_answer = len(reasoning), len(answer)
        return out

    def _split(self, final: bool) -> tuple[str, str]:
        """What is certain so far: text that may still be (part of) a tag is left out."""
        text = self.text
        head = text.lstrip()
        if not final and len(head) < len(OPEN) and OPEN.startswith(head):
            return "", ""  # may be the opening tag
        opened = head.startswith(OPEN)
        if not opened and self.parser == "qwen3":  # all answer, as split_reasoning reads it
            return "", text
        body = head[len(OPEN):] if opened else text
        end = body.find(CLOSE)
        if end >= 0:
            return body[:end], body[end + len(CLOSE):].lstrip("\n")
        keep = 0 if final else _partial_tag(body, CLOSE)
        return body[:len(body) - keep], ""


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that starts `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
