"""Incremental detokenization: each step decodes only the last few tokens, not the whole output.

Byte-level BPE tokens may end mid-character, so a token's text is only known once the bytes
after it arrive. We keep two offsets into the output ids: text is decoded from `prefix` (a
point a few tokens back, so merges across the boundary render correctly) and compared with
the text of `prefix:read`; the difference is new, unless it ends in an incomplete character
(U+FFFD), in which case we wait for more tokens.

SentencePiece tokenizers (Llama 2, Mistral 7B) need two more rules:
- their decoders drop the text's first space ("\u2581hello" alone is "hello"), but the output
  continues the prompt: its text is decoded after an anchor token and the anchor's text cut
  off, so the first token's space stays (as vLLM's, which decodes after the prompt's last
  tokens, and as structured output's grammar saw it: kvcap/engine/token_bytes.py);
- their ByteFallback decoder renders a run of <0xNN> tokens that is not valid UTF-8 as one
  U+FFFD per token, valid bytes ("V" as <0x56>) and whole characters of the run included, so a
  later byte token can rewrite text already streamed: nothing is released while the output
  ends in a byte token.
"""

from __future__ import annotations

from kvcap.engine.token_bytes import SPIECE_BYTE, SPIECE_SPACE, describe_decoder


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._prefix = 0
        self._read = 0
        self._anchor: list[int] = []
        self._anchor_text = ""
        self._byte_fallback = False
        self._is_byte: dict[int, bool] = {}
        self._skipped: set[int] = set()
        if tokenizer is not None:
            self._inspect(tokenizer)

    def _inspect(self, tokenizer) -> None:
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        if decoder is None or type(decoder).__name__ == "ByteLevel":
            return
        desc = describe_decoder(decoder)
        self._byte_fallback = "ByteFallback" in desc
        if self.skip_special_tokens:  # dropped before the decoder: byte runs join across them
            specials = set(getattr(tokenizer, "all_special_ids", []) or [])
            added = getattr(tokenizer, "added_tokens_decoder", None) or {}
            self._skipped = specials | {i for i, t in added.items()
                                        if getattr(t, "special", False)}
        if SPIECE_SPACE not in desc:
            return
        unk = getattr(tokenizer, "unk_token_id", None)
        for piece in ("a", "x", "e", "0", "."):  # a plain piece that renders as itself
            tid = tokenizer.convert_tokens_to_ids(piece)
            if tid is None or tid == unk or tid in self._skipped:
                continue
            text = tokenizer.decode([tid], skip_special_tokens=False,
                                    clean_up_tokenization_spaces=False)
            if text == piece:
                self._anchor, self._anchor_text = [tid], text
                return

    def decode(self, ids: list[int]) -> str:
        """The text of output ids `ids` as this detokenizer renders it (anything that takes
        offsets into `self.text`, such as a stop-string search, must decode through this)."""
        return self._decode(ids) if self.tokenizer is not None else ""

    def _decode(self, ids: list[int]) -> str:
        # Never "clean up tokenization spaces" (" ." -> ".", " 's" -> "'s"; asked by some
        # tokenizer configs, Llama 3's among them, and done by transformers 4, or by 5 for
        # non-BPE models): that rewrite depends on the token after the space, so text already
        # streamed would disagree with later decodes (the "." was lost from the stream).
        # vLLM's output text is never cleaned up either.
        if self._anchor and ids:
            text = self.tokenizer.decode(self._anchor + list(ids),
                                         skip_special_tokens=self.skip_special_tokens,
                                         clean_up_tokenization_spaces=False)
            if text.startswith(self._anchor_text):
                return text[len(self._anchor_text):]
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _ends_in_byte_run(self, ids: list[int]) -> bool:
        """The output's last decoded token is a <0xNN> byte token (ByteFallback decoders)."""
        if not self._byte_fallback:
            return False
        for tok in reversed(ids):
            if tok in self._skipped:
                continue
            hit = self._is_byte.get(tok)
            if hit is None:
                piece = self.tokenizer.convert_ids_to_tokens(tok)
                hit = self._is_byte[tok] = isinstance(piece, str) and \
                    SPIECE_BYTE.fullmatch(piece) is not None
            return hit
        return False

    def holds_back(self, ids: list[int], text: str) -> bool:
        """Would `update` keep back the text of output ids `ids` (`text`, their decode): the
        output ends mid-character or in a byte run? One-token steps then search no new text."""
        return text.endswith("\ufffd") or self._ends_in_byte_run(ids)

    def pending(self, ids: list[int]) -> bool:
        """Are some of output ids `ids` not yet rendered in `self.text` (kept back)?"""
        return self.tokenizer is not None and len(ids) > self._read

    def update(self, ids: list[int]) -> str:
        """All text for output ids `ids` (a list that only ever grows); returns self.text."""
        if self.tokenizer is None or len(ids) <= self._read or self._ends_in_byte_run(ids):
            return self.text
        before = self._decode(ids[self._prefix:self._read])
        after = self._decode(ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(ids)
        return self.text

    def finish(self, ids: list[int]) -> str:
        """Final text: flush whatever is pending (an incomplete character stays as U+FFFD)."""
        if self.tokenizer is None:
            return self.text
        self.text = self._decode(ids)
        self._prefix = self._read = len(ids)
        return self.text
