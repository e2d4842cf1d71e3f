"""Structured output: the byte-level grammar against Python's json module and the `jsonschema`
validator, the schema compiler's refusals, the vocabulary mask against a token-by-token check,
the token choice with masking and the whole-vocabulary fallback, and generation on the embedded
model (JSON object, JSON schema, choice)."""

from __future__ import annotations

import json
import random
import urllib.parse
from enum import Enum
from typing import Annotated, Literal

import jsonschema
import pydantic
import pytest
import torch
from grammar_walk import random_walk
from pydantic import StringConstraints

from kvcap import LLM, SamplingParams
from kvcap.engine.structured import MAX_REJECTIONS, StructuredOutput
from kvcap.engine.token_bytes import TokenTexts
from kvcap.errors import ConfigError
from kvcap.sampling.json_grammar import MAX_WHITESPACE
from kvcap.sampling.json_schema import (
    FORMATS,
    SchemaError,
    choice_grammar,
    compile_schema,
    object_grammar,
    regex_grammar,
)
from kvcap.sampling.regex import RegexError, compile_regex

OBJ = object_grammar()


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["obj", "arr", "str", "num", "lit"] if depth < 3 else ["str", "num", "lit"])
    if kind == "obj":
        return {f"k{rng.randint(0, 99)}\u00e9\"\\": _random_value(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    if kind == "arr":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "str":
        return rng.choice(["", "plain", "tab\t\nnew", "\u4e16\u754c", "quote\"back\\slash",
                           "\u0001ctl"])
    if kind == "num":
        return rng.choice([0, -0.5, 12, 3.25e-7, -1e21, 1.5e300, 7])
    return rng.choice([True, False, None])


def _dumps(rng: random.Random, doc, i: int) -> bytes:
    return json.dumps(doc, indent=rng.choice([None, 2]), ensure_ascii=i % 3 == 0,
                      separators=rng.choice([None, (",", ":"), (" , ", " : ")])).encode()


def test_every_prefix_of_valid_objects_is_accepted_and_only_the_end_is_complete():
    rng = random.Random(0)
    for i in range(200):
        doc = {"root": _random_value(rng)} if i % 2 else dict(a=_random_value(rng))
        data = _dumps(rng, doc, i)
        state = OBJ.start
        for k, b in enumerate(data):
            state = OBJ.feed(state, [b])
            assert state is not None, (data, k)
            assert OBJ.complete(state) == (k == len(data) - 1), (data, k)
            assert OBJ.must_end(state) == (k == len(data) - 1), (data, k)


@pytest.mark.parametrize("text", [
    "[1]", '"s"', "1", '{"a" 1}', '{"a":01}', '{"a":1,}', '{"a":tru}', "{a:1}",
    '{"a":"\x01"}', '{"a":1}}', '{"a":-}', '{"a":1.}', '{"a":1e}', '{"a":.5}', '{"a":+1}',
    '{"a":"\\x"}', '{"a":"\\u12g4"}', '{,}', '{"a":[1,]}', '{"a":[,1]}', '{"a":1 2}',
    '{"a":nul}', '{"a":truex}', "{" + " " * (MAX_WHITESPACE + 1) + "}", '{"a":"\xff"}',
])
def test_invalid_json_is_refused(text):
    assert OBJ.feed(OBJ.start, text.encode("latin-1")) is None


def test_recogniser_never_completes_what_json_rejects():
    rng = random.Random(1)
    alphabet = b'{}[]:,"\\ 0123456789.eE+-truefalsnul\tabc'
    for _ in range(3000):
        data = bytes(rng.choice(alphabet) for _ in range(rng.randint(2, 16)))
        if OBJ.complete(OBJ.feed(OBJ.start, data)):
            assert isinstance(json.loads(data), dict), data


class Colour(Enum):
    RED = "red"
    GREEN = "green"


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    kind: Literal["cat", "dog"]
    age: int | None = None
    colours: list[Colour] = pydantic.Field(default_factory=list, max_length=3)


class Household(pydantic.BaseModel):
    address: str
    pets: list[Pet]
    rating: float
    verified: bool


class Reading(pydantic.BaseModel):
    count: int = pydantic.Field(ge=0, le=500)
    ratio: float = pydantic.Field(gt=0, lt=1)
    celsius: float = pydantic.Field(ge=-40.5, le=60)
    offset: int = pydantic.Field(gt=-10)
    pair: tuple[int, str]
    ids: tuple[int, ...] = ()
    # steps exact in binary, so that jsonschema's float division agrees with the decimals
    step: float = pydantic.Field(multiple_of=0.25, ge=-3)
    even: int = pydantic.Field(multiple_of=2, lt=100)


class Tags(pydantic.BaseModel):
    colours: set[Colour]
    sizes: frozenset[Literal[1, 2, 3]] = pydantic.Field(default=frozenset(), max_length=2)


class Counts(pydantic.BaseModel):
    """Dicts with constrained keys: pydantic writes patternProperties / propertyNames."""
    words: dict[Annotated[str, StringConstraints(pattern=r"^[a-z]+$")], int]
    sides: dict[Literal["left", "right"], int]
    flags: dict[Annotated[str, StringConstraints(max_length=3)], bool]


TREE = {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                       "maxItems": 2}}, "required": ["v"]}},
        "$ref": "#/$defs/node"}
SCHEMAS = {
    "pydantic": Household.model_json_schema(),
    "tree": TREE,
    "bounds": {"type": "object", "properties": {
        "s": {"type": "string", "minLength": 2, "maxLength": 4},
        "a": {"type": "array", "items": {"type": ["integer", "null"]}, "minItems": 1,
              "maxItems": 3},
        "c": {"const": "\u00e9t\u00e9"}}, "required": ["s", "a", "c"]},
    "open": {"type": "object", "properties": {"id": {"type": "integer"}},
             "additionalProperties": {"type": "boolean"}},
    "any_of": {"anyOf": [{"type": "number"}, {"type": "string", "maxLength": 3},
                         {"enum": [1, 10, "ab", None, [True]]}]},
    "anything": {},
    "numeric": Reading.model_json_schema(),
    "sets": Tags.model_json_schema(),
    # a budget of keys: optional ones only while the required still fit under the maximum
    "props": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "null"},
                                               "c": {"type": "boolean"}},
              "required": ["c"], "minProperties": 2, "maxProperties": 2},
    "props_open": {"type": "object", "properties": {"c": {"type": "boolean"}},
                   "required": ["c"], "additionalProperties": {"type": "integer"},
                   "maxProperties": 3},
    "same_values": {"type": "array", "items": {"enum": [1, 1.0, True, "1", None]},
                    "uniqueItems": True, "minItems": 1},
    # a pattern must still be able to end within the length bounds (no dead ends)
    "lengths": {"type": "object", "properties": {
        "ip": {"type": "string", "format": "ipv4", "maxLength": 9},
        "p": {"type": "string", "pattern": "(ab|cd)", "maxLength": 3},
        "m": {"type": "string", "pattern": "^a+b$", "minLength": 4},
        "u": {"type": "string", "pattern": "\u00e9", "maxLength": 2},
        # pattern and format together: what both allow
        "mail": {"type": "string", "format": "email", "pattern": "@example\\.(com|org)$",
                 "maxLength": 20}},
        "required": ["ip", "p", "m"]},
    "tuple": {"type": "array", "prefixItems": [{"const": "a"}, {"type": "boolean"}],
              "items": {"type": "integer", "maximum": -1}, "maxItems": 4},
    "keys": Counts.model_json_schema(),
    # each other key takes its pattern's schema, else additionalProperties'
    "patterns": {"type": "object", "patternProperties": {
        "^i_": {"type": "integer"}, "^s_": {"type": "string", "maxLength": 2}},
        "additionalProperties": {"type": "null"}},
    # no additionalProperties: only what the pattern matches; a budget of keys
    "patterns_closed": {"type": "object", "properties": {"i_1": {"type": "integer"},
                                                         "z": {"type": "boolean"}},
                        "required": ["z"], "patternProperties": {"^i_\\d$": {"type": "integer"}},
                        "maxProperties": 3},
    # names by a gate, declared ones excluded from the other keys however they are spelt
    "names": {"type": "object", "properties": {"ab": {"type": "integer"}},
              "propertyNames": {"pattern": "^(ab|ac|x)$"},
              "additionalProperties": {"type": "boolean"}},
    "names_escaped": {"type": "object", "propertyNames": {"pattern": "^[\"\\\\a\u00e9]{1,3}$"},
                      "additionalProperties": {"const": 1}},
    # a key comes only while it and the keys it requires fit under maxProperties
    "depends": {"type": "object", "properties": {"card": {"type": "string"},
                                                 "billing": {"type": "string"},
                                                 "zip": {"type": "integer"}, "name": {}},
                "dependentRequired": {"card": ["billing"], "billing": ["zip"]},
                "maxProperties": 3},
    # declared names that need escapes, beside other keys by a gate: each declared one once
    # and in its one spelling (the gate never lets another key spell it)
    "names_spelt": {"type": "object", "properties": {"a\"b": {"type": "integer"},
                                                     "c\\d": {"type": "boolean"},
                                                     "\u00e9": {"const": 1}},
                    "required": ["a\"b"], "propertyNames": {"pattern": "^[a-e\"\\\\\u00e9]{1,3}$"},
                    "additionalProperties": {"type": "null"}, "maxProperties": 4},
    # the names allow declared properties only: no other key once they are written
    "names_declared": {"type": "object", "properties": {"ab": {}, "ac": {}},
                       "propertyNames": {"pattern": "^a[bc]$"}, "additionalProperties": True},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_whatever_the_grammar_completes_is_valid_under_the_schema(name):
    """The generation guarantee: random paths through the grammar, checked by an independent
    validator (jsonschema, Draft 2020-12)."""
    schema = SCHEMAS[name]
    g, rng = compile_schema(schema), random.Random(name)
    validator = jsonschema.Draft202012Validator(schema)
    done = [d for d in (random_walk(g, rng) for _ in range(60)) if d is not None]
    assert len(done) >= 20, f"only {len(done)} of 60 walks completed"
    for data in done:
        validator.validate(json.loads(data))


@pytest.mark.parametrize("name, doc", [
    ("pydantic", {"address": "x", "pets": [{"name": "Tom", "kind": "cat", "age": None,
                                            "colours": ["red"]}], "rating": -1.5e3,
                  "verified": False}),
    ("pydantic", {"verified": True, "rating": 0, "pets": [], "address": ""}),
    ("tree", {"v": 1, "kids": [{"v": 2}, {"kids": [], "v": -3}]}),
    ("bounds", {"s": "\u00e9\u00e9", "a": [None, 3], "c": "\u00e9t\u00e9"}),
    ("open", {"flag": True, "id": 4, "other": False}), ("open", {}),
    ("any_of", 2.5), ("any_of", "abc"), ("any_of", None),
    ("anything", [{"a": [1, {}]}, "x"]),
    ("numeric", {"count": 500, "ratio": 0.001, "celsius": -40.5, "offset": -9,
                 "pair": [1, "x"], "ids": [3, -4], "step": -2.75, "even": -8}),
    ("numeric", {"count": 0, "ratio": 0.999, "celsius": 60, "offset": 12345678901234567890,
                 "pair": [-7, ""], "step": 0.5, "even": 98}),
    ("tuple", ["a", True, -1, -20]), ("tuple", ["a"]), ("tuple", []),
    ("sets", {"colours": ["green", "red"], "sizes": [3, 1]}), ("sets", {"colours": []}),
    ("same_values", [1.0, True, "1", None]),
    ("props", {"a": 1, "c": True}), ("props", {"b": None, "c": False}),
    ("props_open", {"x": 1, "y": 2, "c": False}), ("props_open", {"c": True}),
    ("lengths", {"ip": "10.0.0.1", "p": "xab", "m": "aaab", "mail": "jo@example.org"}),
    ("keys", {"words": {"abc": 1, "z": -2}, "sides": {"right": 1, "left": 2},
              "flags": {"\u00e9\"1": True, "": False}}),
    ("keys", {"words": {}, "sides": {}, "flags": {}}),
    ("patterns", {"i_x": 1, "s_": "ab", "other": None, "i_y": -4}),
    ("patterns_closed", {"i_1": 1, "i_2": 3, "z": True}), ("patterns_closed", {"z": False}),
    ("names", {"ab": 1, "ac": True, "x": False}),
    ("names_escaped", {"\"": 1, "\\a\u00e9": 1}),
    ("names_declared", {"ac": [1], "ab": None}),
    ("names_spelt", {"a\"b": 1, "c\\d": True, "\u00e9": 1, "\"\\": None}),
    ("names_spelt", {"a\"b": 1, "ab": None}),
    ("depends", {"card": "x", "billing": "y", "zip": 1}), ("depends", {"name": 1, "zip": 2}),
    ("depends", {"billing": "b", "zip": 3, "name": None}), ("depends", {}),
])
def test_valid_documents_are_accepted(name, doc):
    g = compile_schema(SCHEMAS[name])
    rng = random.Random(0)
    for i in range(3):
        data = _dumps(rng, doc, i) if i else json.dumps(doc, ensure_ascii=False).encode()
        assert g.complete(g.feed(g.start, data)), data


@pytest.mark.parametrize("name, text", [
    ("pydantic", '{"address": "x", "pets": [], "rating": 1}'),  # verified missing
    ("pydantic", '{"address": 1'),
    ("pydantic", '{"pets": [{"name": "Tom", "kind": "co'),
    ("pydantic", '{"pets": [{"name": "a-name-too-lo'),
    ("pydantic", '{"rating": 1, "e'),
    ("pydantic", '{"rating": 1, "r'),  # a key once
    ("tree", '{"v": 1.'), ("tree", '{"kids": [{"v": 1}, {"v": 2},'),
    ("bounds", '{"s": "a"'), ("bounds", '{"s": "abcde'), ("bounds", '{"a": []'),
    ("bounds", '{"c": "\\'),  # const: one spelling
    ("open", '{"id": 1, "x": 1'), ("open", '{"id": t'), ("open", '{"id": 1, "id"'),
    ("any_of", '"abcd'), ("any_of", "[f"),
    ("any_of", "[ "),
    ("numeric", '{"count": 501'), ("numeric", '{"count": -'), ("numeric", '{"count": 1.'),
    ("numeric", '{"ratio": 1'), ("numeric", '{"ratio": 0}'), ("numeric", '{"ratio": 0.0 '),
    ("numeric", '{"ratio": 0.5e'), ("numeric", '{"celsius": -40.51'), ("numeric", '{"celsius": 61'),
    ("numeric", '{"celsius": 60.01'), ("numeric", '{"offset": -10'), ("numeric", '{"pair": [1]'),
    ("numeric", '{"pair": [1, "a",'), ("numeric", '{"count": 0.'),
    ("numeric", '{"step": 0.3'), ("numeric", '{"step": -3.2'), ("numeric", '{"even": 7,'),
    ("numeric", '{"even": 100'),
    ("sets", '{"colours": ["red", "r'), ("sets", '{"colours": ["red",]'),
    ("sets", '{"colours": [], "sizes": [1, 2,'), ("sets", '{"colours": [], "sizes": [1, 1'),
    ("lengths", '{"mail": "jo@example.n'), ("lengths", '{"mail": "jo.x@example.com.'),
    ("props", '{"c": true}'), ("props", '{"a": 1, "b'),  # only c fits: no b
    ("props", '{"a": 1, "c": true,'), ("props_open", '{"x": 1, "y": 2, "z'),
    ("props_open", '{"x": 1, "c": true, "y": 1,'),
    ("same_values", "[true, t"), ("same_values", "[1.0, 1"), ("same_values", "[]"),
    ("tuple", '["b'), ("tuple", '["a", 1'), ("tuple", '["a", true, 0'),
    ("tuple", '["a", true, -1, -1,'),
    ("keys", '{"words": {"A'), ("keys", '{"words": {"a": 1.'), ("keys", '{"sides": {"u'),
    ("keys", '{"sides": {"left": 1, "l'), ("keys", '{"flags": {"abcd'),
    ("patterns", '{"i_x": "'), ("patterns", '{"s_a": "abc'), ("patterns", '{"o": 1'),
    ("patterns_closed", '{"y'), ("patterns_closed", '{"i_12'),
    ("patterns_closed", '{"i_1": 1, "\\u0069_1'),  # i_1 again, spelt otherwise
    ("patterns_closed", '{"i_1": 1, "i_2": 2, "i'),  # only the required z fits
    ("names", '{"y'), ("names", '{"ab": 1, "ab'), ("names", '{"ac": 1'),
    ("names_escaped", '{"aaaa'), ("names_escaped", '{"b'),
    ("names_declared", '{"ab": 1, "ac": 2,'), ("names_declared", '{"ad'),
    ("names_spelt", '{"a\\"b": 1, "a\\"b'), ("names_spelt", '{"a\\"b": 1, "\\u00e9"'),
    ("names_spelt", '{"a\\"b": 1, "\\u0061\\"b'),  # a"b again: no key it ends
    ("names_spelt", '{"a\\"b": 1, "abcd'),
    ("depends", '{"card": "x"}'), ("depends", '{"card": "x", "billing": "y"}'),
    ("depends", '{"name": 1, "c'),  # card, billing and zip do not fit beside name
    ("depends", '{"card": "x", "n'),  # billing and zip must come
])
def test_invalid_documents_are_refused(name, text):
    """(An enum member is one spelling: `[true]`, not `[ true ]`.)"""
    g = compile_schema(SCHEMAS[name])
    assert g.feed(g.start, text.encode()) is None  # refused at the byte that breaks it
    assert g.feed(g.start, text[:-1].encode()) is not None


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "pattern": "(?<=a)b"}, "schema: pattern '\\(\\?<=a\\)b': look-around"),
    ({"type": "object", "properties": {"d": {"type": "string", "format": "idn-hostname"}}},
     r"schema.properties.d.format: 'idn-hostname' is not supported"),
    ({"type": "string", "format": "date", "pattern": "x"}, "matches both the pattern and the"),
    ({"type": "object", "if": {}}, "'if' not supported"),
    ({"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}},
     r"dependentRequired: \['b'\] are not among the properties"),
    ({"type": "object", "properties": {"a": {}, "bb": {}}, "propertyNames": {"maxLength": 1},
      "dependentRequired": {"a": ["bb"]}},
     r"dependentRequired: \['bb'\] are declared but propertyNames refuses them"),
    ({"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": "a"}},
     "must map property names to lists"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]},
      "minProperties": 1, "maxProperties": 2}, "dependentRequired with both minProperties"),
    ({"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "required": ["a"],
      "dependentRequired": {"a": ["b"], "b": ["c"]}, "maxProperties": 2},
     r"maxProperties 2 is below the 3 required properties \(with those they require\)"),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {}}},
     "a key can match both '\\^a' and 'b\\$'"),
    ({"type": "object", "properties": {"ab": {"type": "string"}},
      "patternProperties": {"^a": {"type": "integer"}}}, "'ab' also matches patternProperties"),
    ({"type": "object", "patternProperties": {"(?=a)": {}}},
     "schema.patternProperties: pattern '\\(\\?=a\\)': look-around"),
    ({"type": "object", "patternProperties": []}, "patternProperties: must be an object"),
    ({"type": "object", "properties": {"A": {}}, "required": ["A"],
      "propertyNames": {"pattern": "^[a-z]+$"}}, "'A' is not a key propertyNames allows"),
    ({"type": "object", "propertyNames": {"minLength": 2, "not": {}}},
     "propertyNames: 'not' not supported for keys"),
    ({"type": "object", "propertyNames": {"type": "integer"}}, "keys are strings"),
    ({"type": "object", "propertyNames": {"enum": ["a"], "maxLength": 3}}, "give either the keys"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a"], "propertyNames": False},
     "false allows no key"),
    ({"type": "object", "propertyNames": {"pattern": "^a$", "minLength": 2}},
     "no key of the pattern / format has a length within 2.."),
    ({"type": "object", "patternProperties": {"^a": {}}, "additionalProperties": True,
      "minProperties": 1}, "tell a repeated other key from a new one"),
    ({"type": "object", "properties": {f"property_{i}_of_many": {} for i in range(1500)},
      "propertyNames": {"pattern": "^[a-z_0-9]{1,60}$"}, "additionalProperties": True},
     "the automaton of its keys .* is too large"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"],
      "maxProperties": 1}, "maxProperties 1 is below the 2 required"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False,
      "minProperties": 2}, "minProperties 2 needs more properties than the 1 declared"),
    ({"type": "object", "minProperties": 3, "maxProperties": 2}, "maxProperties 2 is below"),
    ({"type": "object", "minProperties": 1}, "tell a repeated other key from a new one"),
    ({"type": "integer", "multipleOf": 4, "minimum": 1, "maximum": 3}, "is a multiple of 4"),
    ({"type": "number", "multipleOf": 0}, "multipleOf: must be above 0"),
    ({"type": "integer", "multipleOf": 1e30}, "need more than 20000 automaton states"),
    ({"type": "integer", "minimum": 2.5, "maximum": 2.9}, "no integer lies within its bounds"),
    ({"type": "number", "minimum": 1, "exclusiveMaximum": 1}, "no number lies within"),
    ({"type": "number", "exclusiveMinimum": True}, "draft 4's boolean form is not supported"),
    ({"type": "number", "maximum": "5"}, "maximum: must be a number"),
    ({"type": "number", "exclusiveMinimum": 1e-300}, "needs more than 40 digits written out"),
    ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2},
     "needs more items than prefixItems gives"),
    ({"type": "array", "prefixItems": {}}, "prefixItems: must be a list"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems: supported only for items from a "
                                              "fixed set"),
    ({"type": "array", "items": {"enum": [1, 1.0]}, "uniqueItems": True, "minItems": 2},
     "needs more distinct items than the 1 values"),
    ({"type": "array", "prefixItems": [{}], "uniqueItems": True}, "with prefixItems"),
    ({"type": "thing"}, "type: must be one of"),
    ({"type": "string", "maxItems": 2}, "do not apply to type"),
    ({"$ref": "#/$defs/missing"}, "does not point into the schema"),
    ({"$ref": "https://example.com/s.json"}, "only references inside the schema"),
    ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "allOf: only a single schema"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "not among the properties"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "maxLength 2 is below minLength 3"),
    ({"type": "string", "format": "date", "maxLength": 9}, "no string of the pattern / format"),
    ({"type": "string", "pattern": "^(ab|cde)$", "minLength": 4}, "has a length within"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "only refers to itself"),
    ({"anyOf": []}, "non-empty list"),
    ([1], "a schema must be an object or true"),
    ("{not json", "not valid JSON"),
])
def test_unsupported_or_broken_schemas_are_refused_by_name(schema, message):
    with pytest.raises(SchemaError, match=message):
        compile_schema(schema)


def test_choice_grammar_is_exactly_one_of_the_strings():
    g = choice_grammar(["yes", "yes please", "no"])
    for text, complete, must_end in [("yes", True, False), ("yes please", True, True),
                                     ("no", True, True), ("yes ", False, False)]:
        state = g.feed(g.start, text.encode())
        assert (g.complete(state), g.must_end(state)) == (complete, must_end), text
    assert g.feed(g.start, b"no ") is None and g.feed(g.start, b" no") is None
    with pytest.raises(SchemaError, match="non-empty list of non-empty strings"):
        choice_grammar(["a", ""])


def test_sampling_params_take_one_format_and_name_schema_errors():
    with pytest.raises(ConfigError, match="json_object and choice are each a whole output"):
        SamplingParams(json_object=True, choice=["a"])
    with pytest.raises(ConfigError, match="json_schema: schema: 'not' not supported"):
        SamplingParams(json_schema={"not": {"type": "string"}})
    with pytest.raises(ConfigError, match=r"regex: pattern 'a\(': unbalanced"):
        SamplingParams(regex="a(")
    with pytest.raises(ConfigError, match="json_object ends the output with EOS"):
        SamplingParams(json_object=True, ignore_eos=True)
    with pytest.raises(ConfigError, match="choice ends the output with EOS"):
        SamplingParams(choice=["a"], min_tokens=2, max_tokens=4)
    assert SamplingParams(json_schema=TREE).grammar() is compile_schema(TREE)  # compiled once


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(model=str(default_model_dir), device="cpu", max_model_len=512, num_blocks=64)


@pytest.fixture(scope="module")
def structured(llm):
    return StructuredOutput(TokenTexts(llm.tokenizer), llm.spec.vocab_size,
                            llm.runner.eos_token_ids)


@pytest.mark.parametrize("grammar, prefix", [
    (OBJ, b""), (OBJ, b'{"a'), (OBJ, b'{"a": [1'), (OBJ, b"{}"),
    (compile_schema(SCHEMAS["pydantic"]), b'{"pets": [{"kind": "'),
    (compile_schema(SCHEMAS["bounds"]), b'{"s": "ab'),
    (choice_grammar(["yes", "no"]), b"y"),
])
def test_mask_is_the_tokens_that_fit(structured, grammar, prefix):
    """The sorted-vocabulary walk that shares leading bytes == feeding every token alone."""
    state = grammar.feed(grammar.start, prefix)
    mask = structured.mask(grammar, state)
    expect = [structured.next_state(grammar, state, t) is not None
              for t in range(structured.vocab_size)]
    assert mask.tolist() == expect
    assert 0 < int(mask.sum()) < structured.vocab_size


def test_choose_masks_a_misfit_and_falls_back_to_the_full_mask(llm, structured):
    v = llm.spec.vocab_size
    brace = llm.tokenizer.convert_tokens_to_ids("{")
    logits = torch.zeros(v)
    logits[brace] = 5.0
    start, seen = OBJ.start, structured.num_rejections
    # greedy: a non-fitting token first, then the brace
    tok, state = structured.choose(OBJ, start, 30, logits, lambda row: int(torch.argmax(row)))
    assert tok == brace and state is not None and structured.num_rejections == seen + 1
    # the best MAX_REJECTIONS + 3 tokens all misfit: the step takes the full mask
    bad = [t for t in range(200, 2000)
           if structured.next_state(OBJ, start, t) is None][:MAX_REJECTIONS + 3]
    logits = torch.zeros(v)
    logits[bad] = torch.arange(len(bad), 0, -1, dtype=torch.float32) + 10
    logits[brace] = 1.0
    full = structured.num_full_masks
    tok, _ = structured.choose(OBJ, start, bad[0], logits, lambda row: int(torch.argmax(row)))
    assert tok == brace and structured.num_full_masks == full + 1
    done = OBJ.feed(start, b"{}")
    assert structured.choose(OBJ, done, brace, logits, lambda row: 0)[0] in \
        llm.runner.eos_token_ids
    eos = min(llm.runner.eos_token_ids)
    assert structured.next_state(OBJ, start, eos) is None  # EOS never ends an open object
    yes = choice_grammar(["yes", "yes please"])
    state = yes.feed(yes.start, b"yes")
    assert structured.next_state(yes, state, eos) == state  # complete, may still continue


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generation_is_one_json_object(llm, temperature):
    msgs = [{"role": "user", "content": "Describe a cat as a JSON object with the keys name, "
                                        "age and colour. Answer with JSON only."}]
    p = SamplingParams(temperature=temperature, seed=4, max_tokens=120, json_object=True)
    out = llm.chat(msgs, p, use_tqdm=False)[0]
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)
    free = llm.chat(msgs, SamplingParams(temperature=temperature, seed=4, max_tokens=120),
                    use_tqdm=False)[0]
    if free.text.lstrip().startswith("{"):  # where the model wrote JSON anyway: same text
        try:
            json.loads(free.text)
        except ValueError:
            return
        assert out.text.strip() == free.text.strip()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_follows_a_schema_and_a_choice(llm, temperature):
    schema = Pet.model_json_schema()
    msgs = [{"role": "user", "content": "Describe a pet as JSON: name, kind, age, colours."}]
    out = llm.chat(msgs, SamplingParams(temperature=temperature, seed=3, max_tokens=150,
                                        json_schema=schema), use_tqdm=False)[0]
    assert out.finish_reason == "stop", out.text
    Pet.model_validate_json(out.text)
    jsonschema.validate(json.loads(out.text), schema)
    msgs = [{"role": "user", "content": "Is fire hot? Answer yes or no."}]
    outs = llm.chat([msgs] * 4, [SamplingParams(temperature=temperature, seed=s, max_tokens=8,
                                                choice=["yes", "no", "maybe"])
                                 for s in range(4)], use_tqdm=False)
    assert all(o.text in ("yes", "no", "maybe") and o.finish_reason == "stop" for o in outs)


def test_sentencepiece_token_bytes():
    """U+2581 is a space and <0xNN> a raw byte (Llama 2 / Mistral 7B tokenizers)."""

    class Decoder:
        def __getstate__(self):
            return '{"type":"Sequence","decoders":[{"type":"Replace","content":" ",' \
                   '"pattern":{"String":"\u2581"}},{"type":"ByteFallback"}]}'.encode()

    class Backend:
        decoder = Decoder()

    class Tok:
        backend_tokenizer = Backend()
        all_special_ids = [2]
        pieces = {5: "\u2581hello", 6: "<0xE4>", 7: "{", 2: "</s>"}

        def convert_ids_to_tokens(self, i):
            return self.pieces[i]

        def decode(self, ids):
            return "</s>"

    texts = TokenTexts(Tok())
    assert texts.sentencepiece and not texts.byte_level
    assert texts(5) == (" hello", list(b" hello"))
    assert texts(6)[1] == [0xE4] and texts(7)[1] == list(b"{")
    assert texts(2) == ("</s>", list(b"</s>"))  # a special token: its text


def test_structured_bench_writes_its_json(tmp_path):
    """`kvcap bench structured` on a few documents: every grammar's documents check out (the
    bench asserts each is accepted and complete) and the JSON holds each measurement."""
    from kvcap.bench.structured import main

    out = tmp_path / "s.json"
    assert main(["--docs", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["grammar"] for r in result["rows"]] == ["json_object", "pet_schema",
                                                      "tree_schema", "record_schema",
                                                      "keys_schema"]
    for r in result["rows"]:
        assert r["tokens_checked"] > 0 and r["check_us_warm_median"] > 0
        kinds = {"before_key", "in_string", "in_number", "in_value"}
        no_strings = r["grammar"] in ("tree_schema", "keys_schema")  # no string values
        assert set(r["mask"]) == kinds - ({"in_value"} if no_strings else set())
        assert all(0 < m["tokens_allowed"] < result["vocab"] for m in r["mask"].values())
    assert result["commit"] and result["vocab"] == 49152


PATTERNS = ["a+b?c*", "(?:ab|c)+d", "[a-c][^a-c]?", "\\d{2,3}x", "x{2}y{0,2}z{1,}",
            "[\\w.]+@\\w+", "(a|b|)c", ".b", "[-a]\\-?", "(?:a{1,2}){2}", "\\s*\\S",
            "[\\u00e9\\x41]+", "a.*?b"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_matches_as_pythons_re(pattern):
    """The NFA against re.fullmatch (ASCII classes, as ECMA-262's) on every string of up to
    3 characters over a small alphabet plus random longer ones."""
    import itertools
    import re

    nfa, rng = compile_regex(pattern), random.Random(pattern)
    alphabet = "abcdxyz1@. -\u00e9A\n"
    words = ["".join(w) for n in range(4) for w in itertools.product(alphabet[:8], repeat=n)]
    words += ["".join(rng.choice(alphabet) for _ in range(rng.randint(4, 9)))
              for _ in range(2000)]
    for w in words:
        states = nfa.start
        for ch in w:
            states = nfa.step(states, ord(ch))
        assert (bool(states) and nfa.accepts(states)) == bool(re.fullmatch(pattern, w, re.ASCII)), w


@pytest.mark.parametrize("pattern, why", [
    ("a(?=b)", "look-around"), ("(a)\\1", "back-references"), ("a^b", "only at the ends"),
    ("(ab", "unbalanced"), ("[b-a]", "runs backwards"), ("*a", "nothing to repeat"),
    ("\\bword", "back-references, word boundaries"), ("a{3,1}", "maximum below"),
    ("(?P<n>a)", "named groups"), ("a{99999}", "more than"),
])
def test_unsupported_regex_is_refused_by_name(pattern, why):
    with pytest.raises(RegexError, match=why):
        compile_regex(pattern)


def test_regex_grammar_walks_match_and_end():
    import re

    rng = random.Random(5)
    for pattern in ["(yes|no)!?", "\\d{3}-\\d{4}", "[A-Z][a-z]{2,6}( [A-Z][a-z]{2,6})?"]:
        g = regex_grammar(pattern)
        done = [d for d in (random_walk(g, rng, 40) for _ in range(40)) if d is not None]
        assert len(done) >= 20, pattern
        assert all(re.fullmatch(pattern, d.decode()) for d in done), done
    assert regex_grammar("ab").must_end(regex_grammar("ab").feed(regex_grammar("ab").start, b"ab"))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_formats_generate_what_the_format_allows(fmt):
    """Random paths through each format's grammar: jsonschema's format checker (ipaddress
    for ipv4 / ipv6), datetime for the times, pydantic's URL parser for uri and a label check
    for host names accept every completed string."""
    import datetime as dt

    g, rng = compile_schema({"type": "string", "format": fmt}), random.Random(fmt)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER  # the 2020-12 formats
    done = [d for d in (random_walk(g, rng, 300) for _ in range(40)) if d is not None]
    assert len(done) >= 15, f"{len(done)} walks completed"
    for data in done:
        value = json.loads(data)
        jsonschema.validate(value, {"type": "string", "format": fmt}, format_checker=checker)
        if fmt in ("date", "date-time"):
            (dt.date if fmt == "date" else dt.datetime).fromisoformat(value)
        if fmt == "time":
            dt.time.fromisoformat(value)
        if fmt == "hostname":
            _check_hostname(value)
        if fmt == "uri":  # pydantic's URL parser (Rust's url crate, WHATWG) takes it whole
            url = pydantic.TypeAdapter(pydantic.AnyUrl).validate_python(value)
            assert url.scheme == value.split(":")[0] and url.host, value
            _check_hostname(urllib.parse.urlsplit(value).hostname)


def _check_hostname(name: str) -> None:
    """RFC 1123 / 952: dot-separated labels of 1-63 letters, digits and hyphens, neither end
    a hyphen, 253 characters at most."""
    assert len(name) <= 253, name
    for label in name.split("."):
        assert 1 <= len(label) <= 63 and label[0] != "-" and label[-1] != "-", name
        assert all(c.isascii() and (c.isalnum() or c == "-") for c in label), name


def test_pattern_is_a_search_unless_anchored_and_sees_decoded_escapes():
    free, anchored = (compile_schema({"type": "string", "pattern": p})
                      for p in ("\u00e9+", "^[a-z]+$"))
    for g, text, ok in [(free, '"x\u00e9\u00e9y"', True), (free, '"x\\u00e9y"', True),
                        (free, '"xy"', False), (anchored, '"abc"', True),
                        (anchored, '"ab1"', False), (anchored, '"\\u0061b"', True)]:
        assert g.complete(g.feed(g.start, text.encode())) == ok, text


def test_generation_follows_a_regex(llm):
    import re

    msgs = [{"role": "user", "content": "Give me a phone number."}]
    out = llm.chat(msgs, SamplingParams(temperature=0.7, seed=1, max_tokens=20,
                                        regex="\\d{3}-\\d{4}"), use_tqdm=False)[0]
    assert re.fullmatch("\\d{3}-\\d{4}", out.text) and out.finish_reason == "stop", out.text


def test_a_character_is_refused_at_its_first_byte_when_no_completion_matches():
    """A UTF-8 lead byte or a \\u escape's first digits only pass if some character they
    can still become matches: otherwise a token ending mid-character could be sampled and
    leave no token that continues the output."""
    yes = regex_grammar("(yes|no)!?")
    assert yes.feed(yes.start, b"\xc3") is None
    e = regex_grammar("\u00e9+")
    assert e.feed(e.start, b"\xc3") is not None and e.feed(e.start, b"\xc4") is None
    assert e.feed(e.start, b"\xc3\xa9") is not None and e.feed(e.start, b"\xc3\xa8") is None
    az = compile_schema({"type": "string", "pattern": "^[a-z]+$"})
    assert az.feed(az.start, b'"\\u00') is not None and az.feed(az.start, b'"\\u01') is None
    assert az.feed(az.start, b'"\\u0061') is not None and az.feed(az.start, b'"\\u0041') is None
    cjk = regex_grammar("\u4e16")  # a 3-byte character: E4 B8 96
    assert cjk.feed(cjk.start, b"\xe4\xb8") is not None and cjk.feed(cjk.start, b"\xe4\xb9") \
        is None


def test_regex_error_offsets_point_into_the_pattern_as_written():
    """A schema pattern is searched (wrapped in the compiler); its errors still point at the
    pattern's own characters."""
    for search in (False, True):
        with pytest.raises(RegexError, match=r"at offset 2\)"):
            compile_regex("x(?=a)", search=search)
        with pytest.raises(RegexError, match=r"at offset 3\)"):
            compile_regex("^a(?=b)$", search=search)


def test_no_dead_end_after_a_complete_pattern_or_at_max_length():
    """Once a format's match is complete, or a string is at its maxLength, a backslash or a
    UTF-8 lead byte is refused at once (it used to pass, leaving no token to continue with:
    seen as a date followed by \\u on the embedded model)."""
    g = compile_schema({"type": "string", "format": "date"})
    done = g.feed(g.start, b'"1969-07-20')
    assert done is not None and g.feed(done, b"\\") is None and g.feed(done, b"\xc3") is None
    assert g.complete(g.feed(done, b'"'))
    short = compile_schema({"type": "string", "pattern": "^.*$", "maxLength": 2})
    full = short.feed(short.start, b'"ab')
    assert short.feed(full, b"\\") is None and short.feed(full, b"\xc3") is None
    assert short.feed(short.start, b'"a\xc3\xa9"') is not None


def test_a_request_nothing_continues_ends_alone(llm, monkeypatch):
    """If no token could continue one request's output (a grammar without any way on), that
    request ends as aborted with the reason as its error (the server answers it with that
    error) and the rest of the batch goes on (it used to fail the whole step)."""
    from kvcap.engine.structured import NoContinuation

    real = StructuredOutput.choose

    def choose(self, grammar, state, tok, logits, resample):
        if grammar.description.startswith("one of"):  # the choice request: stuck at once
            raise NoContinuation("structured output (test): nothing continues")
        return real(self, grammar, state, tok, logits, resample)

    monkeypatch.setattr(StructuredOutput, "choose", choose)
    params = [SamplingParams(temperature=0, max_tokens=6, choice=["yes"]),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, json_object=True)]
    outs = llm.generate(["Hello"] * 3, params, use_tqdm=False)
    assert outs[0].finish_reason == "abort" and outs[0].token_ids == []
    assert outs[0].error == "error: structured output (test): nothing continues"
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 6
    assert outs[2].text.lstrip().startswith("{")


def test_reasoning_gate_frees_the_thinking_only():
    from kvcap.sampling.reasoning_gate import ReasoningGate

    g = ReasoningGate("qwen3")  # opens with <think>: free until the token completing </think>
    assert [g.admit(t) for t in [b"\n<think>", b"weigh </th", b"ink>", b"\n\n{", b"}"]] == \
        [False, False, False, True, True]
    g = ReasoningGate("qwen3")  # no <think>: all answer
    assert g.admit(b"{") and g.admit(b"<think>")
    g = ReasoningGate("deepseek_r1")  # thinking from the first token
    assert [g.admit(t) for t in [b"hmm", b"</think>", b"yes"]] == [False, False, True]
    with pytest.raises(ValueError, match="unknown reasoning style 'o1'"):
        ReasoningGate("o1")
    with pytest.raises(ConfigError, match="reasoning must be one of qwen3, deepseek_r1"):
        SamplingParams(choice=["a"], reasoning="o1")


def test_structured_output_waits_for_the_thinking_to_end(llm):
    """deepseek_r1 style: the reply thinks from its first token, so until </think> the tokens
    are the model's own (greedy: those of an unconstrained run); qwen3 style without <think>:
    the choice applies at once."""
    free = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0]
    assert b"</think>" not in free.text.encode()
    thinking = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8,
                                                      choice=["yes", "no"],
                                                      reasoning="deepseek_r1"),
                            use_tqdm=False)[0]
    assert thinking.token_ids == free.token_ids[:len(thinking.token_ids)]
    assert thinking.finish_reason == "length" and thinking.text not in ("yes", "no")
    answer = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8,
                                                    choice=["yes", "no"], reasoning="qwen3"),
                          use_tqdm=False)[0]
    assert answer.text in ("yes", "no") and answer.finish_reason == "stop"


@pytest.mark.parametrize("docs", ["0", "1"])
def test_structured_bench_refuses_fewer_than_two_documents(tmp_path, capsys, docs):
    """--docs 1 timed no warm document (StatisticsError: no median for empty data, after the
    tokenizer's vocabulary walk) and --docs 0 none at all (IndexError): a usage error."""
    from kvcap.bench.structured import main

    with pytest.raises(SystemExit) as e:
        main(["--docs", docs, "--out", str(tmp_path / "s.json")])
    assert e.value.code == 2
    assert "argument --docs:" in capsys.readouterr().err
