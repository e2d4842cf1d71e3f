"""Structured output bugs found by a second differential hunt (grammar walks and directed
documents checked with `jsonschema` and Python's `re`, JSON Schema's and vLLM's references);
each test failed before its fix. Grammar-level only: no model."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest

from kvcap.sampling.json_schema import SchemaError, compile_schema, regex_grammar
from kvcap.sampling.regex import RegexError, compile_regex
from kvcap.server.structured_request import StructuredRequestError, structured_request


def accepts(g, text: str) -> bool:
    return g.complete(g.feed(g.start, text.encode()))


def valid(schema, doc) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(doc)


# -- pattern anchors belong to their own alternative ------------------------------------------

@pytest.mark.parametrize("pattern", ["^a|b$", "a|b$", "^ab|c", "^a$|^b$", "x|^y|z$",
                                     "^(?:a|b)$", "^a", "b$"])
def test_pattern_anchors_bind_to_their_top_level_alternative(pattern):
    """`^a|b$` is (^a)|(b$): strings starting with a or ending with b. The anchors were
    stripped off the whole pattern, so it matched only "a" and "b" whole ("ax", valid under
    the schema, could not be written), and `^a$|^b$` was refused outright."""
    schema = {"type": "string", "pattern": pattern}
    g = compile_schema(schema)
    for text in ["a", "b", "c", "x", "y", "z", "ab", "ax", "xa", "xb", "bx", "xc", "abc",
                 "yx", "xz", "zx", "xyz", ""]:
        assert accepts(g, json.dumps(text)) == valid(schema, text), (pattern, text)


@pytest.mark.parametrize("pattern", ["^a|b$", "^a$|^b$", "x|^y|z$"])
def test_guided_regex_anchors_at_alternatives_match_whole(pattern):
    g = regex_grammar(pattern)
    for text in ["a", "b", "x", "y", "z", "ab", "ax", "xb"]:
        assert accepts(g, text) == bool(re.fullmatch(pattern, text)), (pattern, text)


def test_misplaced_anchors_are_still_refused():
    for pattern in ["a^b", "a$b", "(^a)", "a$*"]:
        with pytest.raises(RegexError, match="only at the ends"):
            compile_regex(pattern, search=True)


# -- \d \w \s: only what every reader of the pattern agrees on --------------------------------

CHARS = ["a", "Z", "_", "1", " ", "\t", "-", "!", "\u00e9", "\u0663", "\u00b2", "\u2160",
         "\x1c", "\x1f", "\x85", "\u00a0", "\u3000", "\ufeff", "\u0301", "\u203f", "\u4e16"]


@pytest.mark.parametrize("pattern, takes, refuses", [
    (r"^\D$", "a-\u00e9", "1\u0663"),
    (r"^\W$", "-! ", "a_\u00e9\u0663\u4e16"),
    (r"^\S$", "a\u00e9\u4e16", " \x1c\x85\ufeff"),
    (r"^\s$", " \t\u00a0\u3000", "a\x1c\x85\ufeff"),
    (r"^[^\d]$", "a\u00e9", "1\u0663"),
    (r"^[^\w\s]$", "-!", "a \u00e9\x1c"),
    (r"^[\W\d]$", "1-\u0663", "a\u00e9"),
    (r"^[^\S]$", " \u00a0", "a\x1c\ufeff"),
    (r"^\w$", "a_1", "-\u00e9\u0663"),
    (r"^\d$", "09", "a\u0663\u00b2"),
])
def test_shorthand_classes_take_only_what_python_and_ecma_agree_on(pattern, takes, refuses):
    """ECMA-262's \\d and \\w are ASCII and its \\s has U+FEFF; Python's re (jsonschema) and
    Rust's regex (pydantic) read them as Unicode (\\d: any decimal digit, \\w: é, \\s:
    U+001C-U+001F and U+0085, not U+FEFF). \\D, \\W and \\S took ECMA's complements, so a
    model could write "é" for `^\\W$`, which jsonschema and pydantic reject."""
    schema = {"type": "string", "pattern": pattern}
    g = compile_schema(schema)
    for ch in CHARS:
        if accepts(g, json.dumps(ch)):
            assert valid(schema, ch), (pattern, ch)
    for ch in takes:
        assert accepts(g, json.dumps(ch)), (pattern, ch)
    for ch in refuses:
        assert not accepts(g, json.dumps(ch)), (pattern, ch)


@pytest.mark.parametrize("pattern", [r"^[\w\W]+$", r"^[\s\S]+$", r"^[\d\D]+$"])
def test_a_class_and_its_complement_still_take_every_character(pattern):
    """Each reader's [\\w\\W] is every character: narrowing each shorthand on its own would
    have lost the characters the readers disagree on."""
    g = compile_schema({"type": "string", "pattern": pattern})
    assert accepts(g, json.dumps("".join(CHARS)))


def test_guided_regex_negated_shorthand_is_what_python_agrees_with():
    for pattern, text in [(r"\W", "\u00e9"), (r"\D", "\u0663"), (r"\S", "\x85"),
                          (r"\s", "\ufeff")]:
        assert not re.fullmatch(pattern, text)
        assert not accepts(regex_grammar(pattern), text), pattern
    assert accepts(regex_grammar(r"\W"), "-") and accepts(regex_grammar(r"\D"), "\u00e9")


# -- regex syntax that ECMA-262 and Python read differently is refused ------------------------

@pytest.mark.parametrize("pattern, why", [(r"\01", "octal"), (r"[\07]", "octal"),
                                          ("a{,3}", r"\{,n\}"), ("a{,}", r"\{,n\}")])
def test_escapes_and_counts_read_differently_are_refused(pattern, why):
    """`\\01` is the octal escape \\x01 to Python and to ECMA-262's web reading, but kvcap
    matched NUL then "1"; `a{,3}` is a{0,3} to Python and the text "a{,3}" to ECMA-262,
    which kvcap wrote (Python's re.fullmatch then refuses it)."""
    with pytest.raises(RegexError, match=why):
        compile_regex(pattern)


def test_nul_escape_and_literal_braces_still_compile():
    assert compile_regex(r"\0").matches("\x00") and compile_regex(r"\08").matches("\x008")
    assert compile_regex("a{").matches("a{") and compile_regex("a{1,}").matches("aa")


# -- structured_outputs: a format given as false is not "none asked" -------------------------

def _request(**fields):
    base = dict(response_format=None, guided_json=None, guided_choice=None, guided_regex=None,
                structured_outputs=None, tool_structured=lambda: None)
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize("so", [{"json": False}, {"json": 0}, {"regex": False},
                                {"choice": False}])
def test_structured_outputs_format_given_as_false_is_a_400(so):
    """`structured_outputs: {"json": false}` (the schema that allows nothing) was dropped as
    if unset, so the request ran unconstrained; `guided_json: false` was already a 400."""
    with pytest.raises(StructuredRequestError, match="structured_outputs"):
        structured_request(_request(structured_outputs=so))
    with pytest.raises(StructuredRequestError):
        structured_request(_request(guided_json=False))


def test_structured_outputs_switches_at_false_stay_neutral():
    assert structured_request(_request(structured_outputs={"json_object": False})) == {}
    assert structured_request(_request(structured_outputs={"json": None, "regex": "a+"})) == {
        "field": "structured_outputs", "regex": "a+"}


# -- $ref inside a subschema with its own $id ----------------------------------------------

INNER_ID = {"$defs": {"C": {"type": "integer"},
                      "B": {"$id": "https://example.com/b", "$defs": {"C": {"type": "string"}},
                            "type": "object", "properties": {"y": {"$ref": "#/$defs/C"}}}},
            "type": "object", "properties": {"x": {"$ref": "#/$defs/B"}}, "required": ["x"]}


def test_ref_under_a_subschema_id_is_refused_not_resolved_against_the_root():
    """A subschema's $id is the base its "#/..." references resolve against (B's own C, a
    string): kvcap resolved them against the root (C, an integer) and wrote {"x":{"y":1}},
    which jsonschema rejects."""
    assert not valid(INNER_ID, {"x": {"y": 1}}) and valid(INNER_ID, {"x": {"y": "s"}})
    with pytest.raises(SchemaError, match=r"\$id"):
        compile_schema(INNER_ID)


def test_ids_that_do_not_move_a_reference_still_compile():
    root_id = {"$id": "https://example.com/root", "$defs": {"C": {"type": "integer"}},
               "type": "object", "properties": {"x": {"$ref": "#/$defs/C"}}}
    assert accepts(compile_schema(root_id), '{"x":1}')
    inner = {"type": "object", "properties": {"x": {"$id": "https://example.com/x",
                                                    "type": "integer"}}}
    assert accepts(compile_schema(inner), '{"x":1}')


def test_tool_schema_with_a_root_id_still_compiles_for_required_calls():
    """tool_choice "required" nests each tool's schema under the array's $defs, references
    rebased: its own root $id must not come along as a subschema's $id."""
    from kvcap.server.tools import calls_schema

    tool = {"$id": "https://example.com/t", "$defs": {"N": {"type": "integer"}},
            "type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}, "required": ["n"]}
    g = compile_schema(calls_schema({"f": tool}, parallel=True))
    assert accepts(g, '[{"name":"f","parameters":{"n":1}}]')
    assert not accepts(g, '[{"name":"f","parameters":{"n":"x"}}]')
