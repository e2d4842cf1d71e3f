"""A read-only view of the first n items of a list that only grows at its end.

A streamed request's output is sent after every step with everything generated so far. Copying
the token ids (and logprobs) into each output made that O(length) per request and step (at 64
requests and ~1,600 tokens each it was most of the engine's output phase); a view is O(1) to
make and reads the request's own list. The engine hands views out only while the request runs
(its lists then only grow: a stop string may cut tokens of the current step, which no earlier
view covers) and plain lists in the final output.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any


class PrefixView(Sequence):
    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int | None = None):
        self._items = items
        self._n = len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step == 1:  # (indices() gives non-negative bounds here)
                return self._items[start:max(start, stop)]
            return [self._items[j] for j in range(start, stop, step)]
        if not -self._n <= i < self._n:
            raise IndexError("PrefixView index out of range")
        return self._items[i % self._n]

    def __iter__(self) -> Iterator:
        return islice(self._items, self._n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PrefixView | list | tuple):
            return len(other) == self._n and all(a == b for a, b in zip(self, other,
                                                                          strict=True))
        return NotImplemented

    __hash__ = None  # mutable underneath, like a list

    def __add__(self, other: Sequence) -> list:
        return list(self) + list(other)

    def __radd__(self, other: Sequence) -> list:
        return list(other) + list(self)

    def __repr__(self) -> str:
        return repr(list(self))
