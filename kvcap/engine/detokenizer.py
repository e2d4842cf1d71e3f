"""Incremental detokenization: each step decodes only the last few tokens, not the whole output.

Byte-level BPE tokens may end mid-character, so a token's text is only known once the bytes
after it arrive. We keep two offsets into the output ids: text is decoded from `prefix` (a
point a few tokens back, so merges across the boundary render correctly) and compared with
the text of `prefix:read`; the difference is new, unless it ends in an incomplete character
(U+FFFD), in which case we wait for more tokens.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        # Never "clean up tokenization spaces" (" ." -> ".", " 's" -> "'s"; asked by some
        # tokenizer configs, Llama 3's among them, and done by transformers 4, or by 5 for
        # non-BPE models): that rewrite depends on the token after the space, so text already
        # streamed would disagree with later decodes (the "." was lost from the stream).
        # vLLM's output text is never cleaned up either.
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def update(self, ids: list[int]) -> str:
        """All text for output ids `ids` (a list that only ever grows); returns self.text."""
        if self.tokenizer is None or len(ids) <= self._read:
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
