"""A chat choice's reply as the client sees it: the model's text split into thinking
(`reasoning_content`, kvcap/server/reasoning.py), answer `content` and tool calls
(kvcap/server/tools.py), whole or streamed."""

from __future__ import annotations

from typing import Any

from kvcap.server import protocol as P
from kvcap.server.reasoning import ReasoningStream, split_reasoning
from kvcap.server.tools import ToolPlan, ToolStream, parsed_reply


def chat_message(text: str, finish: str | None, calls: ToolPlan | None,
                 tool_parser: str | None, reasoning_parser: str | None) -> dict[str, Any]:
    """The choice's message and finish_reason: tool calls where the request asked for them
    and the answer parses (an output cut by max_tokens stays text), or the named function's
    call, cut short or not (as ChoiceStream streams it)."""
    reasoning = None
    if reasoning_parser is not None:
        reasoning, text = split_reasoning(reasoning_parser, text)
    plain = {"message": P.ChatResponseMessage(content=text, reasoning_content=reasoning),
             "finish_reason": finish}
    # a named call cut by max_tokens is still the call (ToolPlan.calls), as streamed
    if calls is None or (finish != "stop" and calls.mode != "named"):
        return plain
    if calls.mode == "auto":
        content, found = parsed_reply(tool_parser, text)
        if not found:
            return plain
        return {"message": P.ChatResponseMessage(content=content, tool_calls=calls.kept(found),
                                                 reasoning_content=reasoning),
                "finish_reason": "tool_calls"}
    parsed = calls.calls(text)
    if parsed is None:
        return plain
    # (a cut named call keeps its "length"; whitespace alone: no call and, as streamed, no
    # content)
    return {"message": P.ChatResponseMessage(content=None, tool_calls=parsed,
                                             reasoning_content=reasoning),
            "finish_reason": calls.call_finish(finish)}


class ChoiceStream:
    """One streamed choice: each event's text becomes a delta of `reasoning_content`,
    `content` and/or `tool_calls` (None: nothing to send yet)."""

    def __init__(self, calls: ToolPlan | None, tool_parser: str | None,
                 reasoning_parser: str | None):
        self.tools = ToolStream(calls, tool_parser) if calls is not None else None
        self.reasoning = ReasoningStream(reasoning_parser) if reasoning_parser else None
        self.held_from: int | None = None  # first token of events not sent yet

    def event(self, text: str, finish: str | None, span: tuple[int, int]
              ) -> tuple[dict[str, Any] | None, str | None, tuple[int, int]]:
        thought = ""
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, final=finish is not None)
        delta: dict[str, Any] | None
        if self.tools is None:
            delta = {"content": text} if text else ({} if finish is not None else None)
        elif text or finish is not None:
            delta, finish = self.tools.event(text, finish)
        else:
            delta = None
        if thought:
            delta = {"reasoning_content": thought, **(delta or {})}
        if delta is None:
            if self.held_from is None:
                self.held_from = span[0]
            return None, None, span
        if self.held_from is not None:  # the held tokens' logprobs go with this event
            span, self.held_from = (self.held_from, span[1]), None
        return delta, finish, span
