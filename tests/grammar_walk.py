"""Random walks through a structured-output grammar (tests/test_structured_output.py and
tests/test_structured_fuzz.py): random allowed bytes until the output is complete."""

from __future__ import annotations

import random

from kvcap.sampling.json_grammar import Grammar

ALPHABET = bytes(range(0x20, 0x7F)) + b"\n\xc3\xa9\xe4\xb8\x96"  # ASCII, é and a 3-byte 世


def random_walk(g: Grammar, rng: random.Random, limit: int = 400) -> bytes | None:
    """Random bytes the grammar allows, until it is complete (None if not within `limit`).
    Closing bytes grow likelier with length, so most walks end. A state that is neither
    complete nor continued by any byte fails the test."""
    state, out = g.start, bytearray()
    while len(out) < limit:
        if g.must_end(state) or (g.complete(state) and rng.random() < 0.3):
            return bytes(out)
        options = [(b, nxt) for b in ALPHABET if (nxt := g.feed(state, [b])) is not None]
        if not options:  # a dead end: no byte continues what the grammar accepted so far
            assert g.complete(state), f"dead end after {bytes(out)!r}"
            return bytes(out)
        weights = [1 + len(out) / 8 if b in b'}]"' else 1 for b, _ in options]
        b, state = rng.choices(options, weights)[0]
        out.append(b)
    return None
