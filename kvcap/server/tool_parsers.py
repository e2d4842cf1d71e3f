"""Tool calls written by the model in its own syntax (tool_choice "auto"), parsed from the
output text. `kvcap serve --tool-call-parser NAME` picks the syntax of the served family:

  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5,
               Qwen3, Hermes 2/3 and models trained on their format)
  llama3_json  the whole reply one JSON object `{"name": ..., "parameters": {...}}`, or several
               joined by ";", optionally after `<|python_tag|>` (Llama 3.1 / 3.2 / 3.3)
  pythonic     the whole reply a Python list of calls with keyword arguments,
               `[get_weather(city="Paris"), ping()]`, optionally inside `<|python_start|>` ...
               `<|python_end|>` (Llama 3.2 / 4 with their pythonic templates); read with
               Python's own parser, argument values as literals only
  mistral      `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects (Mistral
               7B v0.3, Mixtral, Nemo), or `name[ARGS]{...}` / `name{...}` per call, each
               after its own `[TOOL_CALLS]` (the later tokenizers; v11's may write the call's
               id, `name[CALL_ID]id[ARGS]{...}`); text before it is content

A reply that does not parse as tool calls is plain content (nothing is lost). Streaming sends
content as it comes and holds back text from the point where a tool call may have begun (a
partial opening tag is held too); the calls go out whole with the finish.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
# parsers whose calls open with a special token that decoding would otherwise drop
KEEPS_SPECIAL_TOKENS = ("mistral",)
Call = tuple[str, str]  # (function name, arguments as JSON text)


def parse_tool_calls(parser: str, text: str) -> tuple[int, list[Call]]:
    """(where the content ends, calls) of a whole reply: the content is text[:end] (without
    calls: the whole text, [])."""
    if parser == "hermes":
        return _hermes(text)
    if parser == "llama3_json":
        return _llama3(text)
    if parser == "pythonic":
        return _pythonic(text)
    if parser == "mistral":
        return _mistral(text)
    raise ValueError(f"unknown tool-call parser {parser!r} (known: {', '.join(PARSERS)})")


def tool_call_start(parser: str, text: str) -> int:
    """Where a tool call begins or may yet begin in `text` (len(text) when it cannot): what
    a stream sends as content stops there."""
    if parser == "hermes":
        return _held_from(text, HERMES_OPEN)
    if parser == "mistral":
        return _held_from(text, MISTRAL_CALLS)
    opens, tag = ("{", PYTHON_TAG) if parser == "llama3_json" else ("[", PYTHONIC_START)
    head = text.lstrip()
    if head[:1] == opens or (head and (tag.startswith(head) or head.startswith(tag))):
        return 0
    return 0 if not head else len(text)


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
PYTHONIC_START, PYTHONIC_END = "<|python_start|>", "<|python_end|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_SURROGATE = re.compile("[\ud800-\udfff]")  # a str's half of a UTF-16 pair


def _held_from(text: str, tag: str) -> int:
    at = text.find(tag)
    if at >= 0:
        return at
    for k in range(min(len(tag) - 1, len(text)), 0, -1):  # a partial tag at the end
        if tag.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _call(obj: Any, args_key: str, tagged: bool = True) -> Call | None:
    """One call from its JSON object. Untagged (llama3_json: a reply that is plain JSON) it
    must name its arguments too: an answer such as {"name": "Bob", "age": 3} is content,
    not a call to "Bob" (as vLLM's parser reads it). The arguments may be under either
    "arguments" or "parameters" (the key of the tools' schemas in the prompt), whichever
    the syntax names: a call is never sent without the arguments the model wrote."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or \
            _SURROGATE.search(obj["name"]):
        return None
    if not tagged and args_key not in obj and "arguments" not in obj:
        return None
    key = next((k for k in (args_key, "arguments", "parameters") if k in obj), None)
    args = obj[key] if key is not None else {}
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    text = _json_text(args)
    return None if text is None else (obj["name"], text)


def _json_text(args: dict[str, Any]) -> str | None:
    """The arguments as JSON text, or None where they are no JSON: Python's decoder takes
    NaN, Infinity and numbers past a float's range (inf), which written back are not JSON. A
    lone surrogate (half of a `\\ud83d\\ude00` pair the model wrote as escapes) stays an
    escape: UTF-8, which the reply is sent in, has no such character."""
    try:
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return None
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _hermes(text: str) -> tuple[int, list[Call]]:
    at = text.find(HERMES_OPEN)
    if at < 0:
        return len(text), []
    calls = []
    for block in HERMES_BLOCK.findall(text[at:]):
        try:
            call = _call(json.loads(block), "arguments")
        except (ValueError, RecursionError):  # nested past the decoder's limit: no call
            call = None
        if call is None:
            return len(text), []
        calls.append(call)
    return at, calls


def _llama3(text: str) -> tuple[int, list[Call]]:
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return len(text), []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return len(text), []
        call = _call(obj, "parameters", tagged)
        if call is None:
            return len(text), []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return 0, calls


def _pythonic(text: str) -> tuple[int, list[Call]]:
    body = text.strip()
    if body.startswith(PYTHONIC_START):
        body = body[len(PYTHONIC_START):].removesuffix(PYTHONIC_END).strip()
    if not body.startswith("["):
        return len(text), []
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # the parser's depth limits
        return len(text), []
    if not isinstance(tree, ast.List) or not tree.elts:
        return len(text), []
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not _dotted(node.func):
            return len(text), []
        try:  # literals only: nothing of the reply is ever evaluated as code; and JSON ones
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            if None in args:  # **kwargs
                return len(text), []
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return len(text), []
        args_text = _json_text(args)
        if args_text is None:
            return len(text), []
        calls.append((_dotted(node.func), args_text))
    return 0, calls


def _dotted(node: ast.expr) -> str | None:
    """The function's name, dotted where it is an attribute (`tools.search`)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _mistral(text: str) -> tuple[int, list[Call]]:
    at = text.find(MISTRAL_CALLS)
    if at < 0:
        return len(text), []
    calls: list[Call] = []
    for part in text[at:].split(MISTRAL_CALLS)[1:]:
        part = part.strip()
        if part.startswith("["):  # a JSON list of {"name", "arguments"}
            try:
                items = json.loads(part)
            except (ValueError, RecursionError):
                return len(text), []
            found = [_call(o, "arguments") for o in items] if isinstance(items, list) else [None]
        else:  # name[ARGS]{...} or name{...}
            name, sep, args = part.partition(MISTRAL_ARGS)
            if not sep:
                brace = part.find("{")
                name, args = (part[:brace], part[brace:]) if brace > 0 else ("", "")
            name = name.partition(MISTRAL_CALL_ID)[0].strip()  # v11's `name[CALL_ID]id[ARGS]`
            found = [_call({"name": name, "arguments": args}, "arguments") if name else None]
        if not found or None in found:
            return len(text), []
        calls += found
    return at, calls
