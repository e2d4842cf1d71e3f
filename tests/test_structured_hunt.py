"""Structured output bugs found by a differential hunt (random walks and directed cases checked
with `jsonschema`, pydantic and Python's `datetime`): each test failed before its fix."""

from __future__ import annotations

import datetime
import json
import random

import jsonschema
import pytest
from grammar_walk import random_walk

from kvcap.sampling.json_schema import SchemaError, compile_schema, object_grammar


def accepts(g, text: str) -> bool:
    return g.complete(g.feed(g.start, text.encode()))


def valid(schema, doc) -> bool:
    return jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).is_valid(doc)


# -- oneOf: exactly one branch -------------------------------------------------------------

@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]},
    {"oneOf": [{"const": 1}, {"type": "integer", "minimum": 0}]},
    {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
               {"type": "object", "properties": {"b": {"type": "integer"}}}]},
    {"oneOf": [{"enum": [1, "x"]}, {"enum": [1.0]}]},
])
def test_one_of_whose_branches_may_overlap_is_refused(schema):
    """oneOf was compiled as anyOf, so the output could match two branches (1 under integer
    and number), which jsonschema rejects: a keyword kvcap cannot enforce is refused by name."""
    with pytest.raises(SchemaError, match="oneOf"):
        compile_schema(schema)


CAT = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
       "required": ["kind"]}
DOG = {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
       "required": ["kind"]}


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
    {"oneOf": [{"enum": [1, "a"]}, {"enum": [2, None]}]},
    {"oneOf": [{"type": "string", "pattern": "^a"}, {"type": "string", "pattern": "^b"}]},
    {"oneOf": [{"type": "integer", "maximum": 0}, {"type": "number", "exclusiveMinimum": 0}]},
    {"oneOf": [{"const": "abc"}, {"type": "string", "maxLength": 2}]},
    # pydantic's discriminated union
    {"$defs": {"Cat": CAT, "Dog": DOG}, "oneOf": [{"$ref": "#/$defs/Cat"},
                                                  {"$ref": "#/$defs/Dog"}]},
    # a recursive one: the branches are told apart once the whole schema is compiled
    {"$defs": {"T": {"oneOf": [{"type": "integer"},
                               {"type": "array", "items": {"$ref": "#/$defs/T"}}]}},
     "$ref": "#/$defs/T"},
])
def test_one_of_with_exclusive_branches_generates_only_valid_documents(schema):
    g = compile_schema(schema)
    rng = random.Random(0)
    for _ in range(40):
        data = random_walk(g, rng, 300)
        if data is not None:
            assert valid(schema, json.loads(data)), data


# -- strings: \u escapes of surrogates --------------------------------------------------------

def test_string_length_is_not_fooled_by_an_escaped_surrogate_pair():
    """An escaped surrogate pair is one character: it counted as two toward minLength."""
    schema = {"type": "string", "minLength": 2}
    g = compile_schema(schema)
    text = '"\\ud83d\\ude00"'
    assert not valid(schema, json.loads(text))
    assert not accepts(g, text)
    assert accepts(g, '"\\u00e9\\uE000"') and accepts(g, '"\\uD7FF\u00e9"')


@pytest.mark.parametrize("grammar", [object_grammar(), compile_schema({"type": "string"}),
                                     compile_schema({"type": "string", "maxLength": 1})])
def test_lone_surrogate_escapes_are_refused(grammar):
    """A lone surrogate (\\ud800) is no Unicode character: strict JSON readers refuse it (a
    pattern string refused it already)."""
    body = '{"a":"\\ud800"}' if grammar is object_grammar() else '"\\ud800"'
    prefix = body[:body.index("\\ud8") + 3]
    state = grammar.feed(grammar.start, prefix.encode())
    assert state is not None
    assert grammar.feed(state, b"8") is None and grammar.feed(state, b"F") is None
    assert grammar.feed(state, b"0") is not None and grammar.feed(state, b"7") is not None


# -- formats -------------------------------------------------------------------------------

def test_date_never_has_year_zero():
    """Year 0000 is RFC 3339 text but no date Python, pydantic or jsonschema's date check
    accepts."""
    for fmt, text in [("date", "0000-01-01"), ("date-time", "0000-01-01T00:00:00Z")]:
        g = compile_schema({"type": "string", "format": fmt})
        assert not accepts(g, json.dumps(text))
        with pytest.raises(ValueError):
            datetime.date.fromisoformat(text[:10])
    g = compile_schema({"type": "string", "format": "date"})
    for ok in ["0001-01-01", "0010-02-28", "0100-12-31", "1000-01-01", "9999-12-31"]:
        assert accepts(g, json.dumps(ok)), ok


@pytest.mark.parametrize("text", [".a@example.com", "a.@example.com", "a..b@example.com",
                                  "a@-x.com", "a@x-.com", "a@x..com", "a@" + "b" * 64 + ".com",
                                  "a" * 65 + "@x.com"])
def test_email_is_a_dot_atom_at_a_host_name(text):
    """RFC 5321: no leading, trailing or doubled dot in the local part, labels of the domain
    neither start nor end with a hyphen, at most 63 characters."""
    g = compile_schema({"type": "string", "format": "email"})
    assert not accepts(g, json.dumps(text))


@pytest.mark.parametrize("text", ["a@example.com", "first.last+tag@mail.example.co",
                                  "x_y%z@a-b.io", "a" * 64 + "@x.com"])
def test_email_still_takes_ordinary_addresses(text):
    g = compile_schema({"type": "string", "format": "email"})
    assert accepts(g, json.dumps(text))


# -- schemas without a finite value ------------------------------------------------------------

@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}},
     "$ref": "#/$defs/n"},
    # optional, but a model that starts it can never finish it
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/loop"}},
     "$defs": {"loop": {"type": "array", "prefixItems": [{"$ref": "#/$defs/loop"}],
                        "minItems": 1}}},
])
def test_schema_whose_values_never_end_is_refused(schema):
    """A required self-reference allows no finite value: the grammar let the model nest
    until the depth limit and then no byte continued (NoContinuation mid-output)."""
    with pytest.raises(SchemaError, match="finite"):
        compile_schema(schema)


def test_recursive_schema_with_an_end_still_compiles():
    schema = {"type": "object", "properties": {"next": {"$ref": "#"}}}
    g = compile_schema(schema)
    assert accepts(g, '{"next":{"next":{}}}')


# -- enum / const: 1.0 is an integer ----------------------------------------------------------

@pytest.mark.parametrize("schema, texts", [
    ({"type": "integer", "const": 1.0}, ["1"]),
    ({"type": "integer", "enum": [1.0, 2]}, ["1", "2"]),
])
def test_integral_float_members_are_integers(schema, texts):
    """JSON Schema calls 1.0 an integer: the member was written "1.0", which the integer
    type then refused, so the enum lost it silently (or the const was refused)."""
    g = compile_schema(schema)
    for text in texts:
        assert valid(schema, json.loads(text)) and accepts(g, text), text
