"""Random schemas x random walks: whatever the grammar lets a model write, jsonschema accepts,
and no walk reaches a state that no byte continues and that is not complete. The schemas mix
the keywords kvcap compiles (bounds on numbers, strings and arrays, patterns and formats with
lengths, tuples, sets of enum values, enums, anyOf, nested objects, keys by pattern and by
name rules, keys that require others) at random, seeded."""

from __future__ import annotations

import json
import random
from decimal import Decimal, localcontext

import jsonschema
import pytest
from grammar_walk import random_walk

from kvcap.sampling.json_schema import SchemaError, compile_schema

BOUNDS = [0, 1, -1, 2.5, -3.25, 10, 100, 0.01, -0.5, 7, 1000]
PATTERNS = ["^[a-c]+$", "x", "^\\d{2}", "(ab|cd)", "\u00e9+", "1", "[0-4]$"]
ENUMS = [1, "a", None, True, 2.5, "\u00e9", [1], {"k": 1}]
KEY_PATTERNS = ["^q", "^r\\d$", "^x", "^[a-c]+$"]  # no two share a key
KEY_NAMES = [{"maxLength": 3}, {"pattern": "^[pqrx]"}, {"enum": ["p0", "p1", "q", "x"]},
             {"pattern": "^..$"}, {"minLength": 2, "pattern": "[0-9a-c]"}]
LEAVES = ["integer", "number", "string", "boolean", "null", "enum"]


def random_schema(rng: random.Random, depth: int = 0, kind: str | None = None,
                  keys: float = 0.2) -> dict:
    """`keys`: how likely an object gets patternProperties, and (3/4 of it) propertyNames."""
    kind = kind or rng.choice(LEAVES + (["array", "tuple", "object", "anyOf"] if depth < 3
                                        else []))
    if kind in ("integer", "number"):
        s = {"type": kind}
        for word in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if rng.random() < 0.3:
                s[word] = rng.choice(BOUNDS)
        if rng.random() < 0.2:  # steps exact in binary: jsonschema divides floats
            s["multipleOf"] = rng.choice([2, 3, 5, 0.5, 0.25])
        return s
    if kind == "string":
        s = {"type": "string"}
        if rng.random() < 0.3:
            s["maxLength"] = rng.randint(0, 6)
        if rng.random() < 0.3:
            s["minLength"] = rng.randint(0, 3)
        if rng.random() < 0.25:
            s["pattern"] = rng.choice(PATTERNS)
        if rng.random() < 0.15:  # with a pattern too at times: what both allow
            s["format"] = rng.choice(["date", "uuid", "ipv4", "time"])
        return s
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "enum":
        return {"enum": rng.sample(ENUMS, rng.randint(1, 3))}
    if kind in ("array", "tuple"):
        s = {"type": "array"}
        if kind == "tuple":
            s["prefixItems"] = [random_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]
            if rng.random() < 0.4:
                s["items"] = False
        if "items" not in s and rng.random() < 0.2:
            s["items"], s["uniqueItems"] = {"enum": rng.sample(ENUMS, rng.randint(1, 4))}, True
        elif "items" not in s and rng.random() < 0.7:
            s["items"] = random_schema(rng, depth + 1)
        if rng.random() < 0.3:
            s["minItems"] = rng.randint(0, 2)
        if rng.random() < 0.3:
            s["maxItems"] = rng.randint(2, 4)
        return s
    if kind == "object":
        props = {f"p{i}": random_schema(rng, depth + 1) for i in range(rng.randint(0, 3))}
        s = {"type": "object", "properties": props,
             "required": [p for p in props if rng.random() < 0.5]}
        if rng.random() < 0.2:
            s["additionalProperties"] = random_schema(rng, depth + 1)
        if rng.random() < keys:  # other keys by pattern; by name rules
            s["patternProperties"] = {p: random_schema(rng, depth + 1)
                                      for p in rng.sample(KEY_PATTERNS, rng.randint(1, 2))}
        if rng.random() < 0.75 * keys:
            s["propertyNames"] = rng.choice(KEY_NAMES)
        if props and rng.random() < 0.15:  # a key that needs others
            s["dependentRequired"] = {rng.choice(list(props)): rng.sample(
                list(props), rng.randint(1, len(props)))}
        if rng.random() < 0.25:  # within what the declared (and, open, required) keys allow
            top = len(s["required"]) if {"additionalProperties", "patternProperties"} & set(s) \
                else len(props)
            s["minProperties"] = rng.randint(0, top)
        if rng.random() < 0.25:
            s["maxProperties"] = rng.randint(max(len(s["required"]),
                                                 s.get("minProperties", 0)), 5)
        return s
    return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}


@pytest.mark.parametrize("block", range(5))
def test_random_schemas_generate_only_valid_documents(block):
    """Blocks 0-3 any schema; block 4 objects whose keys are mostly by pattern or name."""
    compiled = completed = ruled = 0
    for seed in range(block * 100, block * 100 + 100):
        rng = random.Random(seed)
        schema = random_schema(rng) if block < 4 else random_schema(rng, kind="object",
                                                                    keys=0.8)
        try:
            g = compile_schema(schema)
        except SchemaError:
            continue  # e.g. bounds no number meets: refused by name, tested elsewhere
        compiled += 1
        ruled += bool({"patternProperties", "propertyNames"} & set(schema))
        # numbers compared as the decimals they spell, as kvcap's bounds and multiples are
        # (a float parse would round 10788922167281611934480823932369365900 off a multiple of 5)
        validator = jsonschema.Draft202012Validator(_decimals(schema))
        for _ in range(6):
            data = random_walk(g, rng, 300)
            if data is None:
                continue
            completed += 1
            with localcontext(prec=400):  # whole remainders of numbers of any length
                errors = list(validator.iter_errors(json.loads(data, parse_float=Decimal)))
            assert not errors, (seed, json.dumps(schema), data, errors[0].message)
    if block < 4:
        assert compiled >= 80 and completed >= 300, (compiled, completed)
    else:  # nested leaves are refused more often under an object
        assert compiled >= 65 and ruled >= 50 and completed >= 300, (compiled, ruled, completed)


def _decimals(schema: dict) -> dict:
    return json.loads(json.dumps(schema), parse_float=Decimal)
