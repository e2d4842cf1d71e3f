"""Is this byte string the start of a JSON value that a grammar allows? The incremental
recogniser behind structured output (JSON mode, JSON schemas, fixed choices).

A `Grammar` is a list of nodes (built by `kvcap.sampling.json_schema`) and a root. Reading a
byte maps a state to the next one, or to None when no allowed output starts with the bytes so
far. A state is a frozenset of configurations, because a schema may allow several readings of
the same prefix (`anyOf`, enums, `1` against `12`); a configuration is (frames, ws): a stack of
immutable frames and the current whitespace run. States are hashable, so the engine keeps one
per request and memoises masks per state, and the grammar memoises its own steps.

Nodes (tuples, ids index `Grammar.nodes`):
    ("alt", ids)                            any of these nodes
    ("str", min_len, max_len | None)        a JSON string, its length in characters
    ("num", integer)                        a JSON number (integer: no fraction, no exponent)
    ("lit", bytes)                          exactly these bytes (true, an enum member, a choice)
    ("obj", props, required, extra, names, min_props, max_props | None, keys, deps)
                                            props: raw key bytes -> node; extra: the node of
                                            other keys' values, or None when only props may
                                            appear; each key at most once, in any order; once
                                            only the missing required keys fit under
                                            max_props, only they may come; keys: None, or
                                            what other keys must be (kvcap.sampling.
                                            object_keys): (gate nfa | None, min_len,
                                            max_len | None, ((nfa, value node), ...)), a key
                                            matching a class taking its node, others extra;
                                            deps: declared key -> the keys it requires
                                            (dependentRequired, closed under itself; required
                                            holds the required keys' own), a key coming only
                                            while it and what it requires fit max_props
    ("arr", items, min_items, max_items | None, prefix)
                                            prefix: the nodes of the first items, one each
                                            (JSON Schema's prefixItems); items: the rest's
    ("set", literals, groups, min_items, max_items | None)
                                            an array of distinct values from a fixed set
                                            (uniqueItems over enum items): literals' bytes,
                                            and per literal the id of its value (1 and 1.0
                                            are one value)
    ("pat", nfa, min_len, max_len | None)   a JSON string whose characters (escapes decoded)
                                            match a regular expression (kvcap.sampling.regex)
    ("re", nfa)                             raw text matching a regular expression: the root
                                            of a `raw` grammar (vLLM's guided_regex), or a
                                            JSON value spelt by one (a number inside bounds,
                                            kvcap.sampling.number_range), which like a
                                            number ends at the first byte that cannot
                                            continue it

kvcap's own limits, as in any JSON mode: at most MAX_WHITESPACE consecutive whitespace bytes
outside strings (a model that keeps emitting blanks would otherwise run to max_tokens inside a
valid prefix) and containers nested at most MAX_DEPTH deep. Strings take UTF-8 a byte at a time
(a token may end inside a character) and only well-formed UTF-8 (RFC 3629); control bytes and
\\u escapes of surrogate halves (a lone one is no character; a pair would count as two toward
minLength) are refused. A `raw` grammar (fixed choices) has no whitespace rule: its
literals are the whole output.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_WHITESPACE = 16
MAX_DEPTH = 64
STEP_CACHE_ENTRIES = 1 << 16  # per grammar; cleared when full

Frames = tuple[tuple, ...]
Config = tuple[Frames, int]
State = frozenset  # of Config

WS = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPES = frozenset(b'"\\/bfnrt')
MISSING = object()
NUMBER_ENDS = frozenset(["zero", "int", "frac", "exp"])  # a number may stop here
QUOTE, BACKSLASH = ord('"'), ord("\\")
JSON_ESCAPES = {ord('"'): 0x22, ord("\\"): 0x5C, ord("/"): 0x2F, ord("b"): 0x08,
                ord("f"): 0x0C, ord("n"): 0x0A, ord("r"): 0x0D, ord("t"): 0x09}


class Grammar:
    def __init__(self, nodes: list[tuple], root: int, raw: bool = False,
                 description: str = "JSON"):
        self.nodes, self.root, self.raw, self.description = nodes, root, raw, description
        self.alternatives = [self._flatten(i, ()) for i in range(len(nodes))]
        self.start: State = frozenset({((("V", root),), 0)})
        # memoised steps, per configuration and per whole state (a frozenset caches its hash)
        self._steps: dict[tuple[Config, int], tuple[Config, ...]] = {}
        self._state_steps: dict[tuple[State, int], State | None] = {}

    def __repr__(self) -> str:
        return f"Grammar({self.description}, {len(self.nodes)} nodes)"

    # -- public ---------------------------------------------------------------------------
    def feed(self, state: State | None, data: Iterable[int]) -> State | None:
        """The state after `data`, or None when no allowed output starts with it."""
        for b in data:
            if state is None:
                return None
            key = (state, b)
            hit = self._state_steps.get(key, MISSING)
            if hit is MISSING:
                nxt: set[Config] = set()
                for cfg in state:
                    nxt.update(self._step_config(cfg, b))
                hit = frozenset(nxt) if nxt else None
                if len(self._state_steps) >= STEP_CACHE_ENTRIES:
                    self._state_steps.clear()
                self._state_steps[key] = hit
            state = hit
        return state

    def complete(self, state: State | None) -> bool:
        """The bytes so far are a whole allowed output (trailing whitespace aside)."""
        return state is not None and any(self._can_end(frames) for frames, _ in state)

    def must_end(self, state: State | None) -> bool:
        """Complete, and nothing but whitespace may follow."""
        return state is not None and all(not frames for frames, _ in state)

    # -- structure ------------------------------------------------------------------------
    def _flatten(self, i: int, seen: tuple[int, ...]) -> tuple[int, ...]:
        """The concrete (non-"alt") nodes node i stands for."""
        node = self.nodes[i]
        if node[0] != "alt":
            return (i,)
        if i in seen:
            raise ValueError("a schema that only refers to itself ($ref / anyOf loop) allows "
                             "no value")
        out: list[int] = []
        for j in node[1]:
            out += [k for k in self._flatten(j, seen + (i,)) if k not in out]
        return tuple(out)

    def _number_ends(self, top: tuple) -> bool:
        """A number (or a regex-spelt value) may stop at this frame."""
        if top[0] == "N":
            return top[2] in NUMBER_ENDS
        return top[0] == "T" and top[3] is None and self.nodes[top[1]][1].accepts(top[2])

    def _can_end(self, frames: Frames) -> bool:
        if not frames:
            return True
        if len(frames) != 1:
            return False
        return self._number_ends(frames[0])

    # -- one byte -------------------------------------------------------------------------
    def _step_config(self, cfg: Config, b: int) -> tuple[Config, ...]:
        key = (cfg, b)
        hit = self._steps.get(key)
        if hit is None:
            if len(self._steps) >= STEP_CACHE_ENTRIES:
                self._steps.clear()
            hit = self._steps[key] = self._step_uncached(cfg, b)
        return hit

    def _step_uncached(self, cfg: Config, b: int) -> tuple[Config, ...]:
        frames, ws = cfg
        top = frames[-1] if frames else None
        if b in WS and not self.raw:
            if top is None or top[0] in ("V", "O", "A") or (top[0] == "U" and top[3] != "lit"):
                return ((frames, ws + 1),) if ws < MAX_WHITESPACE else ()
            if self._number_ends(top):  # the blank ends the number
                return ((frames[:-1], 1),)
        if top is None:
            return ()
        return tuple((f, 0) for f in set(self._step(frames, b)))

    def _step(self, frames: Frames, b: int) -> list[Frames]:
        top, rest = frames[-1], frames[:-1]
        kind = top[0]
        if kind == "S":
            nxt = _string_char(top, b)
            return [rest] if nxt == "end" else [rest + (nxt,)] if nxt else []
        if kind == "N":
            sub = _number(top[2], b, top[1])
            if sub is not None:
                return [rest + (("N", top[1], sub),)]
            if top[2] in NUMBER_ENDS and rest:  # the byte ends the number: the container's
                return self._step(rest, b)
            return []
        if kind == "L":
            lit, pos = top[1], top[2]
            if lit[pos] != b:
                return []
            return [rest] if pos + 1 == len(lit) else [rest + (("L", lit, pos + 1),)]
        if kind == "V":
            return self._start(rest, top[1], b)
        if kind == "O":
            return self._object(rest, top, b)
        if kind == "K":
            return self._key(frames, b)
        if kind == "Q":
            return self._ruled_key(frames, b)
        if kind == "A":
            return self._array(rest, top, b)
        if kind == "U":
            return self._set(rest, top, b)
        if kind == "P":
            return self._pattern_string(rest, top, b)
        if kind == "T":
            out = self._text(rest, top, b)
            if not out and rest and self._number_ends(top):  # the byte ends the number
                return self._step(rest, b)
            return out
        raise AssertionError(f"unknown frame {top!r}")

    def _pattern_string(self, rest: Frames, top: tuple, b: int) -> list[Frames]:
        """A byte of a string frame ("P", node, nfa states, esc, count, utf8): JSON escapes
        and UTF-8 are decoded to characters (`_decoded`), which run through the node's NFA."""
        _, c, states, esc, n, utf8 = top
        _, nfa, lo, hi = self.nodes[c]
        got = _matched_char(nfa, states, lo, hi, n, esc, utf8, b)
        if got is None:
            return []
        if got == "end":
            return [rest]
        return [rest + (("P", c) + got[:4],)]

    def _text(self, rest: Frames, top: tuple, b: int) -> list[Frames]:
        """A byte of raw text matched by a regex ("T", node, nfa states, utf8); the frame
        ends once the NFA accepts and can go no further."""
        _, c, states, utf8 = top
        nfa = self.nodes[c][1]
        # only characters after which a match can still end: a branch through a class no
        # reply can spell (surrogates, an empty class) would otherwise be a dead end
        ch, utf8 = _utf8_step(lambda a, z: nfa.continues_within(states, a, z, 0, None), utf8,
                              b)
        if utf8 is not None:
            return [rest + (("T", c, states, utf8),)]
        if ch is None:
            return []
        states = nfa.step(states, ch)
        if not states or not nfa.fits(states, 0, None):
            return []
        if nfa.accepts(states) and not nfa.can_continue(states):
            return [rest]
        return [rest + (("T", c, states, None),)]

    def _start(self, rest: Frames, node_id: int, b: int) -> list[Frames]:
        """The first byte of a value of node `node_id` (over its alternatives)."""
        out: list[Frames] = []
        for c in self.alternatives[node_id]:
            node = self.nodes[c]
            kind = node[0]
            if kind == "str" and b == QUOTE:
                out.append(rest + (("S", node[1], node[2], 0, 0),))
            elif kind == "num" and (b in DIGITS or b == ord("-")):
                sub = "minus" if b == ord("-") else "zero" if b == ord("0") else "int"
                out.append(rest + (("N", node[1], sub),))
            elif kind == "lit" and node[1][0] == b:
                out.append(rest if len(node[1]) == 1 else rest + (("L", node[1], 1),))
            elif kind == "obj" and b == ord("{") and len(rest) < 2 * MAX_DEPTH:
                out.append(rest + (("O", c, frozenset(), "{", None, 0),))
            elif kind == "arr" and b == ord("[") and len(rest) < 2 * MAX_DEPTH:
                out.append(rest + (("A", c, 0, "["),))
            elif kind == "set" and b == ord("[") and len(rest) < 2 * MAX_DEPTH:
                out.append(rest + (("U", c, frozenset(), "[", (), 0),))
            elif kind == "pat" and b == QUOTE:
                out.append(rest + (("P", c, node[1].start, 0, 0, None),))
            elif kind == "re":
                out += self._text(rest, ("T", c, node[1].start, None), b)
        return out

    def _object(self, rest: Frames, top: tuple, b: int) -> list[Frames]:
        """A byte of an object frame ("O", node, declared keys seen, phase, key, other keys
        written: counted only as far as min/max_props need, so that states repeat). key: a
        declared key's raw bytes, or (after another key) the node of its value."""
        _, c, seen, phase, key, others = top
        _, props, _, extra, names, lo, hi, keys, _ = self.nodes[c]
        if phase == ":":
            if b != ord(":"):
                return []
            if isinstance(key, bytes):
                value, seen = props[key], seen | {key}
            else:
                value, others = key, min(others + 1, lo if hi is None else hi)
            return [rest + (("O", c, seen, ",", None, others), ("V", value))]
        allowed, other_ok = self._allowed(c, seen, others)
        can_add = bool(allowed) or other_ok
        if phase in ("{", "k") and b == QUOTE and can_add:
            if keys is not None and other_ok:
                gate, _, _, classes = keys
                ruled = (None if gate is None else gate.start, 0, 0, None,
                         tuple(nfa.start for nfa, _ in classes))
                return [rest + (top, ("Q", b"", ruled))]
            return [rest + (top, ("K", b"", 0))]
        if phase in ("{", ",") and b == ord("}") and self._needs(c, seen) <= seen \
                and len(seen) + others >= lo:
            return [rest]
        if phase == "," and b == ord(",") and can_add:
            return [rest + (("O", c, seen, "k", None, others),)]
        return []

    def _needs(self, c: int, seen: frozenset) -> frozenset:
        """The keys the object must hold: the required ones and what those seen require."""
        _, _, required, _, _, _, _, _, deps = self.nodes[c]
        return required.union(*(deps[k] for k in seen if k in deps)) if deps else required

    def _allowed(self, c: int, seen: frozenset, others: int) -> tuple[tuple[bytes, ...], bool]:
        """The declared keys that may come next, and whether another key may: one comes only
        while it, and the keys still needed with it, fit under max_props (at the limit less
        the keys still needed, only those)."""
        _, _, _, extra, names, _, hi, keys, deps = self.nodes[c]
        count, other_ok = len(seen) + others, extra is not None or keys is not None
        if hi is None:
            return tuple(n for n in names if n not in seen), other_ok
        needs = self._needs(c, seen)
        missing = len(needs - seen)
        allowed = tuple(n for n in names if n not in seen and count + 1 + len(
            needs.union(deps.get(n, ())) - seen - {n}) <= hi)
        return allowed, other_ok and count + 1 + missing <= hi

    def _key(self, frames: Frames, b: int) -> list[Frames]:
        """A byte of an object key. `raw` holds the key's bytes while they may still spell a
        declared property (None once they cannot: a key of `extra`)."""
        _, raw, esc = frames[-1]
        _, c, seen, _, _, others = frames[-2]
        _, props, _, extra, names, _, _, _, _ = self.nodes[c]
        allowed, other_ok = self._allowed(c, seen, others)
        free = extra is not None and other_ok
        if b == QUOTE and esc == 0:
            if raw is not None and raw in props:
                return _declared_close(frames, c, seen, raw, allowed, others)
            return [frames[:-2] + (("O", c, seen, ":", extra, others),)] if free else []
        grown = raw + bytes([b]) if raw is not None else None
        if not free:  # only declared keys: their spelt forms are valid string bodies
            if not any(n.startswith(grown) for n in allowed):
                return []
            return [frames[:-1] + (("K", grown, 1 if b == BACKSLASH and esc == 0 else 0),)]
        nxt = _string_char(("S", 0, None, esc, 0), b)
        if not nxt or nxt == "end":
            return []
        if grown is not None and not any(n.startswith(grown) for n in names):
            grown = None
        return [frames[:-1] + (("K", grown, nxt[3]),)]

    def _ruled_key(self, frames: Frames, b: int) -> list[Frames]:
        """A byte of a key of an object whose other keys follow rules ("Q", raw, ruled): `raw`
        as in `_key`; `ruled`, while the key may still be another key, is (gate states,
        characters, esc, utf8, class states), the characters decoded as in a "P" frame
        (None once it cannot: then only a declared key is left)."""
        _, raw, ruled = frames[-1]
        _, c, seen, _, _, others = frames[-2]
        _, props, _, _, names, _, _, (gate, lo, hi, classes), _ = self.nodes[c]
        allowed, _ = self._allowed(c, seen, others)
        if ruled is not None:
            escaped = ruled[2] != 0 or ruled[3] is not None
        else:  # an odd run of backslashes at the end escapes the next byte
            escaped = (len(raw) - len(raw.rstrip(b"\\"))) % 2 == 1
        if b == QUOTE and not escaped:
            if raw is not None and raw in props:
                return _declared_close(frames, c, seen, raw, allowed, others)
            value = self._ruled_value(c, ruled)
            return [] if value is None else [frames[:-2] + (("O", c, seen, ":", value, others),)]
        grown = raw + bytes([b]) if raw is not None else None
        if grown is not None and not any(n.startswith(grown) for n in names):
            grown = None
        if ruled is not None:
            ruled = _ruled_step(gate, lo, hi, classes, ruled, b)
        if ruled is None and (grown is None or not any(n.startswith(grown) for n in allowed)):
            return []
        return [frames[:-1] + (("Q", grown, ruled),)]

    def _ruled_value(self, c: int, ruled: tuple | None) -> int | None:
        """The value node of the other key just closed, or None when it may not be one."""
        if ruled is None:
            return None
        _, _, _, extra, _, _, _, (gate, lo, _, classes), _ = self.nodes[c]
        states, n, _, _, cls = ruled
        if gate is not None and not (gate.accepts(states) and n >= lo):
            return None
        for (nfa, node), st in zip(classes, cls, strict=True):
            if nfa.accepts(st):
                return node
        return extra

    def _array(self, rest: Frames, top: tuple, b: int) -> list[Frames]:
        _, c, count, phase = top
        _, items, lo, hi, prefix = self.nodes[c]
        if phase == ",":
            if b == ord(",") and (hi is None or count < hi):
                return [rest + (("A", c, count, "v"),)]
            return [rest] if b == ord("]") and count >= lo else []
        if b == ord("]") and phase == "[":
            return [rest] if count >= lo else []
        if hi is not None and count >= hi:
            return []
        item = prefix[count] if count < len(prefix) else items
        # count only as far as the bounds and prefix need, so unbounded arrays share states
        count = count + 1 if hi is not None else min(count + 1, max(lo, len(prefix)))
        return self._start(rest + (("A", c, count, ","),), item, b)

    def _set(self, rest: Frames, top: tuple, b: int) -> list[Frames]:
        """A byte of an array of distinct fixed values ("U", node, values used, phase,
        literals still matching, bytes matched). phase: "[" (opened), "," (after an item),
        "v" (after a comma), "lit" (inside an item)."""
        _, c, used, phase, cand, pos = top
        _, lits, groups, lo, hi = self.nodes[c]
        if phase == ",":
            if b == ord(",") and (hi is None or len(used) < hi):
                return [rest + (("U", c, used, "v", (), 0),)]
            return [rest] if b == ord("]") and len(used) >= lo else []
        if phase == "[" and b == ord("]"):
            return [rest] if len(used) >= lo else []
        if phase != "lit":
            if hi is not None and len(used) >= hi:
                return []
            cand = tuple(i for i in range(len(lits)) if groups[i] not in used)
        cand = tuple(i for i in cand if lits[i][pos] == b)
        out = [rest + (("U", c, used | {groups[i]}, ",", (), 0),)
               for i in cand if len(lits[i]) == pos + 1]
        longer = tuple(i for i in cand if len(lits[i]) > pos + 1)
        if longer:
            out.append(rest + (("U", c, used, "lit", longer, pos + 1),))
        return out


def _declared_close(frames: Frames, c: int, seen, raw: bytes, allowed, others) -> list[Frames]:
    """The closing quote of declared key `raw` of object node `c`: on to its colon, if the
    key may come now (`allowed`: Grammar._allowed), else a dead end."""
    if raw not in allowed:
        return []
    return [frames[:-2] + (("O", c, seen, ":", raw, others),)]


def _string_char(top: tuple, b: int):
    """A byte inside a string frame ("S", min_len, max_len, esc, count): the next frame,
    "end" at the closing quote, or None. esc: 0; -1 after a backslash; 1-4 hex digits left in
    a \\u escape ("D": 3 left after a first digit D, which no surrogate half's 8-F may follow);
    or (continuation bytes left, lowest, highest next byte) inside a UTF-8 character. The
    length counts a character at its first byte; unbounded strings do not count, so that
    their states repeat."""
    _, lo, hi, esc, n = top
    if isinstance(esc, tuple):
        left, low, high = esc
        if not low <= b <= high:
            return None
        return ("S", lo, hi, (left - 1, 0x80, 0xBF) if left > 1 else 0, n)
    if esc == -1:
        if b in ESCAPES:
            return ("S", lo, hi, 0, n)
        return ("S", lo, hi, 4, n) if b == ord("u") else None
    if esc == "D":  # \uD.. : D800-DFFF are surrogate halves, no character (as in "P" frames)
        return ("S", lo, hi, 2, n) if b in b"01234567" else None
    if esc:
        if b not in HEX:
            return None
        return ("S", lo, hi, "D" if esc == 4 and b in b"dD" else esc - 1, n)
    if b == QUOTE:
        return "end" if n >= lo else None
    if b < 0x20:
        return None
    nxt = 0
    if b >= 0x80:
        nxt = UTF8_LEADS.get(b)
        if nxt is None:  # a stray continuation byte, or one that never occurs in UTF-8
            return None
    elif b == BACKSLASH:
        nxt = -1
    grown = min(n + 1, lo) if hi is None else n + 1
    if hi is not None and grown > hi:
        return None
    return ("S", lo, hi, nxt, grown)


def _decoded(can, esc, utf8: tuple | None, b: int):
    """One byte of a JSON string body read as characters: ("char", code point) once one is
    whole, ("more", esc, utf8) while its bytes or escape go on, "quote" at an unescaped
    closing quote, or None when refused. esc: 0, -1 after a backslash, or (code so far, hex
    digits left) in a \\u escape; utf8: None or (code so far, continuation bytes left, lowest,
    highest next byte). A byte that leaves a character unfinished passes only if some
    character it can still become passes `can(lo, hi)` (one in [lo, hi] continues a match)."""
    if utf8 is not None or (b >= 0x80 and esc == 0):
        ch, utf8 = _utf8_step(can, utf8, b)
        if utf8 is not None:
            return ("more", 0, utf8)
        return None if ch is None else ("char", ch)
    if esc == -1:
        if b == ord("u"):
            return ("more", (0, 4), None)
        ch = JSON_ESCAPES.get(b)
        return None if ch is None else ("char", ch)
    if esc:
        code, left = esc
        if b not in HEX:
            return None
        code = code * 16 + int(chr(b), 16)
        if left > 1:
            lo_code, hi_code = code << 4 * (left - 1), ((code + 1) << 4 * (left - 1)) - 1
            if not any(can(a, z) for a, z in _without_surrogates(lo_code, hi_code)):
                return None
            return ("more", (code, left - 1), None)
        if 0xD800 <= code <= 0xDFFF:  # surrogate halves: write the character itself
            return None
        return ("char", code)
    if b == QUOTE:
        return "quote"
    if b == BACKSLASH:  # some character an escape can write must continue the match
        if not any(can(a, z) for a, z in _without_surrogates(0, 0xFFFF)):
            return None
        return ("more", -1, None)
    if b < 0x20:
        return None
    return ("char", b)


def _matched_char(nfa, states, lo: int, hi: int | None, n: int, esc, utf8, b: int):
    """A byte of a string whose characters must match `nfa` within lengths lo..hi (n counted
    so far; unbounded strings count only up to lo, so that their states repeat): (states,
    esc, n, utf8, the character if it ended one) after it, "end" at a closing quote that
    ends a match, or None."""
    starts_char = esc == 0 and utf8 is None and (b >= 0x80 or b == BACKSLASH)
    if starts_char and hi is not None and n >= hi:  # no room for another character
        return None
    # after the next character, the match must still be able to end within the bounds
    at_least, at_most = max(lo - n - 1, 0), None if hi is None else hi - n - 1
    got = _decoded(lambda a, z: nfa.continues_within(states, a, z, at_least, at_most),
                   esc, utf8, b)
    if got is None:
        return None
    if got == "quote":
        return "end" if nfa.accepts(states) and n >= lo else None
    if got[0] == "more":
        return (states, got[1], n, got[2], None)
    states = nfa.step(states, got[1])
    if not states or not nfa.fits(states, at_least, at_most):
        return None
    return (states, 0, n + 1 if hi is not None else min(n + 1, lo), None, got[1])


def _ruled_step(gate, lo: int, hi: int | None, classes: tuple, ruled: tuple, b: int):
    """A byte of another key ("Q" frame's ruled part): the gate's states move as a "P"
    frame's do; each class's NFA reads the decoded characters unpruned (it only picks the
    value's node at the end). None when the byte cannot go on another key."""
    states, n, esc, utf8, cls = ruled
    if gate is not None:
        got = _matched_char(gate, states, lo, hi, n, esc, utf8, b)
        if got is None or got == "end":
            return None
        states, esc, n, utf8, ch = got
    else:
        got = _decoded(lambda a, z: True, esc, utf8, b)
        if got is None or got == "quote":
            return None
        ch, esc, utf8 = (got[1], 0, None) if got[0] == "char" else (None, got[1], got[2])
    if ch is not None:
        cls = tuple(nfa.step(st, ch) for (nfa, _), st in zip(classes, cls, strict=True))
    return states, n, esc, utf8, cls


def _utf8_step(can, utf8: tuple | None, b: int) -> tuple[int | None, tuple | None]:
    """One byte of a character read as UTF-8 for an NFA: (the character, None) once whole,
    (None, pending) while bytes are to come, (None, None) when refused. `pending` is (code so
    far, continuation bytes left, lowest, highest next byte); a byte passes only if some
    character it can still become continues a match (`can(lo, hi)`: one in [lo, hi] does)."""
    if utf8 is None:
        if b < 0x80:
            return b, None
        lead = UTF8_LEADS.get(b)
        if lead is None:
            return None, None
        left, low, high = lead
        code = b & (0x3F >> left)
        if not can(*_utf8_codes(code, left, lead_byte=b)):
            return None, None
        return None, (code, left, low, high)
    code, left, low, high = utf8
    if not low <= b <= high:
        return None, None
    code = (code << 6) | (b & 0x3F)
    if left == 1:
        return code, None
    if not can(*_utf8_codes(code, left - 1)):
        return None, None
    return None, (code, left - 1, 0x80, 0xBF)


def _utf8_codes(code: int, left: int, lead_byte: int | None = None) -> tuple[int, int]:
    """The code points a UTF-8 character can still become: `code` its bits so far, `left`
    continuation bytes to come. RFC 3629's byte ranges keep the real set inside this span
    (overlong forms and surrogates are cut by the next byte's range), so the span is exact
    at the lead byte with its own limits and after that."""
    lo, hi = code << 6 * left, ((code + 1) << 6 * left) - 1
    if lead_byte is not None:
        _, low, high = UTF8_LEADS[lead_byte]
        lo = max(lo, (code << 6 * left) | ((low & 0x3F) << 6 * (left - 1)))
        hi = min(hi, (code << 6 * left) | (((high & 0x3F) + 1) << 6 * (left - 1)) - 1)
    return lo, min(hi, 0x10FFFF)


def _without_surrogates(lo: int, hi: int) -> list[tuple[int, int]]:
    parts = [(lo, min(hi, 0xD7FF)), (max(lo, 0xE000), hi)]
    return [(a, z) for a, z in parts if a <= z]


def _utf8_leads() -> dict[int, tuple[int, int, int]]:
    """Lead byte -> (continuation bytes, range of the next byte): RFC 3629's table, which
    also rules out overlong forms and surrogates."""
    out = {b: (1, 0x80, 0xBF) for b in range(0xC2, 0xE0)}
    out.update({b: (2, 0x80, 0xBF) for b in range(0xE1, 0xF0)})
    out.update({0xE0: (2, 0xA0, 0xBF), 0xED: (2, 0x80, 0x9F)})
    out.update({b: (3, 0x80, 0xBF) for b in range(0xF1, 0xF4)})
    out.update({0xF0: (3, 0x90, 0xBF), 0xF4: (3, 0x80, 0x8F)})
    return out


UTF8_LEADS = _utf8_leads()


def _number(sub: str, b: int, integer: bool) -> str | None:
    """A number's next sub-state (RFC 8259: -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?;
    an integer stops before the fraction), or None when `b` does not continue it."""
    digit = b in DIGITS
    if sub == "minus":
        return ("zero" if b == ord("0") else "int") if digit else None
    if sub in ("zero", "int"):
        if digit:
            return "int" if sub == "int" else None
        if integer:
            return None
        return "dot" if b == ord(".") else "e" if b in b"eE" else None
    if sub in ("dot", "frac"):
        if digit:
            return "frac"
        return "e" if sub == "frac" and b in b"eE" else None
    if sub == "e":
        return "esign" if b in b"+-" else "exp" if digit else None
    if sub in ("esign", "exp"):
        return "exp" if digit else None
    raise AssertionError(f"unknown number state {sub!r}")
