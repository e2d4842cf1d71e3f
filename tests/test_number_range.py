"""Bounded JSON numbers (kvcap/sampling/number_range.py): every plain-decimal spelling in a
grid is matched exactly when its decimal value lies within the bounds, checked against
Python's Decimal comparisons, for integer and fractional, inclusive and exclusive, one- and
two-sided, negative and positive bounds; and kvcap's own regex engine agrees with Python's re
on the generated patterns; multipleOf's automaton against Decimal remainders."""

from __future__ import annotations

import itertools
import re
from decimal import Decimal

import pytest

from kvcap.sampling.number_range import int_range, multiple_nfa, number_regex
from kvcap.sampling.regex import compile_regex, intersect

INTS = ["0", "1", "2", "9", "10", "11", "19", "20", "99", "100", "123", "1000"]
FRACS = [None, "0", "00", "5", "05", "1", "25", "3", "33", "9", "99", "001", "50"]
SPELLINGS = [sign + i + ("" if f is None else "." + f)
             for sign in ("", "-") for i in INTS for f in FRACS]
NOT_PLAIN = ["-0", "00", "01", "1.", "-", "1e5", "+1", ".5", "-00.5", "1.5.5"]
VALUES = ["0", "1", "-1", "0.5", "-0.5", "0.25", "1.5", "-1.5", "10", "-10", "0.05", "-0.05",
          "19.99", "100", "0.333", "-2.5", "11", "999.5"]
BOUNDS = [None] + [(Decimal(v), exclusive) for v in VALUES for exclusive in (False, True)]


def _within(x: Decimal, low, high) -> bool:
    above = low is None or (x > low[0] if low[1] else x >= low[0])
    below = high is None or (x < high[0] if high[1] else x <= high[0])
    return above and below


@pytest.mark.parametrize("integer", [False, True])
def test_number_regex_matches_exactly_the_spellings_within_bounds(integer):
    for low, high in itertools.product(BOUNDS, BOUNDS):
        pattern = number_regex(low, high, integer)
        rx = re.compile(pattern) if pattern else None
        for s in SPELLINGS:
            x = Decimal(s)
            spelt = not (s.startswith("-") and x == 0) and not (integer and "." in s)
            want = spelt and _within(x, low, high)
            assert bool(rx and rx.fullmatch(s)) == want, (low, high, integer, s, pattern)
        assert not (rx and any(rx.fullmatch(s) for s in NOT_PLAIN)), pattern
        if pattern is None:  # nothing in range: no spelling anywhere on the number line
            lo = low[0] if low else Decimal(-10 ** 9)
            hi = high[0] if high else Decimal(10 ** 9)
            grid = [lo + (hi - lo) * k / 64 for k in range(65)]
            assert not any(_within(x, low, high) and (not integer or x == int(x))
                           for x in grid), (low, high)


def test_int_range_is_every_canonical_integer_between():
    for lo in range(0, 240, 3):
        for hi in [None, *range(lo, 1100, 37)]:
            rx = re.compile(int_range(lo, hi))
            for x in range(0, 1300):
                assert bool(rx.fullmatch(str(x))) == (lo <= x and (hi is None or x <= hi))
            assert not any(rx.fullmatch(s) for s in ("01", "00", "007", ""))


def test_large_bounds_and_kvcaps_regex_engine_agree_with_python_re():
    cases = [((Decimal(-(2 ** 63)), False), (Decimal(2 ** 63 - 1), False), True),
             ((Decimal("1E-7"), True), (Decimal("1E+20"), False), False),
             ((Decimal("-3.14159"), False), (Decimal("2.71828"), True), False)]
    probes = ["0", "-9223372036854775808", "-9223372036854775809", "9223372036854775807",
              "9223372036854775808", "0.0000001", "0.00000011", "100000000000000000000",
              "100000000000000000000.5", "-3.14159", "-3.141591", "2.71828", "2.718279", "7"]
    for low, high, integer in cases:
        pattern = number_regex(low, high, integer)
        nfa = compile_regex(pattern)
        for s in probes:
            want = _within(Decimal(s), low, high) and not (integer and "." in s)
            assert bool(re.fullmatch(pattern, s)) == want, (s, pattern)
            states = nfa.start
            for ch in s:
                states = nfa.step(states, ord(ch))
            assert nfa.accepts(states) == want, s


@pytest.mark.parametrize("integer", [False, True])
def test_multiples_are_exactly_the_decimal_multiples(integer):
    spelling = compile_regex(number_regex(None, None, integer))
    for step in ["1", "2", "3", "7", "0.5", "0.25", "0.01", "2.5", "0.1", "10", "1.5", "0.002"]:
        nfa = intersect(spelling, multiple_nfa(Decimal(step), integer))
        for s in SPELLINGS:
            x = Decimal(s)
            spelt = not (s.startswith("-") and x == 0) and not (integer and "." in s)
            states = nfa.start
            for ch in s:
                states = nfa.step(states, ord(ch))
            assert nfa.accepts(states) == (spelt and x % Decimal(step) == 0), (step, s)
