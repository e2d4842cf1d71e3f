"""Structured output after a reasoning model's thinking (`SamplingParams.reasoning`): the
grammar applies to the answer only, so the model may think in free text first (as vLLM does
with a reasoning parser).

  qwen3        the reply thinks only if it opens with `<think>` (decided at its first token:
               Qwen3 writes `<think>` as one token; with thinking off the chat template closes
               the block in the prompt and the reply is all answer)
  deepseek_r1  the chat template opens `<think>` in the prompt: the reply thinks from its
               first token
The grammar starts with the token after the one that completes `</think>`.
"""

from __future__ import annotations

REASONING_STYLES = ("qwen3", "deepseek_r1")
THINK_OPEN, THINK_CLOSE = b"<think>", b"</think>"


class ReasoningGate:
    """Per request: whether each sampled token is still thinking (free) or answer (checked by
    the grammar)."""

    def __init__(self, style: str):
        if style not in REASONING_STYLES:
            raise ValueError(f"unknown reasoning style {style!r} (known: "
                             f"{', '.join(REASONING_STYLES)})")
        self.phase = "undecided" if style == "qwen3" else "thinking"
        self.tail = b""  # the thinking's last bytes, where </think> may be arriving

    @property
    def answering(self) -> bool:
        return self.phase == "answer"

    def admit(self, token_bytes: bytes) -> bool:
        """True when this token belongs to the answer (the grammar checks it); a thinking token
        is taken as sampled, and may end the thinking."""
        if self.phase == "answer":
            return True
        if self.phase == "undecided":
            if not token_bytes.lstrip().startswith(THINK_OPEN):
                self.phase = "answer"
                return True
            self.phase = "thinking"
            token_bytes = token_bytes.lstrip()[len(THINK_OPEN):]
        seen = self.tail + token_bytes
        if THINK_CLOSE in seen:
            self.phase = "answer"
        self.tail = seen[-(len(THINK_CLOSE) - 1):]
        return False
