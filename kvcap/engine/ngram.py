"""Draft tokens for speculative decoding by prompt lookup (n-gram matching). No torch.

A request's last n tokens are looked up among its earlier tokens (prompt and output); if
they occurred before, the tokens that followed that occurrence are proposed as the next
ones. The model then checks all of them in one forward (`model_runner.accept_draft` keeps the
ones it would have produced itself). Output that quotes, edits or repeats its input (code
edits, extraction, summaries that copy phrases, JSON that repeats keys) is where this pays.

Longer matches are tried first (n = `max_n` down to `min_n`); among occurrences of the same
n-gram the most recent wins. Each request keeps one index from an n-gram (every n, its key
tagged by n) to the position right after its latest occurrence, filled incrementally: each
step adds only the n-grams that end at the new tokens, to a dict, so a lookup costs O(max_n)
whatever the context length. A prompt (any run of VECTOR_FROM or more new tokens) is indexed
at once with numpy into sorted arrays searched by bisection, behind a byte filter that answers
most misses: ~17 bytes an n-gram instead of a dict entry's ~100 (a 128K-token prompt holds
6.8 MiB, not 40; docs/benchmarks/ngram-index-2026-12-05-cpu-*.json, from
`scripts/ngram_index_cost.py`). Keys are 64-bit polynomial hashes of the n-grams, not the
tuples; a collision can only propose a wrong draft, which verification rejects.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left

import numpy as np

from kvcap.engine.request import Request
from kvcap.errors import ConfigError

MAX_SPECULATIVE_TOKENS = 16  # drafts per step; beyond this the verify rows cost more than
MAX_LOOKUP_N = 16  # they can save on any batch (and the tables grow with n)


def check_ngram_settings(num_tokens: int, max_n: int, min_n: int) -> None:
    if not 0 <= num_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}] "
                          f"(0 turns speculative decoding off), got {num_tokens}")
    if not 1 <= min_n <= max_n <= MAX_LOOKUP_N:
        raise ConfigError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max "
                          f"<= {MAX_LOOKUP_N}, got min {min_n} and max {max_n}")


# An n-gram's key: the polynomial sum(t_j * P^(n-1-j)) mod 2^64, computed alike by numpy (whole
# prompts at once, uint64 arithmetic wraps) and by Python (a few new tokens a step).
_P = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
VECTOR_FROM = 256  # tokens to index at once from which numpy pays off


def ngram_key(tokens: list[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * _P + t) & _MASK
    return h


def _keys(toks: np.ndarray, n: int, count: int) -> np.ndarray:
    """Keys of the `count` n-grams starting at toks[0], toks[1], ... (uint64 toks)."""
    h = np.zeros(count, dtype=np.uint64)
    for j in range(n):
        h = h * np.uint64(_P) + toks[j:j + count]
    return h


def _tag(n: int) -> int:
    """XORed into an n-gram's key so that one index holds every n (a 64-bit odd constant)."""
    return (n * 0xD6E8FEB86659FD93) & _MASK


class _Sorted:
    """Tagged n-gram keys in order, each with the position after its latest occurrence: built
    with numpy, kept in `array`s (8 + 4 bytes an n-gram) and searched with `bisect`, whose
    per-call cost is a fraction of a numpy call's. Most probes miss (free text), so a byte
    filter (4-8 bytes an n-gram: a slot per high-bits prefix of the key) answers most misses
    before any search: ~80% of absent keys find their slot empty."""

    __slots__ = ("keys", "after", "filter", "shift")

    def __init__(self, keys: np.ndarray, after: np.ndarray):
        # Callers pass older entries first, so a stable sort by key leaves a key's latest last.
        order = np.argsort(keys, kind="stable")
        keys, after = keys[order], after[order]
        last = np.ones(len(keys), dtype=bool)
        last[:-1] = keys[1:] != keys[:-1]
        keys = keys[last]
        self.keys = array("Q", keys.tobytes())  # (uint64 already)
        self.after = array("i", after[last].astype(np.int32).tobytes())  # < 2^31 tokens
        bits = max(4, (4 * len(keys) - 1).bit_length())  # 2^bits >= 4 slots a key
        self.shift = 64 - bits
        slots = np.zeros(1 << bits, dtype=np.uint8)
        slots[keys >> np.uint64(self.shift)] = 1
        self.filter = slots.tobytes()

    def get(self, key: int) -> int | None:
        if not self.filter[key >> self.shift]:
            return None
        i = bisect_left(self.keys, key)
        return self.after[i] if i < len(self.keys) and self.keys[i] == key else None


class _Index:
    """The tagged n-grams (every n) ending before `end` -> the position after their latest
    occurrence: the sorted bulk (prompts) and, newer than all of it, a dict of the tokens added
    since."""

    __slots__ = ("end", "table", "bulk")

    def __init__(self):
        self.end = 0  # n-grams ending at positions < end are indexed
        self.table: dict[int, int] = {}
        self.bulk: _Sorted | None = None

    def add_bulk(self, keys: list[np.ndarray], after: list[np.ndarray]) -> None:
        """Index many n-grams at once (`keys[i]` with positions `after[i]`, each ascending),
        folding in what an earlier bulk and the dict held (a second bulk comes only after a
        long stretch without lookups), oldest first: `_Sorted` keeps the last of equal keys."""
        old_k, old_a = [], []
        if self.bulk is not None:
            old_k.append(np.frombuffer(self.bulk.keys, dtype=np.uint64))
            old_a.append(np.frombuffer(self.bulk.after, dtype=np.int32).astype(np.int64))
        if self.table:
            old_k.append(np.fromiter(self.table.keys(), np.uint64, len(self.table)))
            old_a.append(np.fromiter(self.table.values(), np.int64, len(self.table)))
            self.table.clear()
        self.bulk = _Sorted(np.concatenate(old_k + keys), np.concatenate(old_a + after))


class NgramProposer:
    def __init__(self, num_tokens: int, max_n: int = 4, min_n: int = 2):
        check_ngram_settings(num_tokens, max_n, min_n)
        self.num_tokens, self.max_n, self.min_n = num_tokens, max_n, min_n
        self._tags = [(n, _tag(n)) for n in range(max_n, min_n - 1, -1)]  # longest first
        self._index: dict[str, _Index] = {}

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to min(limit, num_tokens) tokens that may follow `req`'s tokens (maybe none)."""
        limit = min(limit, self.num_tokens)
        total = req.num_tokens
        if limit <= 0 or total <= self.min_n:
            return []
        idx = self._index.get(req.request_id)
        if idx is None:
            idx = self._index[req.request_id] = _Index()
        # Index the n-grams that end at positions idx.end .. total - 1: every one of them has at
        # least one token after it. (The n-gram ending at `total` is the one looked up.)
        lo = max(0, idx.end - self.max_n)
        toks = req.token_slice(lo, total)
        if total - idx.end >= VECTOR_FROM:  # a prompt: all its n-grams in a few numpy passes
            arr = np.asarray(toks, dtype=np.uint64)
            keys, after = [], []
            for n, tag in self._tags:
                first = max(idx.end, n)  # the first end position to add
                count = total - first
                if count > 0:
                    keys.append(_keys(arr[first - n - lo:], n, count) ^ np.uint64(tag))
                    after.append(np.arange(first, total, dtype=np.int64))
            if keys:
                idx.add_bulk(keys, after)
        else:
            table = idx.table
            for n, tag in self._tags:
                for e in range(max(idx.end, n), total):
                    table[ngram_key(toks[e - n - lo:e - lo]) ^ tag] = e
        idx.end = total
        table, bulk = idx.table, idx.bulk
        for n, tag in self._tags:  # longest first
            if total - lo < n:
                continue
            key = ngram_key(toks[total - n - lo:]) ^ tag
            after = table.get(key)  # the dict's entries are newer than the bulk's
            if after is None and bulk is not None:
                after = bulk.get(key)
            if after is not None:
                return req.token_slice(after, min(after + limit, total))
        return []

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)
