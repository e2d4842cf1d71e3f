"""Draft tokens for speculative decoding by prompt lookup (n-gram matching). No torch.

A request's last n tokens are looked up among its earlier tokens (prompt and output); if
they occurred before, the tokens that followed that occurrence are proposed as the next
ones. The model then checks all of them in one forward (`model_runner.accept_draft` keeps the
ones it would have produced itself). Output that quotes, edits or repeats its input (code
edits, extraction, summaries that copy phrases, JSON that repeats keys) is where this pays.

Longer matches are tried first (n = `max_n` down to `min_n`); among occurrences of the same
n-gram the most recent wins. Each request keeps one table per n mapping an n-gram to the
position right after its latest occurrence, filled incrementally: indexing the prompt is
linear once, and each step adds only the n-grams that end at the new tokens, so a lookup
costs O(max_n) whatever the context length; a prompt is indexed with numpy (`_keys`). Keys are
64-bit polynomial hashes of the n-grams, not the tuples (a third of the memory); a collision
can only propose a wrong draft, which verification rejects.
"""

from __future__ import annotations

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


def _keys(toks: np.ndarray, n: int, count: int) -> list[int]:
    """Keys of the `count` n-grams starting at toks[0], toks[1], ... (uint64 toks)."""
    h = np.zeros(count, dtype=np.uint64)
    for j in range(n):
        h = h * np.uint64(_P) + toks[j:j + count]
    return h.tolist()


class _Index:
    """key(n-gram) -> position after its latest occurrence, for n-grams ending before `end`."""

    __slots__ = ("end", "tables")

    def __init__(self, ns: range):
        self.end = 0  # n-grams ending at positions < end are in the tables
        self.tables = {n: {} for n in ns}


class NgramProposer:
    def __init__(self, num_tokens: int, max_n: int = 4, min_n: int = 2):
        check_ngram_settings(num_tokens, max_n, min_n)
        self.num_tokens, self.max_n, self.min_n = num_tokens, max_n, min_n
        self._ns = range(max_n, min_n - 1, -1)  # longest first
        self._index: dict[str, _Index] = {}

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to min(limit, num_tokens) tokens that may follow `req`'s tokens (maybe none)."""
        limit = min(limit, self.num_tokens)
        total = req.num_tokens
        if limit <= 0 or total <= self.min_n:
            return []
        idx = self._index.get(req.request_id)
        if idx is None:
            idx = self._index[req.request_id] = _Index(self._ns)
        # Index the n-grams that end at positions idx.end .. total - 1: every one of them has at
        # least one token after it. (The n-gram ending at `total` is the one looked up.)
        lo = max(0, idx.end - self.max_n)
        toks = req.token_slice(lo, total)
        if total - idx.end >= VECTOR_FROM:  # a prompt: all its n-grams in a few numpy passes
            arr = np.asarray(toks, dtype=np.uint64)
            for n, table in idx.tables.items():
                first = max(idx.end, n)  # the first end position to add
                count = total - first
                if count > 0:  # (dict.update keeps the last, i.e. latest, of equal keys)
                    table.update(zip(_keys(arr[first - n - lo:], n, count),
                                     range(first, total), strict=True))
        else:
            for n, table in idx.tables.items():
                for e in range(max(idx.end, n), total):
                    table[ngram_key(toks[e - n - lo:e - lo])] = e
        idx.end = total
        for n in self._ns:
            if total - lo < n:
                continue
            after = idx.tables[n].get(ngram_key(toks[total - n - lo:]))
            if after is not None:
                return req.token_slice(after, min(after + limit, total))
        return []

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)
