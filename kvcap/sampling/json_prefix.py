"""Is this byte string the start of a JSON object? An incremental recogniser for JSON mode.

`step(state, byte)` returns the state after one more byte, or None when no JSON object starts
with the bytes so far. States are small immutable tuples, so a state can be kept per request,
shared, and memoised per (state, token). The grammar is RFC 8259's, restricted to an object at
the top level (what `response_format: {"type": "json_object"}` asks for), with two limits of
kvcap's own: at most MAX_WHITESPACE consecutive whitespace bytes outside strings (a model that
keeps emitting blanks could otherwise run to max_tokens inside a valid prefix), and nesting at
most MAX_DEPTH deep. Inside strings any byte >= 0x80 is accepted (tokens may split a UTF-8
character; the detokenizer reassembles it); control bytes are not.

State: (stack, mode, aux, ws). `stack` holds the open containers, 'o' / 'a' ("" at the top);
`mode` what comes next; `aux` the mode's detail (a literal's remaining bytes, a number's
sub-state, whether a string is a key, hex digits left in a \\u escape); `ws` the whitespace run.
"""

from __future__ import annotations

MAX_WHITESPACE = 16
MAX_DEPTH = 64

State = tuple[str, str, object, int]
START: State = ("", "top", None, 0)
WS = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPES = frozenset(b'"\\/bfnrt')
LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}


def complete(state: State | None) -> bool:
    """The bytes so far are one whole JSON object (trailing whitespace aside)."""
    return state is not None and state[1] == "done"


def feed(state: State | None, data: bytes) -> State | None:
    """The state after `data`, or None when it leaves JSON."""
    for b in data:
        if state is None:
            return None
        state = step(state, b)
    return state


def step(state: State, b: int) -> State | None:
    stack, mode, aux, ws = state
    if mode == "string":
        return _string(stack, aux, b)
    if mode == "number":
        nxt = _number(aux, b)
        if nxt is not None:
            return (stack, "number", nxt, 0)
        if aux not in ("zero", "int", "frac", "exp"):  # e.g. "-" or "1." must continue
            return None
        return step((stack, "after", None, 0), b)  # the byte ends the number
    if mode == "literal":
        if b != aux[0]:
            return None
        return (stack, "literal", aux[1:], 0) if len(aux) > 1 else (stack, "after", None, 0)
    if b in WS:
        return (stack, mode, aux, ws + 1) if ws < MAX_WHITESPACE else None
    if mode == "top":
        return ("o", "key_or_end", None, 0) if b == ord("{") else None
    if mode == "done":
        return None
    if mode in ("key_or_end", "key"):
        if b == ord('"'):
            return (stack, "string", (True, 0), 0)
        if b == ord("}") and mode == "key_or_end":
            return _close(stack)
        return None
    if mode == "colon":
        return (stack, "value", None, 0) if b == ord(":") else None
    if mode in ("value", "value_or_end"):
        if b == ord("]") and mode == "value_or_end":
            return _close(stack)
        return _value(stack, b)
    if mode == "after":
        top = stack[-1]
        if b == ord(","):
            return (stack, "key" if top == "o" else "value", None, 0)
        if b == ord("}" if top == "o" else "]"):
            return _close(stack)
        return None
    raise AssertionError(f"unknown JSON mode {mode!r}")


def _close(stack: str) -> State:
    rest = stack[:-1]
    return (rest, "after", None, 0) if rest else ("", "done", None, 0)


def _value(stack: str, b: int) -> State | None:
    if b == ord("{") or b == ord("["):
        if len(stack) >= MAX_DEPTH:
            return None
        return (stack + "o", "key_or_end", None, 0) if b == ord("{") else \
            (stack + "a", "value_or_end", None, 0)
    if b == ord('"'):
        return (stack, "string", (False, 0), 0)
    if b in LITERALS:
        return (stack, "literal", LITERALS[b], 0)
    if b == ord("-"):
        return (stack, "number", "minus", 0)
    if b in DIGITS:
        return (stack, "number", "zero" if b == ord("0") else "int", 0)
    return None


def _string(stack: str, aux: tuple[bool, int | str], b: int) -> State | None:
    is_key, esc = aux
    if esc == "\\":
        if b in ESCAPES:
            return (stack, "string", (is_key, 0), 0)
        return (stack, "string", (is_key, 4), 0) if b == ord("u") else None
    if esc:  # hex digits left in a \uXXXX escape
        return (stack, "string", (is_key, esc - 1), 0) if b in HEX else None
    if b == ord('"'):
        return (stack, "colon", None, 0) if is_key else (stack, "after", None, 0)
    if b == ord("\\"):
        return (stack, "string", (is_key, "\\"), 0)
    return (stack, "string", aux, 0) if b >= 0x20 else None


def _number(sub: str, b: int) -> str | None:
    """A number's next sub-state (RFC 8259: -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?),
    or None when `b` does not continue it."""
    digit = b in DIGITS
    if sub == "minus":
        return ("zero" if b == ord("0") else "int") if digit else None
    if sub in ("zero", "int"):
        if digit:
            return "int" if sub == "int" else None
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
