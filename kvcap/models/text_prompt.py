"""How a text prompt becomes token ids: led by the special tokens the tokenizer puts before a
text (Llama's and Mistral's BOS), as transformers and vLLM encode it -- once, also when the text
already opens with them (a chat template rendered by the client)."""

from __future__ import annotations

import weakref
from typing import Any

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
