"""How a text prompt becomes token ids: led by the special tokens the tokenizer puts before a
text (Llama's and Mistral's BOS), as transformers and vLLM encode it -- once, also when the text
already opens with them (a chat template rendered by the client)."""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from kvcap.errors import ConfigError

_PREFIXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def text_prefix(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts before a text; [] when it adds none (the embedded
    model's) or only appends. Found once per tokenizer by encoding a probe text both ways."""
    try:
        return list(_PREFIXES[tokenizer])
    except (KeyError, TypeError):
        pass
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a", add_special_tokens=True))
    prefix = next((full[:at] for at in range(len(full) - len(plain) + 1)
                   if full[at:at + len(plain)] == plain), [])
    try:
        _PREFIXES[tokenizer] = tuple(prefix)
    except TypeError:  # not weakly referenceable: found again next time
        pass
    return prefix


def encode_prompt(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """`text`'s ids, led by the tokenizer's prefix unless add_special_tokens is off or the
    text's own ids already begin with it (a BOS twice derails a model). Special tokens a
    tokenizer appends (an EOS some fine-tunes' configs add for training) are not added: a prompt
    is to be continued. The text is encoded once, however long."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not add_special_tokens:
        return ids
    prefix = text_prefix(tokenizer)
    return ids if ids[:len(prefix)] == prefix else prefix + ids


class TemplateRefused(ValueError):
    """A chat template refused a conversation (its message, on one line)."""


def chat_ids(tokenizer: Any, conversation: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """A conversation's token ids through the tokenizer's chat template. A template refuses a
    conversation its own way (raise_exception("...") for roles it does not take, an undefined
    variable, a TypeError): TemplateRefused, for the caller to answer as its own bad input
    (a 400 in the server, a ConfigError offline) instead of a traceback from inside jinja."""
    try:
        ids = tokenizer.apply_chat_template(conversation, tokenize=True, **kwargs)
    except Exception as e:
        raise TemplateRefused(" ".join(str(e).split()) or type(e).__name__) from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def template_call(call: Any, where: str) -> dict[str, Any]:
    """An OpenAI tool call as chat templates take it: its arguments a dict (templates iterate
    over them; OpenAI sends a JSON string). Shared by the server's conversation() (which answers
    the ConfigError as a 400) and LLM.chat, so one call renders the same through both."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ConfigError(f"{where}: must have function.name and function.arguments")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise ConfigError(f"{where}.function.arguments: not valid JSON") from None
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


def chat_messages(conversation: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style messages (dicts) as the chat template takes them, read as the server reads
    them (kvcap/server/protocol.py conversation()), so one `messages` list works with both:
    text content parts joined, `developer` (OpenAI's newer name) as `system`, tool-call
    arguments parsed. Unlike the server's strict schema, every other key is kept as given:
    templates read their own (reasoning_content, name, ...), and offline nothing else does."""
    out = []
    for i, m in enumerate(conversation):
        turn = dict(m)
        if turn.get("role") == "developer":
            turn["role"] = "system"
        if isinstance(turn.get("content"), list):
            turn["content"] = "".join(_part_text(p, f"messages[{i}].content[{j}]")
                                      for j, p in enumerate(turn["content"]))
        calls = turn.get("tool_calls")
        if calls:  # (None or [] stays as given, as templates test them)
            if not isinstance(calls, (list, tuple)):
                raise ConfigError(f"messages[{i}].tool_calls: must be a list of tool calls, "
                                  f"got {type(calls).__name__}")
            turn["tool_calls"] = [template_call(c, f"messages[{i}].tool_calls[{j}]")
                                  for j, c in enumerate(calls)]
        out.append(turn)
    return out


def _part_text(part: Any, where: str) -> str:
    # an image or audio part is refused by name: dropping it would answer another question
    # than the one asked (the server's ChatMessage refuses them too)
    if not isinstance(part, Mapping):
        raise ConfigError(f"{where}: must be a {{'type': 'text', 'text': ...}} part, got "
                          f"{type(part).__name__}")
    if part.get("type") != "text":
        raise ConfigError(f"{where} has type {part.get('type')!r}: kvcap's models read text "
                          "only; send parts of type 'text'")
    if not isinstance(part.get("text"), str):
        raise ConfigError(f"{where}: a part of type 'text' must have a string 'text'")
    return part["text"]
