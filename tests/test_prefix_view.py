"""PrefixView behaves as the list of its first n items would, whatever the list does after."""

from __future__ import annotations

import pytest

from kvcap.engine.prefix_view import PrefixView

BOUNDS = [None, -9, -4, -1, 0, 1, 2, 5, 9]


@pytest.mark.parametrize("n", range(7))
def test_indexing_and_slicing_match_the_prefix(n):
    items = list(range(10, 17))
    view = PrefixView(items, n)
    items += [99, 98]  # grows after the view was made: the view does not
    ref = items[:n]
    for a in BOUNDS:
        for b in BOUNDS:
            for step in (None, 1, 2, -1, -3):
                assert view[a:b:step] == ref[a:b:step], (a, b, step)
    for i in range(-n, n):
        assert view[i] == ref[i]
    for i in (n, -n - 1):
        with pytest.raises(IndexError):
            view[i]
    assert len(view) == n and list(view) == ref and view == ref and view == tuple(ref)
    assert view != ref + [1] and (view == "x") is False
    assert view + [5] == ref + [5] and [5] + view == [5] + ref
    assert repr(view) == repr(ref) and list(reversed(view)) == ref[::-1]
    assert (12 in view) == (12 in ref)


def test_default_length_is_the_list_now():
    items = [1, 2]
    view = PrefixView(items)
    items.append(3)
    assert view == [1, 2]
