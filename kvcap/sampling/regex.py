"""Regular expressions -> an NFA over Unicode code points, for structured output (`pattern`
and `format` in JSON schemas, vLLM's `guided_regex`).

The dialect is ECMA-262's (what JSON Schema names). The subset is the one schemas and guided
decoding use: literals, `.` (any character but a newline), classes `[a-z0-9_]` / `[^...]`,
escapes (`\\d \\w \\s` and their negations, `\\n \\t \\r \\f \\v`, `\\xHH`, `\\uHHHH`, escaped
punctuation), groups `( )` / `(?: )`, alternation `|`, and quantifiers `* + ? {n} {n,} {n,m}`
(lazy forms match the same language). `^` and `$` are accepted only at the start and end of a
top-level alternative (`^a|b$` is `(^a)|(b$)`). The text is checked by readers of other
dialects too (jsonschema: Python's `re`; pydantic: Rust's `regex`), which read `\\d \\w \\s` as
Unicode classes: a class takes only the characters that every one of these readers puts in it
(`_shorthand`), so `\\w` is ASCII and `\\W` no letter of any script. Syntax they read
differently (`\\01`, `a{,3}`) is refused. Back-references, look-around, named groups and flags
are refused with a RegexError that names them: a pattern is compiled exactly or not at all.

An `Nfa` runs as a set of states (`start`, `step`, `accepts`); sets are frozensets, so the
grammar's states that hold them stay hashable.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from functools import lru_cache

MAX_CODE = 0x10FFFF
MAX_STATES = 20_000  # a pattern larger than this (e.g. a{1000}{1000}) is refused
Ranges = tuple[tuple[int, int], ...]

DIGIT: Ranges = ((0x30, 0x39),)
WORD: Ranges = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
# ECMA-262's \s (what JSON Schema patterns use): ASCII blanks and Unicode spaces
SPACE: Ranges = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                 (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
                 (0xFEFF, 0xFEFF))
CONTROL_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}
ANY: Ranges = ((0, MAX_CODE),)
# Unicode's White_Space (Rust's \s)
WHITE_SPACE: Ranges = ((0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
                       (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
                       (0x3000, 0x3000))
# So characters that are Alphabetic (circled and squared letters: in Rust's \w)
OTHER_ALPHABETIC: Ranges = ((0x24B6, 0x24E9), (0x1F130, 0x1F149), (0x1F150, 0x1F169),
                            (0x1F170, 0x1F189))


class RegexError(ValueError):
    """A pattern kvcap cannot compile exactly; the message says where and why."""


def complement(r: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in sorted(r):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = max(nxt, hi + 1)
    if nxt <= MAX_CODE:
        out.append((nxt, MAX_CODE))
    return tuple(out)


def intersection(*parts: Ranges) -> Ranges:
    return complement(union(*(complement(p) for p in parts)))


READERS = 3  # ECMA-262, Python's re, Rust's regex: a class item's sets, one per reader


@lru_cache(maxsize=1)
def _unicode_classes() -> dict[str, tuple[Ranges, Ranges]]:
    """\\d \\w \\s to Python's re (found by re itself) and to Rust's regex (Unicode's Nd;
    Alphabetic, marks, Nd, connector punctuation and ZWNJ / ZWJ; White_Space). Rust's are
    taken a little wide (\\w as Python's and the marks and Pc), and both readers' \\d and
    \\w with the code points still unassigned here, which a newer Unicode may make digits or
    letters: safe, as a class only takes what every reader's holds (so \\D and \\W never
    write them). Planes 4-13 hold no assigned character and 15-16 only private use."""
    code = [*range(0xD800), *range(0xE000, 0x40000), *range(0xE0000, 0xF0000)]
    text = "".join(map(chr, code))

    gaps = [i for i in range(1, len(code)) if code[i] != code[i - 1] + 1]

    def found(pattern: str) -> Ranges:  # what re matches, as runs of code points
        runs = []
        for m in re.finditer(pattern, text):
            cuts = [m.start(), *(g for g in gaps if m.start() < g < m.end()), m.end()]
            runs += [(code[a], code[z - 1]) for a, z in zip(cuts, cuts[1:], strict=False)]
        return tuple(runs)

    def having(names: tuple[str, ...]) -> Ranges:  # runs of code points of these categories
        runs: list[list[int]] = []
        for c, k in zip(code, cats, strict=True):
            if k in names:
                if runs and runs[-1][1] == c - 1:
                    runs[-1][1] = c
                else:
                    runs.append([c, c])
        return tuple((a, z) for a, z in runs)

    cats = list(map(unicodedata.category, text))
    unassigned, marks = having(("Cn",)), having(("Mn", "Mc", "Me", "Pc"))
    digit, word, space = found(r"\d+"), found(r"\w+"), found(r"\s+")
    digit, word = union(digit, unassigned), union(word, unassigned)
    return {"d": (digit, digit),
            "w": (word, union(word, marks, OTHER_ALPHABETIC, ((0x200C, 0x200D),))),
            "s": (space, WHITE_SPACE)}


def _shorthand(c: str) -> tuple[Ranges, ...]:
    """`\\c` (d, w, s or upper case) as each reader reads it: ECMA-262 (ASCII \\d and \\w),
    Python's re and Rust's regex. A class takes the characters all of them put in it
    (`intersection` of its per-reader sets), so that the text matches wherever it is checked:
    ECMA's \\W let a model write "é" for `^\\W+$`, which jsonschema and pydantic reject."""
    ecma = {"d": DIGIT, "w": WORD, "s": SPACE}[c.lower()]
    sets = (ecma, *_unicode_classes()[c.lower()])
    return tuple(complement(r) for r in sets) if c.isupper() else sets


def _alike(r: Ranges) -> tuple[Ranges, ...]:
    """A set every reader reads the same (a character, a range)."""
    return (r,) * READERS


def union(*parts: Ranges) -> Ranges:
    merged: list[list[int]] = []
    for lo, hi in sorted(x for p in parts for x in p):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple((lo, hi) for lo, hi in merged)


class Nfa:
    """Thompson NFA: `moves[s]` = ((ranges, target), ...), `eps[s]` = epsilon targets."""

    def __init__(self) -> None:
        self.moves: list[list[tuple[Ranges, int]]] = []
        self.eps: list[list[int]] = []
        self.start_state = self.accept_state = 0
        self._closure: dict[frozenset[int], frozenset[int]] = {}
        self._steps: dict[tuple[frozenset[int], int], frozenset[int]] = {}
        self._any_steps: dict[frozenset[int], frozenset[int]] = {}
        self._fits: dict[tuple[frozenset[int], int, int | None], bool] = {}

    def new(self) -> int:
        if len(self.moves) >= MAX_STATES:
            raise RegexError(f"the pattern needs more than {MAX_STATES} states; simplify its "
                             f"repetition counts")
        self.moves.append([])
        self.eps.append([])
        return len(self.moves) - 1

    # -- running --------------------------------------------------------------------------
    @property
    def start(self) -> frozenset[int]:
        return self.closure(frozenset([self.start_state]))

    def closure(self, states: frozenset[int]) -> frozenset[int]:
        hit = self._closure.get(states)
        if hit is None:
            seen, todo = set(states), list(states)
            while todo:
                for t in self.eps[todo.pop()]:
                    if t not in seen:
                        seen.add(t)
                        todo.append(t)
            hit = self._closure[states] = frozenset(seen)
        return hit

    def step(self, states: frozenset[int], ch: int) -> frozenset[int]:
        """The states after character `ch` (empty: no match can continue)."""
        key = (states, ch)
        hit = self._steps.get(key)
        if hit is None:
            nxt = {t for s in states for ranges, t in self.moves[s]
                   if any(lo <= ch <= hi for lo, hi in ranges)}
            hit = self.closure(frozenset(nxt)) if nxt else frozenset()
            if len(self._steps) > 1 << 16:
                self._steps.clear()
            self._steps[key] = hit
        return hit

    def any_in(self, states: frozenset[int], lo: int, hi: int) -> bool:
        """Some character in [lo, hi] continues a match (for a character still being read:
        a UTF-8 lead byte, a \\u escape's first digits)."""
        return any(a <= hi and lo <= b for s in states for ranges, _ in self.moves[s]
                   for a, b in ranges)

    def step_any(self, states: frozenset[int]) -> frozenset[int]:
        """The states after any one character a JSON string can hold (every code point but
        the surrogate halves)."""
        hit = self._any_steps.get(states)
        if hit is None:
            nxt = {t for s in states for ranges, t in self.moves[s]
                   if any(not (0xD800 <= a and b <= 0xDFFF) for a, b in ranges)}
            hit = self.closure(frozenset(nxt)) if nxt else frozenset()
            if len(self._any_steps) > 1 << 16:
                self._any_steps.clear()
            self._any_steps[states] = hit
        return hit

    def fits(self, states: frozenset[int], at_least: int, at_most: int | None) -> bool:
        """Some match goes on from `states` to its end in at_least..at_most more characters
        (at_most None: no upper limit): what a string's minLength / maxLength leave a
        pattern. The sets reached after i characters follow one another deterministically,
        so past at_least a set seen twice means no end lies ahead."""
        key = (states, at_least, at_most)
        hit = self._fits.get(key)
        if hit is None:
            hit, seen, i = False, set(), 0
            first: dict[frozenset[int], int] = {}  # before at_least: set -> where first seen
            while states and (at_most is None or i <= at_most):
                if i >= at_least:
                    if self.accepts(states):
                        hit = True
                        break
                    if states in seen:
                        break
                    seen.add(states)
                else:
                    # a set seen before repeats with its period: skip whole periods towards
                    # at_least (a minLength of 10**9 took 10**9 steps, once per character
                    # of the output while it is under minLength)
                    j = first.setdefault(states, i)
                    skip = (at_least - i) // (i - j) * (i - j) if j < i else 0
                    if skip:
                        i += skip  # the same set, read again at its new index
                        continue
                states, i = self.step_any(states), i + 1
            if len(self._fits) > 1 << 16:
                self._fits.clear()
            self._fits[key] = hit
        return hit

    def continues_within(self, states: frozenset[int], lo: int, hi: int, at_least: int,
                         at_most: int | None) -> bool:
        """Some character in [lo, hi] continues a match that can then end in at_least..at_most
        more characters (any_in, with a string's length bounds)."""
        return any(a <= hi and lo <= b and self.fits(self.closure(frozenset([t])), at_least,
                                                     at_most)
                   for s in states for ranges, t in self.moves[s] for a, b in ranges)

    def accepts(self, states: frozenset[int]) -> bool:
        return self.accept_state in states

    def can_continue(self, states: frozenset[int]) -> bool:
        return any(self.moves[s] for s in states)

    def matches(self, text: str) -> bool:
        """The whole of `text` matches."""
        states = self.start
        for ch in text:
            states = self.step(states, ord(ch))
            if not states:
                return False
        return self.accepts(states)


@lru_cache(maxsize=64)
def compile_regex(pattern: str, search: bool = False) -> Nfa:
    """The NFA of `pattern` matched whole (search=True: JSON Schema's `pattern`, which may
    match anywhere in the string: each top-level alternative not anchored by ^ / $ is free
    on that side)."""
    parser = _Parser(pattern, search)
    nfa = Nfa()
    start, end = parser.parse(nfa)
    nfa.start_state, nfa.accept_state = start, end
    return nfa


def intersect(a: Nfa, b: Nfa) -> Nfa:
    """An NFA of the strings both match (a schema string's `pattern` and its `format`): the
    product of their reachable state pairs, a move wherever both move on a common character."""
    out = Nfa()
    ids: dict[tuple[int, int], int] = {}
    todo: list[tuple[int, int]] = []

    def state(pair: tuple[int, int]) -> int:
        if pair not in ids:
            ids[pair] = out.new()
            todo.append(pair)
        return ids[pair]

    out.start_state = state((a.start_state, b.start_state))
    while todo:
        p, q = pair = todo.pop()
        s = ids[pair]
        out.eps[s] += [state((p2, q)) for p2 in a.eps[p]] + [state((p, q2)) for q2 in b.eps[q]]
        for ranges_a, p2 in a.moves[p]:
            for ranges_b, q2 in b.moves[q]:
                common = complement(union(complement(ranges_a), complement(ranges_b)))
                if common:
                    out.moves[s].append((common, state((p2, q2))))
    out.accept_state = ids.get((a.accept_state, b.accept_state), None)
    if out.accept_state is None:  # never both at their ends: no string matches both
        out.accept_state = out.new()
    _prune(out)
    return out


def either(*nfas: Nfa) -> Nfa:
    """An NFA of the strings any of `nfas` matches: their states side by side, a new start
    and accept state joined to theirs by epsilon moves."""
    out = Nfa()
    out.start_state, out.accept_state = out.new(), out.new()
    for nfa in nfas:
        shift = len(out.moves)
        for _ in nfa.moves:
            out.new()
        for s, (moves, eps) in enumerate(zip(nfa.moves, nfa.eps, strict=True)):
            out.moves[s + shift] = [(r, t + shift) for r, t in moves]
            out.eps[s + shift] = [t + shift for t in eps]
        out.eps[out.start_state].append(nfa.start_state + shift)
        out.eps[nfa.accept_state + shift].append(out.accept_state)
    return out


def excluding(words: Iterable[str]) -> Nfa:
    """An NFA of every string but `words`: a trie of them whose nodes accept except where a
    word ends, and a sink that takes any character once the text leaves the trie."""
    out = Nfa()
    out.start_state = out.new()
    sink, out.accept_state = out.new(), out.new()
    children: dict[int, dict[int, int]] = {out.start_state: {}}
    ends: set[int] = set()
    for word in words:
        s = out.start_state
        for ch in map(ord, word):
            if ch not in children[s]:
                children[s][ch] = out.new()
                children[children[s][ch]] = {}
            s = children[s][ch]
        ends.add(s)
    for s, kids in children.items():
        for ch, t in kids.items():
            out.moves[s].append((((ch, ch),), t))
        rest = complement(tuple((ch, ch) for ch in sorted(kids)))
        if rest:
            out.moves[s].append((rest, sink))
        if s not in ends:
            out.eps[s].append(out.accept_state)
    out.moves[sink].append((((0, MAX_CODE),), sink))
    out.eps[sink].append(out.accept_state)
    return out


def _prune(nfa: Nfa) -> None:
    """Drop the edges into states from which the accept state cannot be reached. A product
    has such states (one side still matching, the other not), and a grammar must never let a
    character into one: no byte would then continue the output and it could not end."""
    back: list[list[int]] = [[] for _ in nfa.moves]
    for s, (moves, eps) in enumerate(zip(nfa.moves, nfa.eps, strict=True)):
        for t in [t for _, t in moves] + eps:
            back[t].append(s)
    live, todo = {nfa.accept_state}, [nfa.accept_state]
    while todo:
        for s in back[todo.pop()]:
            if s not in live:
                live.add(s)
                todo.append(s)
    nfa.moves = [[(r, t) for r, t in moves if t in live] for moves in nfa.moves]
    nfa.eps = [[t for t in eps if t in live] for eps in nfa.eps]


class _Parser:
    """Recursive descent: alternation -> concatenation -> repeated atoms. Each piece is kept
    as a small syntax tree first, so that a counted repeat can build its copies."""

    def __init__(self, pattern: str, search: bool):
        self.s, self.i, self.search = pattern, 0, search

    def fail(self, why: str) -> RegexError:
        return RegexError(f"pattern {self.s!r}: {why} (at offset {min(self.i, len(self.s))})")

    def parse(self, nfa: Nfa) -> tuple[int, int]:
        tree = self.alternation(top=True)
        if self.i != len(self.s):
            raise self.fail(f"unexpected {self.s[self.i]!r}")
        return _build(tree, nfa)

    def peek(self) -> str | None:
        return self.s[self.i] if self.i < len(self.s) else None

    def alternation(self, top: bool = False):
        branches = [self.concatenation(top)]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.concatenation(top))
        return ("alt", branches) if len(branches) > 1 else branches[0]

    def concatenation(self, top: bool = False):
        """A top-level alternative may open with ^ and close with $, which anchor it alone
        (`^a|b$` is (^a)|(b$): the anchors were once taken off the whole pattern, so a
        searched one matched only "a" or "b" and `^a$|^b$` was refused). Matched whole, the
        anchors change nothing; searched, an alternative is free on each unanchored side."""
        items = []
        start = top and self.peek() == "^"
        end = False
        self.i += start
        while self.peek() is not None and self.peek() not in "|)":
            if top and self.peek() == "$" and self.s[self.i + 1:self.i + 2] in ("", "|"):
                self.i, end = self.i + 1, True
                break
            items.append(self.repeat())
        if top and self.search:
            anything = ("rep", ("set", ANY), 0, None)
            items = [anything] * (not start) + items + [anything] * (not end)
        return ("seq", items)

    def repeat(self):
        atom = self.atom()
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and self._counted():
                lo, hi = self._counts()
            else:
                if c == "{" and self.s[self.i + 1:self.i + 2] == ",":
                    # a{,3} / a{,}: a{0,3} / a* to Python's re, the text "a{,3}" to ECMA-262
                    # (which kvcap wrote, and Python's re.fullmatch then refused)
                    j = self.s.find("}", self.i)
                    hi = self.s[self.i + 2:j] if j > 0 else "x"
                    if hi == "" or (hi.isascii() and hi.isdigit()):
                        raise self.fail("{,n} is a count to Python's re and text to "
                                        "ECMA-262; write {0,n}, or \\{ for the text")
                return atom
            if self.peek() == "?":  # lazy: the same set of strings
                self.i += 1
            elif self.peek() == "+":
                raise self.fail("possessive quantifiers are not supported")
            atom = ("rep", atom, lo, hi)

    def _counted(self) -> bool:
        j = self.s.find("}", self.i)
        inner = self.s[self.i + 1:j] if j > 0 else ""
        # ASCII digits only: str.isdigit takes "²" too, which int() then refuses
        return bool(inner) and all(p.isascii() and p.isdigit() for p in inner.split(",", 1)
                                   if p) and inner.count(",") <= 1 and inner[0].isdigit()

    def _counts(self) -> tuple[int, int | None]:
        j = self.s.index("}", self.i)
        lo_s, _, hi_s = self.s[self.i + 1:j].partition(",")
        lo = int(lo_s)
        hi = lo if "," not in self.s[self.i + 1:j] else (int(hi_s) if hi_s else None)
        if hi is not None and hi < lo:
            raise self.fail(f"repeat {{{lo},{hi}}} has its maximum below its minimum")
        self.i = j + 1
        return lo, hi

    def atom(self):
        c = self.peek()
        if c == "(":
            self.i += 1
            if self.s.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.fail("look-around, named groups and inline flags are not "
                                "supported")
            inner = self.alternation()
            if self.peek() != ")":
                raise self.fail("unbalanced parenthesis")
            self.i += 1
            return inner
        if c == "[":
            return ("set", self.klass())
        if c == ".":
            self.i += 1
            return ("set", complement(((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))))
        if c in ("*", "+", "?") or (c == "{" and self._counted()):
            raise self.fail(f"nothing to repeat before {c!r}")
        if c in ("^", "$"):
            raise self.fail(f"{c!r} is supported only at the ends of the pattern or of a "
                            f"top-level alternative")
        if c == "\\":
            return ("set", intersection(*self.escape(in_class=False)))
        self.i += 1
        return ("set", ((ord(c), ord(c)),))

    def escape(self, in_class: bool) -> tuple[Ranges, ...]:
        """The escaped character or class as each reader reads it (`_shorthand`)."""
        self.i += 1
        c = self.peek()
        if c is None:
            raise self.fail("a pattern cannot end with a backslash")
        self.i += 1
        if c.lower() in ("d", "w", "s"):
            return _shorthand(c)
        if c == "0" and self.peek() is not None and self.peek() in "01234567":
            # \01 is the octal escape \x01 to Python's re and ECMA-262's web reading; kvcap
            # read NUL then "1" (\08 is NUL then "8" to all)
            raise self.fail("octal escapes (\\0 and an octal digit) are not supported; "
                            "write \\xHH")
        if c in CONTROL_ESCAPES:
            return _alike(((CONTROL_ESCAPES[c],) * 2,))
        if c in ("x", "u"):
            n = 2 if c == "x" else 4
            digits = self.s[self.i:self.i + n]
            if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"\\{c} needs {n} hex digits")
            self.i += n
            code = int(digits, 16)
            return _alike(((code, code),))
        if c == "b" and in_class:
            return _alike(((0x08, 0x08),))
        if c.isalnum():
            raise self.fail(f"\\{c} is not supported (back-references, word boundaries and "
                            f"other assertions)")
        return _alike(((ord(c), ord(c)),))

    def klass(self) -> Ranges:
        """A class: its items' union (negated: the rest) as each reader reads it, then the
        characters every reader's class holds (`_shorthand`: [\\w\\W] stays every character)."""
        self.i += 1
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        parts: list[tuple[Ranges, ...]] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.fail("unterminated character class")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self._class_item()
            if self.peek() == "-" and self.s[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self._class_item()
                a, z = _single(lo), _single(hi)
                if a is None or z is None:
                    raise self.fail("a class range needs single characters at both ends")
                if z < a:
                    raise self.fail("a class range runs backwards")
                parts.append(_alike(((a, z),)))
            else:
                parts.append(lo)
        per_reader = [union(*(p[k] for p in parts)) for k in range(READERS)]
        return intersection(*(complement(r) if negate else r for r in per_reader))

    def _class_item(self) -> tuple[Ranges, ...]:
        c = self.peek()
        if c == "\\":
            return self.escape(in_class=True)
        self.i += 1
        return _alike(((ord(c), ord(c)),))


def _single(item: tuple[Ranges, ...]) -> int | None:
    """The character a class item is, or None for a class (\\d ...)."""
    first = item[0]
    if len(first) == 1 and first[0][0] == first[0][1] and all(r == first for r in item):
        return first[0][0]
    return None


def _build(tree, nfa: Nfa) -> tuple[int, int]:
    """Thompson construction of a syntax tree: its (entry, exit) states."""
    kind = tree[0]
    if kind == "set":
        a, b = nfa.new(), nfa.new()
        nfa.moves[a].append((tree[1], b))
        return a, b
    if kind == "seq":
        a = b = nfa.new()
        for item in tree[1]:
            s, e = _build(item, nfa)
            nfa.eps[b].append(s)
            b = e
        return a, b
    if kind == "alt":
        a, b = nfa.new(), nfa.new()
        for branch in tree[1]:
            s, e = _build(branch, nfa)
            nfa.eps[a].append(s)
            nfa.eps[e].append(b)
        return a, b
    _, item, lo, hi = tree  # "rep"
    a = b = nfa.new()
    for _ in range(lo):
        s, e = _build(item, nfa)
        nfa.eps[b].append(s)
        b = e
    if hi is None:  # then any number more
        s, e = _build(item, nfa)
        nfa.eps[b].append(s)
        nfa.eps[e].append(s)
        end = nfa.new()
        nfa.eps[b].append(end)
        nfa.eps[e].append(end)
        return a, end
    end = nfa.new()
    nfa.eps[b].append(end)
    for _ in range(hi - lo):  # each optional copy may be the last
        s, e = _build(item, nfa)
        nfa.eps[b].append(s)
        nfa.eps[e].append(end)
        b = e
    return a, end
