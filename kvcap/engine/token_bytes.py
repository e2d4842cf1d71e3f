"""Each token's own bytes and display text, from the tokenizer: what logprobs report per token
and what JSON mode checks a token against.

Byte-level BPE tokenizers (GPT-2 style: Llama 3, Qwen, SmolLM) spell every byte as one
character of a fixed alphabet, so a token's bytes are exact. SentencePiece ones (Llama 2,
Mistral 7B) spell a space as U+2581 and a raw byte as `<0xNN>`. Other tokenizers fall back to
decoding the token alone (which may drop a leading space). A special token (EOS, chat markers)
is its text.
"""

from __future__ import annotations

import re
from functools import lru_cache

SPIECE_SPACE = "\u2581"
SPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the others
    are shifted to code points from 256 up, in byte order; this is its inverse."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def describe_decoder(decoder) -> str:
    """A tokenizers decoder's JSON description ("" when there is none)."""
    try:
        state = decoder.__getstate__()
    except Exception:  # no decoder, or one without a serialisable state
        return ""
    return state.decode("utf-8", "replace") if isinstance(state, bytes) else str(state)


class TokenTexts:
    """Token id -> (text, bytes), cached. Without a tokenizer a token is `token_id:N`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        # SentencePiece decoders (Metaspace, or Replace "\u2581" -> " " + ByteFallback)
        self.sentencepiece = not self.byte_level and SPIECE_SPACE in describe_decoder(decoder)
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._specials: set[int] | None = None
        self._table: list[bytes] | None = None

    def __call__(self, tok: int) -> tuple[str, list[int]]:
        hit = self._cache.get(tok)
        if hit is None:
            hit = self._cache[tok] = self._lookup(tok)
        return hit

    def _lookup(self, tok: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            text = f"token_id:{tok}"
            return text, list(text.encode())
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(tok)
            table = _byte_level_decoder()
            if isinstance(piece, str) and piece and all(c in table for c in piece):
                raw = bytes(table[c] for c in piece)
                return raw.decode("utf-8", errors="replace"), list(raw)
        if self.sentencepiece and tok not in self.special_ids:
            piece = self.tokenizer.convert_ids_to_tokens(tok)
            byte = SPIECE_BYTE.fullmatch(piece or "")
            raw = bytes([int(byte.group(1), 16)]) if byte else \
                (piece or "").replace(SPIECE_SPACE, " ").encode()
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tokenizer.decode([tok])
        return text, list(text.encode())

    @property
    def special_ids(self) -> set[int]:
        """The tokenizer's special tokens (EOS, chat markers, ...)."""
        if self._specials is None:
            specials = set(getattr(self.tokenizer, "all_special_ids", []) or [])
            # all_special_ids holds only the named ones (bos, eos, unk, pad, additional);
            # other added tokens flagged special (Llama 3's <|start_header_id|>, SmolLM's
            # <filename>) are special too: decode(skip_special_tokens=True) drops them.
            added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
            specials |= {i for i, t in added.items() if getattr(t, "special", False)}
            self._specials = specials
        return self._specials

    def vocab_bytes(self, size: int) -> list[bytes]:
        """Every token's bytes, ids 0 .. size - 1 (computed once, then cached here)."""
        if self._table is None or len(self._table) != size:
            self._table = [bytes(self(t)[1]) for t in range(size)]
        return self._table


