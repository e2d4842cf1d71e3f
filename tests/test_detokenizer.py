"""Incremental detokenization equals decoding the whole output, at every step."""

from __future__ import annotations

import random

from kvcap.engine.detokenizer import IncrementalDetokenizer
from kvcap.models.loader import load_tokenizer


def test_incremental_equals_full_decode(default_model_dir):
    tok = load_tokenizer(default_model_dir)
    text = "Grüße aus Köln — naïve café, 東京 and emoji 🚀🎉! def f(x):\n    return x ** 2\n"
    ids = tok.encode(text * 3, add_special_tokens=False)
    rng = random.Random(0)
    ids += [rng.randrange(tok.vocab_size) for _ in range(200)]  # arbitrary byte fragments
    detok = IncrementalDetokenizer(tok)
    for n in range(1, len(ids) + 1):
        partial = detok.update(ids[:n])
        full = tok.decode(ids[:n], skip_special_tokens=True)
        assert full.startswith(partial), n
    assert detok.finish(ids) == tok.decode(ids, skip_special_tokens=True)
