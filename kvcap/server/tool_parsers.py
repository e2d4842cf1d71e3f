"""Tool calls written by the model in its own syntax (tool_choice "auto"), parsed from the
output text. `kvcap serve --tool-call-parser NAME` picks the syntax of the served family:

  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5,
               Qwen3, Hermes 2/3 and models trained on their format)
  llama3_json  the whole reply one JSON object `{"name": ..., "parameters": {...}}`, or several
               joined by ";", optionally after `<|python_tag|>` (Llama 3.1 / 3.2 / 3.3)

A reply that does not parse as tool calls is plain content (nothing is lost). Streaming sends
content as it comes and holds back text from the point where a tool call may have begun (a
partial opening tag is held too); the calls go out whole with the finish.
"""

from __future__ import annotations

import json
import re
from typing import Any

PARSERS = ("hermes", "llama3_json")
Call = tuple[str, str]  # (function name, arguments as JSON text)


def parse_tool_calls(parser: str, text: str) -> tuple[int, list[Call]]:
    """(where the content ends, calls) of a whole reply: the content is text[:end] (without
    calls: the whole text, [])."""
    if parser == "hermes":
        return _hermes(text)
    if parser == "llama3_json":
        return _llama3(text)
    raise ValueError(f"unknown tool-call parser {parser!r} (known: {', '.join(PARSERS)})")


def tool_call_start(parser: str, text: str) -> int:
    """Where a tool call begins or may yet begin in `text` (len(text) when it cannot): what
    a stream sends as content stops there."""
    if parser == "hermes":
        return _held_from(text, HERMES_OPEN)
    stripped = len(text) - len(text.lstrip())
    if text[stripped:stripped + 1] == "{":
        return 0
    head = text.lstrip()
    if head and (PYTHON_TAG.startswith(head) or head.startswith(PYTHON_TAG)):
        return 0
    return 0 if not head else len(text)


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


def _held_from(text: str, tag: str) -> int:
    at = text.find(tag)
    if at >= 0:
        return at
    for k in range(min(len(tag) - 1, len(text)), 0, -1):  # a partial tag at the end
        if tag.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _call(obj: Any, args_key: str) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _hermes(text: str) -> tuple[int, list[Call]]:
    at = text.find(HERMES_OPEN)
    if at < 0:
        return len(text), []
    calls = []
    for block in HERMES_BLOCK.findall(text[at:]):
        try:
            call = _call(json.loads(block), "arguments")
        except ValueError:
            call = None
        if call is None:
            return len(text), []
        calls.append(call)
    return at, calls


def _llama3(text: str) -> tuple[int, list[Call]]:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return len(text), []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return len(text), []
        call = _call(obj, "parameters")
        if call is None:
            return len(text), []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return 0, calls
