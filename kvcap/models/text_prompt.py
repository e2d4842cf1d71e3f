"""How a text prompt becomes token ids: with the special tokens the tokenizer puts before a text
(Llama's and Mistral's BOS), as transformers and vLLM encode it -- once, also when the text
already opens with them (a chat template rendered by the client)."""

from __future__ import annotations

from typing import Any


def text_prefix(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts before a text; [] when it adds none (the embedded
    model's) or only appends."""
    plain = list(tokenizer(["a"], add_special_tokens=False)["input_ids"][0])
    full = list(tokenizer(["a"], add_special_tokens=True)["input_ids"][0])
    for at in range(len(full) - len(plain) + 1):
        if full[at:at + len(plain)] == plain:
            return full[:at]
    return []


def encode_prompt(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """`text`'s ids, led by the tokenizer's prefix unless the text's own ids already begin with
    it (a BOS twice derails a model) or add_special_tokens is off."""
    plain = list(tokenizer.encode(text, add_special_tokens=False))
    if not add_special_tokens:
        return plain
    prefix = text_prefix(tokenizer)
    if prefix and plain[:len(prefix)] == prefix:
        return plain
    return list(tokenizer.encode(text, add_special_tokens=True))
