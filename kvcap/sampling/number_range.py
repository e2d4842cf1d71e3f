"""Regular expressions for JSON numbers inside bounds: what `minimum`, `maximum`,
`exclusiveMinimum` and `exclusiveMaximum` compile to in a structured-output schema.

The numbers are written in plain decimal, without an exponent (-?(0|[1-9][0-9]*)(\\.[0-9]+)?;
integers without the fraction), and never as "-0": a stricter spelling than JSON allows, so
that the set of strings is a regular language a digit at a time. A value is compared as the
decimal it spells; bounds are read the same way (a float bound as its shortest repr, 0.1 as
0.1, not the binary float nearest to it).

How: a number splits into its sign, integer part I and fraction digits F. For each sign the
bounds become an interval of magnitudes; I strictly inside the interval's integer parts takes
any fraction, and I equal to an end's integer part takes the fractions that keep the value on
the right side of that end (`_fraction`, digit by digit).

`multipleOf` is an automaton rather than an expression (`multiple_nfa`): with the step
m = p / 10^s, a number is a multiple of m when its digits up to s places after the point, read
as an integer, are divisible by p and any further digits are zeros; the states keep that
integer's remainder mod p. The schema compiler intersects it with the bounds' expression.
"""

from __future__ import annotations

from decimal import Decimal
from math import ceil, floor

from kvcap.sampling.regex import Nfa

# A bound: (value, exclusive), or None when that side is open.
Bound = tuple[Decimal, bool] | None
# Fraction digits still to compare against a bound's: (digits, exclusive), None = satisfied.
_Tail = tuple[str, bool] | None


def number_regex(low: Bound, high: Bound, integer: bool) -> str | None:
    """The regex of the plain-decimal JSON numbers x with low <= x <= high (or < where
    exclusive); None when no number is in range."""
    if integer:
        lo = None if low is None else _ceil_int(*low)
        hi = None if high is None else _floor_int(*high)
        if lo is not None and hi is not None and lo > hi:
            return None
        low = None if lo is None else (Decimal(lo), False)
        high = None if hi is None else (Decimal(hi), False)
    parts = []
    # x >= 0, written without a sign
    nonneg_low = (Decimal(0), False) if low is None or low[0] < 0 else low
    if high is None or high[0] > 0 or (high[0] == 0 and not high[1]):
        parts.append(_magnitude(nonneg_low, high, integer))
    # x < 0, written as "-" and a magnitude above 0
    if low is None or low[0] < 0:
        mag_low = (Decimal(0), True) if high is None or high[0] >= 0 else (-high[0], high[1])
        mag_high = None if low is None else (-low[0], low[1])
        neg = _magnitude(mag_low, mag_high, integer)
        parts.append(None if neg is None else f"-(?:{neg})")
    parts = [p for p in parts if p is not None]
    return "|".join(f"(?:{p})" for p in parts) if parts else None


def _ceil_int(value: Decimal, exclusive: bool) -> int:
    return floor(value) + 1 if exclusive else ceil(value)


def _floor_int(value: Decimal, exclusive: bool) -> int:
    return ceil(value) - 1 if exclusive else floor(value)


def _magnitude(low: tuple[Decimal, bool], high: Bound, integer: bool) -> str | None:
    """Unsigned numbers I(.F)? with value in [low, high] (low >= 0)."""
    lo_int, lo_frac = _split(low[0])
    lo_tail: _Tail = (lo_frac, low[1]) if lo_frac or low[1] else None
    if high is not None:
        hi_int, hi_frac = _split(high[0])
        if hi_int < lo_int:
            return None
        hi_tail: _Tail = (hi_frac, high[1])
    pieces = []
    if high is not None and hi_int == lo_int:
        pieces.append((int_range(lo_int, lo_int), _fraction(lo_tail, hi_tail, integer)))
    else:
        pieces.append((int_range(lo_int, lo_int), _fraction(lo_tail, None, integer)))
        middle_hi = None if high is None else hi_int - 1
        if middle_hi is None or middle_hi >= lo_int + 1:
            pieces.append((int_range(lo_int + 1, middle_hi), _fraction(None, None, integer)))
        if high is not None:
            pieces.append((int_range(hi_int, hi_int), _fraction(None, hi_tail, integer)))
    out = []
    for int_part, frac in pieces:
        if frac is None:
            continue
        digits, empty_ok = frac
        if digits is None:
            out.append(int_part)
        elif empty_ok:
            out.append(f"(?:{int_part})(?:\\.(?:{digits}))?")
        else:
            out.append(f"(?:{int_part})\\.(?:{digits})")
    return "|".join(out) if out else None


def _split(value: Decimal) -> tuple[int, str]:
    """A non-negative decimal's integer part and its fraction digits (no trailing zeros)."""
    whole = floor(value)
    frac = value - whole
    if not frac:
        return whole, ""
    digits = format(frac, "f").split(".")[1].rstrip("0")
    return whole, digits


def _fraction(low: _Tail, high: _Tail, integer: bool) -> tuple[str | None, bool] | None:
    """The fractions F (digit strings; empty = no fraction written, value 0) with
    0.low <= 0.F <= 0.high (strict where the tail says), as (regex of the non-empty ones or
    None, whether the empty one is in); None when there are none at all."""
    if integer:
        ok = _fraction_fits_zero(low, high)
        return (None, True) if ok else None
    nonempty = _nonempty_fraction(low, high)
    empty_ok = _fraction_fits_zero(low, high)
    if nonempty is None and not empty_ok:
        return None
    return nonempty, empty_ok


def _fraction_fits_zero(low: _Tail, high: _Tail) -> bool:
    low_ok = low is None or (low[0] == "" and not low[1])
    high_ok = high is None or high[0] != "" or not high[1]
    return low_ok and high_ok


def _nonempty_fraction(low: _Tail, high: _Tail) -> str | None:
    """Regex of the non-empty digit strings F within the tails, or None when there are none."""
    if low == ("", False):
        low = None
    if high is not None and high[0] == "" and high[1]:
        return None  # 0.F < 0: nothing
    if high is not None and high[0] == "":  # 0.F <= 0: all zeros, if the lower end allows it
        return "0+" if low is None else None
    if low is None and high is None:
        return "[0-9]+"
    if low == ("", True) and high is None:
        return "[0-9]*[1-9][0-9]*"
    # the first digit decides or passes the comparison on to the rest
    by_rest: dict[tuple[_Tail, _Tail], list[int]] = {}
    for d in range(10):
        rest = (_after_digit_low(low, d), _after_digit_high(high, d))
        if rest[0] != "fail" and rest[1] != "fail":
            by_rest.setdefault(rest, []).append(d)
    alternatives = []
    for (lo_rest, hi_rest), digits in by_rest.items():
        cls = _digit_class(digits)
        tail = _nonempty_fraction(lo_rest, hi_rest)
        tail_empty = _fraction_fits_zero(lo_rest, hi_rest)
        if tail is not None and tail_empty:
            alternatives.append(f"{cls}(?:{tail})?")
        elif tail is not None:
            alternatives.append(f"{cls}(?:{tail})")
        elif tail_empty:
            alternatives.append(cls)
    return "|".join(alternatives) if alternatives else None


def _after_digit_low(low: _Tail, d: int):
    if low is None:
        return None
    digits, strict = low
    if digits == "":  # strict: 0.F > 0 until a non-zero digit
        return None if d > 0 else low
    first = int(digits[0])
    return None if d > first else (digits[1:], strict) if d == first else "fail"


def _after_digit_high(high: _Tail, d: int):
    if high is None:
        return None
    digits, strict = high
    first = int(digits[0])
    return None if d < first else (digits[1:], strict) if d == first else "fail"


def _digit_class(digits: list[int]) -> str:
    if len(digits) == 1:
        return str(digits[0])
    if digits == list(range(digits[0], digits[-1] + 1)):
        return f"[{digits[0]}-{digits[-1]}]"
    return "[" + "".join(map(str, digits)) + "]"


def int_range(lo: int, hi: int | None) -> str:
    """Regex of the canonical decimals (no leading zeros) of the integers in [lo, hi]
    (0 <= lo; hi None = no upper end)."""
    parts = []
    length = len(str(lo))
    while hi is None or length <= len(str(hi)):
        first = 10 ** (length - 1) if length > 1 else 0
        last = 10 ** length - 1
        a, z = max(lo, first), last if hi is None else min(hi, last)
        if hi is None and a == first and length > 1:
            parts.append(f"[1-9][0-9]{{{length - 1},}}")  # this length and every longer one
            break
        if a <= z:
            parts.append(_same_length(str(a), str(z)))
        length += 1
    return "|".join(parts)


def _same_length(a: str, z: str) -> str:
    """Regex of the digit strings of a's length from a to z (a <= z, same length). A first
    digit whose rest spans every string (00..0 to 99..9) joins the middle class, which keeps
    the pattern linear in the number of digits."""
    if a == z:
        return a
    n = len(a) - 1
    if n == 0:
        return _digit_class(list(range(int(a), int(z) + 1)))
    if a[0] == z[0]:
        return f"{a[0]}(?:{_same_length(a[1:], z[1:])})"
    low_full, high_full = a[1:] == "0" * n, z[1:] == "9" * n
    parts = [] if low_full else [f"{a[0]}(?:{_same_length(a[1:], '9' * n)})"]
    middle = list(range(int(a[0]) + (not low_full), int(z[0]) + high_full))
    if middle:
        parts.append(f"{_digit_class(middle)}[0-9]{{{n}}}")
    if not high_full:
        parts.append(f"{z[0]}(?:{_same_length('0' * n, z[1:])})")
    return "|".join(parts)



def multiple_nfa(step: Decimal, integer: bool) -> Nfa:
    """The decimal numbers, optionally signed, that are multiples of `step` > 0 (spelling
    left to the bounds' expression it is intersected with)."""
    places = max(0, -step.normalize().as_tuple().exponent)  # s
    p = int(step.scaleb(places))
    nfa = Nfa()
    accept, start, first = nfa.new(), nfa.new(), nfa.new()
    nfa.start_state, nfa.accept_state = start, accept

    def move(src: int, ch: str, dst: int) -> None:
        nfa.moves[src].append((((ord(ch), ord(ch)),), dst))

    def layer() -> list[int]:  # one state per remainder mod p
        return [nfa.new() for _ in range(p)]

    def digits(src: int, r: int, targets: list[int]) -> None:
        for d in range(10):
            move(src, str(d), targets[(10 * r + d) % p])

    def may_end(state: int, r: int, places_left: int) -> None:
        if r * 10 ** places_left % p == 0:  # the missing places read as zeros
            nfa.eps[state].append(accept)

    move(start, "-", first)
    nfa.eps[start].append(first)
    ints = layer()
    digits(first, 0, ints)
    for r in range(p):
        digits(ints[r], r, ints)
        may_end(ints[r], r, places)
    if integer:
        return nfa
    dots, fracs, zeros = layer(), [layer() for _ in range(places)], layer()
    for r in range(p):
        move(ints[r], ".", dots[r])
        if places:
            digits(dots[r], r, fracs[0])
        else:
            move(dots[r], "0", zeros[r])
        for j in range(places):
            if j + 1 < places:
                digits(fracs[j][r], r, fracs[j + 1])
            else:  # past s places only zeros, which leave the remainder as it is
                move(fracs[j][r], "0", zeros[r])
            may_end(fracs[j][r], r, places - j - 1)
        move(zeros[r], "0", zeros[r])
        may_end(zeros[r], r, 0)
    return nfa
