"""JSON Schema -> `json_grammar.Grammar`: what structured output (`response_format:
json_schema`, vLLM's `guided_json`, `SamplingParams(json_schema=...)`) generates against.

The generated text always validates against the schema. Where a schema leaves a choice to the
writer, the grammar takes the stricter reading, so the output stays valid under it:
  - an object with `properties` (even `{}`) and no `additionalProperties` gets only its
    declared keys (what OpenAI's strict mode asks anyway); `additionalProperties: true` or a
    schema opens it;
  - `enum` / `const` values are written in one spelling (json.dumps with ensure_ascii=False
    and no blanks, e.g. "\u00e9" as the character itself; an integral float also as an
    integer, 1.0 as 1), and only those that the schema's other keywords (`type`,
    `maxLength`, ...) allow too;
  - `oneOf` is compiled where its branches are exclusive, so that any output matches exactly
    one (`_Exclusive`: other JSON types, enum / const values apart, strings whose patterns,
    formats and lengths share none, numbers whose bounds and multiples share none, objects
    with a required property of exclusive values, e.g. pydantic's discriminated unions);
    branches that may overlap are refused (use anyOf);
  - a schema any of whose parts allows no finite value (a `$ref` back to itself through
    required properties or items) is refused: the output could never end;
  - a number with `minimum` / `maximum` / `exclusiveMinimum` / `exclusiveMaximum` /
    `multipleOf` is written in plain decimal (no exponent, never -0) and compared as the
    decimal it spells (kvcap/sampling/number_range.py);
  - `prefixItems` give the first items their own schemas; `items` then covers the rest
    (`items: false`: no more);
  - `maxProperties` with required properties: once only the missing required ones fit, only
    they may come; with `dependentRequired` (between declared properties) a key comes only
    while it and the keys it requires fit;
  - `uniqueItems` is compiled where the items come from a fixed set of values (enum /
    const / boolean / null, e.g. pydantic's set[Enum]): each value at most once.
`pattern` is a regular expression (kvcap/sampling/regex.py's subset) matched anywhere in the
string unless anchored; `format` is one of FORMATS (kvcap/sampling/formats.py: date, time,
date-time, uuid, email, ipv4, ipv6, hostname, uri), each generated as a regular expression
whose strings the format allows; a string with both takes what both allow (the product of the
two NFAs). `patternProperties` and `propertyNames` are kvcap/sampling/object_keys.py's.
Keywords that bound a value in ways this recogniser does not track (`uniqueItems` over
open-ended items, `not`, `if` / `then` / `else`, other formats, ...) are refused by name
rather than ignored: a schema is compiled exactly or not at all. Annotations (`title`,
`description`, `default`, `examples`, ...) are ignored, as JSON Schema says they may be;
`$ref` resolves against the root only, so one under a subschema's own `$id` (its base) is
refused.
"""

from __future__ import annotations

import json
from decimal import Decimal
from functools import lru_cache
from typing import Any

from kvcap.sampling.formats import FORMATS
from kvcap.sampling.json_grammar import Grammar
from kvcap.sampling.number_range import Bound, multiple_nfa, number_regex
from kvcap.sampling.object_keys import key_rules
from kvcap.sampling.regex import MAX_STATES, Nfa, RegexError, compile_regex, intersect

ANNOTATIONS = frozenset(["title", "description", "default", "examples", "$schema", "$id",
                         "$comment", "deprecated", "readOnly", "writeOnly", "discriminator",
                         "$defs", "definitions"])
BY_TYPE = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "boolean": set(),
    "null": set(),
    "object": {"properties", "required", "additionalProperties", "minProperties",
               "maxProperties", "patternProperties", "propertyNames", "dependentRequired"},
    "array": {"items", "prefixItems", "minItems", "maxItems", "uniqueItems"},
}
GENERAL = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"}
SUPPORTED = GENERAL | set().union(*BY_TYPE.values())
COMPILED_SCHEMAS = 32
BOUND_DIGITS = 40  # a numeric bound's digits (whole and fraction); its regex grows with them



class SchemaError(ValueError):
    """A schema kvcap cannot compile exactly; the message names where and why."""


def json_dumps(value: Any) -> bytes:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return _utf8(text, "the schema")


def _utf8(text: str, what: str) -> bytes:
    """`text` as UTF-8, or a SchemaError: a lone surrogate ("\\ud800" in a JSON request, a
    byte of argv that is not UTF-8) has no UTF-8 form, so no output can spell it (and the
    grammar refuses surrogate escapes); was a UnicodeEncodeError traceback, a server 500."""
    try:
        return text.encode()
    except UnicodeEncodeError as e:
        raise SchemaError(f"{what}: {text[:60]!r} holds a lone surrogate "
                          f"{text[e.start]!r}, which no UTF-8 output can hold") from None


def _spellings(value: Any) -> list[bytes]:
    """An enum / const value's spellings: json_dumps', and an integral float's as an integer
    too (1.0 as 1: JSON Schema calls 1.0 an integer, which "1.0" is not to the `integer`
    type's grammar). Only floats below 2**53, which are exactly the integer they name."""
    out = [json_dumps(value)]
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        out.append(json_dumps(int(value)))
    return out


@lru_cache(maxsize=COMPILED_SCHEMAS)
def _compile_text(text: str) -> Grammar:
    return _Compiler(json.loads(text)).grammar()


def compile_schema(schema: Any) -> Grammar:
    """The grammar of `schema` (a dict, or True for any JSON value); compiled once per
    distinct schema. Raises SchemaError."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise SchemaError(f"the schema is not valid JSON: {e}") from None
    try:
        text = json.dumps(schema, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        # (a pydantic model class, as OpenAI's client takes it, met only "Object of type
        # ModelMetaclass is not JSON serializable")
        hint = ("; pass the model's schema, Model.model_json_schema()"
                if hasattr(schema, "model_json_schema") else "")
        raise SchemaError(f"the schema is not JSON data: {e}{hint}") from None
    return _compile_text(text)


@lru_cache(maxsize=1)
def object_grammar() -> Grammar:
    """JSON mode (`response_format: json_object`): any one JSON object."""
    return _compile_text('{"type": "object"}')


@lru_cache(maxsize=COMPILED_SCHEMAS)
def _choice_grammar(choices: tuple[str, ...]) -> Grammar:
    nodes = [("lit", c.encode()) for c in choices]
    nodes.append(("alt", tuple(range(len(choices)))))
    return Grammar(nodes, len(choices), raw=True, description=f"one of {len(choices)} choices")


def regex_grammar(pattern: str) -> Grammar:
    """Text that the regular expression matches whole (vLLM's `guided_regex`)."""
    # (checked before the cache, which hashes its argument: a list was a TypeError, a 500)
    if not isinstance(pattern, str) or not pattern:
        raise SchemaError(f"the regex must be a non-empty string, got {pattern!r}")
    return _regex_grammar(pattern)


@lru_cache(maxsize=COMPILED_SCHEMAS)
def _regex_grammar(pattern: str) -> Grammar:
    try:
        nfa = compile_regex(pattern)
    except RegexError as e:
        raise SchemaError(str(e)) from None
    # the output is never empty (EOS only ends a match): a regex with no other match, or
    # none a reply can spell (a class of surrogates only), would leave no token to sample
    if not nfa.fits(nfa.start, 1, None):
        raise SchemaError(f"the regex {pattern!r} matches no non-empty text")
    return Grammar([("re", nfa)], 0, raw=True, description=f"regex {pattern!r}")


def choice_grammar(choices: list[str]) -> Grammar:
    """Exactly one of these strings, as plain text (vLLM's `guided_choice`)."""
    if not isinstance(choices, (list, tuple)):  # a string is not the list of its characters
        raise SchemaError(f"choices must be a list of strings, got {choices!r}")
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise SchemaError("choices must be a non-empty list of non-empty strings")
    for c in choices:
        _utf8(c, "choices")
    return _choice_grammar(tuple(dict.fromkeys(choices)))


@lru_cache(maxsize=COMPILED_SCHEMAS)
def _string_nfa(pattern: str | None, fmt: str | None) -> Nfa | None:
    """A string's pattern (searched), its format, both (the strings matching each), or
    None."""
    nfas = ([compile_regex(pattern, search=True)] if pattern is not None else []) + \
        ([compile_regex(FORMATS[fmt])] if fmt is not None else [])
    if not nfas:
        return None
    return nfas[0] if len(nfas) == 1 else intersect(*nfas)


class _Compiler:
    # what kvcap.sampling.object_keys uses besides string_regex
    error, annotations = SchemaError, ANNOTATIONS

    def __init__(self, root: Any):
        self.root = root
        self.nodes: list[tuple] = []
        self.refs: dict[str, int] = {}
        self._any: int | None = None
        self.one_ofs: list[tuple[str, tuple[int, ...]]] = []  # (path, branches): checked last
        self.under_id = 0  # subschemas with their own $id around the one being compiled

    def grammar(self) -> Grammar:
        root = self.compile(self.root, "schema")
        try:
            g = Grammar(self.nodes, root, description=_describe(self.root))
        except ValueError as e:
            raise SchemaError(str(e)) from None
        _check_finite(self.nodes, root)
        self.check_one_ofs(g)
        return g

    def check_one_ofs(self, g: Grammar) -> None:
        """Refuse each oneOf whose branches are not provably exclusive (once every node is
        built: a branch may refer back to a node still being compiled at its oneOf)."""
        exclusive = _Exclusive(g)
        for path, ids in self.one_ofs:
            for i, a in enumerate(ids):
                for j in range(i + 1, len(ids)):
                    if not exclusive.apart(a, ids[j]):
                        raise SchemaError(
                            f"{path}.oneOf: branches {i} and {j} may both match one value, and "
                            f"kvcap enforces oneOf only where its branches are exclusive "
                            f"(other types, distinct enum / const values, a required "
                            f"property whose values differ, ...); make them exclusive, or "
                            f"use anyOf")

    @staticmethod
    def count(s: dict, word: str, path: str, default: int | None) -> int | None:
        return _count(s, word, path, default)

    def add(self, node: tuple | None) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def any_value(self) -> int:
        """Any JSON value (a schema of `true` or `{}`)."""
        if self._any is None:
            self._any = self.add(None)
            obj = self.add(("obj", {}, frozenset(), self._any, (), 0, None, None, {}))
            arr = self.add(("arr", self._any, 0, None, ()))
            kinds = [self.add(("str", 0, None)), self.add(("num", False)),
                     *[self.add(("lit", w)) for w in (b"true", b"false", b"null")], obj, arr]
            self.nodes[self._any] = ("alt", tuple(kinds))
        return self._any

    def compile(self, s: Any, path: str) -> int:
        # a subschema's $id is the base its "#..." references resolve against, where kvcap
        # resolves them against the root: a $ref under one is refused (`ref`); it was read
        # against the root, silently another schema (allowed_values' copy of the root is
        # compiled at "schema" too)
        inner_id = isinstance(s, dict) and "$id" in s and s is not self.root and \
            path != "schema"
        self.under_id += inner_id
        try:
            return self._compile(s, path)
        finally:
            self.under_id -= inner_id

    def _compile(self, s: Any, path: str) -> int:
        if s is True or s == {}:
            return self.any_value()
        if not isinstance(s, dict):
            raise SchemaError(f"{path}: a schema must be an object or true, got {s!r}")
        unknown = sorted(set(s) - SUPPORTED - ANNOTATIONS)
        if unknown:
            raise SchemaError(
                f"{path}: {', '.join(map(repr, unknown))} not supported by kvcap's structured "
                f"output (supported: {', '.join(sorted(SUPPORTED))}); remove it, or check the "
                f"output yourself")
        keys = set(s) - ANNOTATIONS
        if "$ref" in s:
            self._only("$ref", keys, path)
            return self.ref(s["$ref"], path)
        for word in ("anyOf", "oneOf", "allOf"):
            if word in s:
                self._only(word, keys, path)
                branches = s[word]
                if not isinstance(branches, list) or not branches:
                    raise SchemaError(f"{path}.{word}: must be a non-empty list of schemas")
                if word == "allOf":
                    if len(branches) != 1:
                        raise SchemaError(f"{path}.allOf: only a single schema is supported "
                                          f"(got {len(branches)}); merge them into one")
                    return self.compile(branches[0], f"{path}.allOf[0]")
                ids = [self.compile(b, f"{path}.{word}[{i}]") for i, b in enumerate(branches)]
                if word == "oneOf":
                    self.one_ofs.append((path, tuple(ids)))
                return self.add(("alt", tuple(ids)))
        if "const" in s or "enum" in s:
            values = [s["const"]] if "const" in s else s["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{path}.enum: must be a non-empty list")
            lits = [self.add(("lit", v)) for v in self.allowed_values(s, values, path)]
            return lits[0] if len(lits) == 1 else self.add(("alt", tuple(lits)))
        types = s.get("type", sorted(BY_TYPE) if keys <= {"type"} else None)
        if types is None:  # no type: infer it from the keywords present
            types = sorted(t for t, words in BY_TYPE.items() if words & keys)
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types or any(t not in BY_TYPE for t in types):
            raise SchemaError(f"{path}.type: must be one of {sorted(BY_TYPE)} or a list of "
                              f"them, got {s.get('type')!r}")
        stray = keys - GENERAL - set().union(*(BY_TYPE[t] for t in types))
        if stray:
            raise SchemaError(f"{path}: {sorted(stray)} do not apply to type {types}")
        ids = [self.typed(t, s, path) for t in types]
        return ids[0] if len(ids) == 1 else self.add(("alt", tuple(ids)))

    def allowed_values(self, s: dict, values: list, path: str) -> list[bytes]:
        """The spellings (`_spellings`) of the enum / const values that the schema's other
        keywords allow too: each keyword applies to them (`{"type": "string", "enum": ["a",
        1]}` allows only "a"), so a spelling is kept only where the grammar of the rest of the
        schema takes it."""
        if "const" in s and "enum" in s:
            if not isinstance(s["enum"], list):
                raise SchemaError(f"{path}.enum: must be a non-empty list")
            members = {_value_key(e) for e in s["enum"]}
            values = [v for v in values if _value_key(v) in members]
        rest = {k: v for k, v in s.items() if k not in ("const", "enum")}
        if set(rest) - ANNOTATIONS:
            checker = _Compiler(self.root)  # its own nodes: this schema's stay as they are
            try:
                g = Grammar(checker.nodes, checker.compile(rest, path))
            except ValueError as e:  # SchemaError, or Grammar's on a $ref loop
                raise SchemaError(str(e)) from None
            checker.check_one_ofs(g)
            spelt = [t for v in values for t in _spellings(v) if g.complete(g.feed(g.start, t))]
        else:
            spelt = [t for v in values for t in _spellings(v)]
        spelt = list(dict.fromkeys(spelt))
        if not spelt:
            raise SchemaError(f"{path}: no value of enum / const meets the schema's other "
                              f"keywords")
        return spelt

    def _only(self, word: str, keys: set[str], path: str) -> None:
        others = sorted(keys - {word})
        if others:
            raise SchemaError(f"{path}: {word} cannot be combined with {others} here; move "
                              f"them inside {word}")

    def typed(self, t: str, s: dict, path: str) -> int:
        if t == "string":
            lo = _count(s, "minLength", path, 0)
            hi = _count(s, "maxLength", path, None)
            _check_bounds(lo, hi, "minLength", "maxLength", path)
            regex = self.string_regex(s, path)
            if regex is not None:
                if not regex.fits(regex.start, lo, hi):
                    why = "matches both the pattern and the format" if lo == 0 and hi is None \
                        else f"of the pattern / format has a length within minLength {lo} " \
                             f"and maxLength {hi}"
                    raise SchemaError(f"{path}: no string {why}")
                return self.add(("pat", regex, lo, hi))
            return self.add(("str", lo, hi))
        if t in ("number", "integer"):
            return self.number(s, t == "integer", path)
        if t in ("boolean", "null"):
            words = (b"true", b"false") if t == "boolean" else (b"null",)
            lits = [self.add(("lit", w)) for w in words]
            return lits[0] if len(lits) == 1 else self.add(("alt", tuple(lits)))
        if t == "array":
            return self.array(s, path)
        return self.object(s, path)

    def number(self, s: dict, integer: bool, path: str) -> int:
        low = _tighter(_bound(s, "minimum", False, path), _bound(s, "exclusiveMinimum", True,
                                                                   path), low=True)
        high = _tighter(_bound(s, "maximum", False, path), _bound(s, "exclusiveMaximum", True,
                                                                    path), low=False)
        step = _bound(s, "multipleOf", False, path)
        if step is not None and step[0] <= 0:
            raise SchemaError(f"{path}.multipleOf: must be above 0, got {s['multipleOf']!r}")
        if low is None and high is None and step is None:
            return self.add(("num", integer))
        pattern = number_regex(low, high, integer)
        kind = "integer" if integer else "number"
        if pattern is None:
            raise SchemaError(f"{path}: no {kind} lies within its bounds")
        try:
            nfa = compile_regex(pattern)
            if step is not None:
                nfa = intersect(nfa, multiple_nfa(step[0], integer))
        except RegexError:
            raise SchemaError(f"{path}: the bounds and multipleOf need more than "
                              f"{MAX_STATES} automaton states; loosen them") from None
        if not nfa.fits(nfa.start, 0, None):
            raise SchemaError(f"{path}: no {kind} within its bounds is a multiple of "
                              f"{s['multipleOf']!r}")
        return self.add(("re", nfa))

    def array(self, s: dict, path: str) -> int:
        prefix_schemas = s.get("prefixItems", [])
        if not isinstance(prefix_schemas, list):
            raise SchemaError(f"{path}.prefixItems: must be a list of schemas")
        prefix = tuple(self.compile(p, f"{path}.prefixItems[{i}]")
                       for i, p in enumerate(prefix_schemas))
        lo = _count(s, "minItems", path, 0)
        hi = _count(s, "maxItems", path, None)
        _check_bounds(lo, hi, "minItems", "maxItems", path)
        items_schema = s.get("items", True)
        unique = s.get("uniqueItems", False)
        if not isinstance(unique, bool):
            raise SchemaError(f"{path}.uniqueItems: must be true or false, got {unique!r}")
        if unique:
            if prefix:
                raise SchemaError(f"{path}: uniqueItems with prefixItems is not supported")
            return self.distinct(self.compile(items_schema, f"{path}.items"), lo, hi, path)
        if items_schema is False:  # nothing after the prefix
            hi = len(prefix) if hi is None else min(hi, len(prefix))
            if lo > hi:
                raise SchemaError(f"{path}: minItems {lo} needs more items than prefixItems "
                                  f"gives ({len(prefix)}) with items: false")
            items = self.any_value()  # never reached: hi stops at the prefix
        else:
            items = self.compile(items_schema, f"{path}.items")
        return self.add(("arr", items, lo, hi, prefix))

    def string_regex(self, s: dict, path: str) -> Nfa | None:
        """The NFA of a string's `pattern` (matched anywhere, as JSON Schema says, unless
        anchored), its `format`, or both together; None when it has neither."""
        if "pattern" in s and not isinstance(s["pattern"], str):
            raise SchemaError(f"{path}.pattern: must be a string")
        fmt = s.get("format")
        if fmt is not None and fmt not in FORMATS:
            raise SchemaError(f"{path}.format: {fmt!r} is not supported (supported: "
                              f"{', '.join(sorted(FORMATS))}); use a pattern")
        try:
            return _string_nfa(s.get("pattern"), fmt)
        except RegexError as e:
            raise SchemaError(f"{path}: {e}") from None

    def distinct(self, items: int, lo: int, hi: int | None, path: str) -> int:
        """An array of distinct values, its items drawn from a fixed set of literals."""
        lits = self._literals(items, ())
        if lits is None:
            raise SchemaError(f"{path}.uniqueItems: supported only for items from a fixed set of "
                              f"values (enum / const / boolean / null); remove it, or check "
                              f"the output yourself")
        lits = list(dict.fromkeys(lits))
        keys = [_value_key(json.loads(lit)) for lit in lits]
        group_of = {k: g for g, k in enumerate(dict.fromkeys(keys))}
        if lo > len(group_of):
            raise SchemaError(f"{path}: minItems {lo} needs more distinct items than the "
                              f"{len(group_of)} values there are")
        hi = len(group_of) if hi is None else min(hi, len(group_of))  # no comma past the last
        return self.add(("set", tuple(lits), tuple(group_of[k] for k in keys), lo, hi))

    def _literals(self, node_id: int, seen: tuple[int, ...]) -> list[bytes] | None:
        """The literals a node stands for, or None when it allows anything else."""
        node = self.nodes[node_id]
        if node is None or node_id in seen:
            return None
        if node[0] == "lit":
            return [node[1]]
        if node[0] != "alt":
            return None
        out: list[bytes] = []
        for i in node[1]:
            sub = self._literals(i, seen + (node_id,))
            if sub is None:
                return None
            out += sub
        return out

    def object(self, s: dict, path: str) -> int:
        props = s.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"{path}.properties: must be an object of schemas")
        required = s.get("required", [])
        if not isinstance(required, list) or any(not isinstance(r, str) for r in required):
            raise SchemaError(f"{path}.required: must be a list of property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaError(f"{path}.required: {missing} are not among the properties; "
                              f"declare them")
        # listed keys (properties, patternProperties) and no additionalProperties: no others
        closed = "properties" in s or "patternProperties" in s
        rules = key_rules(s, path, props, required, s.get("additionalProperties",
                                                           None if closed else True), self)
        node = self.add(None)  # reserved first: a property may refer back to this object
        spelt = {json_dumps(name)[1:-1]: self.compile(sub, f"{path}.properties.{name}")
                 for name, sub in rules.props.items()}
        extra = None if rules.extra in (None, False) else \
            self.compile(rules.extra, f"{path}.additionalProperties")
        keys = None
        if rules.gate is not None or rules.patterns:
            classes = tuple((nfa, self.compile(sub, f"{path}.patternProperties.{label}"))
                            for nfa, sub, label in rules.patterns)
            keys = (*(rules.gate or (None, 0, None)), classes)
        others = extra is not None or keys is not None  # keys beyond the declared ones
        deps = _dependencies(s, path, rules.props, props)
        # the required keys and what they require (deps are closed: what those require too)
        req = frozenset(json_dumps(r)[1:-1] for r in required)
        req = req.union(*(deps.get(r, ()) for r in req))
        lo = _count(s, "minProperties", path, 0)
        hi = _count(s, "maxProperties", path, None)
        _check_bounds(lo, hi, "minProperties", "maxProperties", path)
        if hi is not None and len(req) > hi:
            raise SchemaError(f"{path}: maxProperties {hi} is below the {len(req)} required "
                              f"properties" + (" (with those they require)" if deps else ""))
        if deps and lo > 0 and hi is not None:
            raise SchemaError(f"{path}: dependentRequired with both minProperties and "
                              f"maxProperties is not supported (kvcap could be led to keys that "
                              f"no allowed count completes); drop one of the bounds")
        if others and lo > len(req):
            raise SchemaError(f"{path}: minProperties {lo} above the {len(req)} required "
                              f"properties with other keys allowed is not supported (kvcap "
                              f"does not tell a repeated other key from a new one); require "
                              f"the properties, or close the object")
        if not others and lo > len(spelt):
            raise SchemaError(f"{path}: minProperties {lo} needs more properties than the "
                              f"{len(spelt)} declared (and no others are allowed)")
        self.nodes[node] = ("obj", spelt, req, extra, tuple(spelt), lo, hi, keys, deps)
        return node

    def ref(self, ref: Any, path: str) -> int:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"{path}.$ref: only references inside the schema ('#/$defs/Name'"
                              f") are supported, got {ref!r}")
        if self.under_id:
            raise SchemaError(f"{path}.$ref: {ref!r} lies under a subschema's own $id, the "
                              f"base JSON Schema resolves it against; kvcap resolves "
                              f"references against the root only: drop that $id")
        if ref not in self.refs:
            target: Any = self.root
            for part in filter(None, ref[1:].split("/")):
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    raise SchemaError(f"{path}.$ref: {ref!r} does not point into the schema")
                target = target[part]
            slot = self.refs[ref] = self.add(None)
            self.nodes[slot] = ("alt", (self.compile(target, ref),))
        return self.refs[ref]


def _dependencies(s: dict, path: str, props: dict,
                  declared: dict | None = None) -> dict[bytes, frozenset[bytes]]:
    """dependentRequired as spelt key -> every key it requires, directly or through others.
    Both sides must be properties the object may hold (`props`: the declared ones that
    propertyNames lets through; `declared`: all declared, to say why one is refused)."""
    given = s.get("dependentRequired", {})
    if not isinstance(given, dict) or any(
            not isinstance(v, list) or any(not isinstance(n, str) for n in v)
            for v in given.values()):
        raise SchemaError(f"{path}.dependentRequired: must map property names to lists of "
                          f"property names")
    for name, needed in given.items():
        strays = [n for n in [name, *needed] if n not in props]
        named = [n for n in strays if n in (declared or {})]
        if named:
            raise SchemaError(f"{path}.dependentRequired: {named} are declared but "
                              f"propertyNames refuses them, so they can never appear; drop "
                              f"them from dependentRequired or let propertyNames take them")
        if strays:
            raise SchemaError(f"{path}.dependentRequired: {strays} are not among the "
                              f"properties; declare them")
    deps = {name: set(needed) - {name} for name, needed in given.items()}
    grew = True
    while grew:  # close: what a required key requires is required too
        grew = False
        for needed in deps.values():
            more = set().union(*(deps.get(n, set()) for n in needed)) - needed
            if more:
                needed |= more
                grew = True
    return {json_dumps(k)[1:-1]: frozenset(json_dumps(n)[1:-1] for n in v - {k})
            for k, v in deps.items() if v - {k}}


def _count(s: dict, word: str, path: str, default: int | None) -> int | None:
    """A non-negative integer keyword, or `default` when absent."""
    v = s.get(word, default)
    if v is not default and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise SchemaError(f"{path}.{word}: must be a non-negative integer, got {v!r}")
    return v


def _bound(s: dict, word: str, exclusive: bool, path: str) -> Bound:
    if word not in s:
        return None
    v = s[word]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        hint = (f" (draft 4's boolean form is not supported: give the bound itself, "
                f"e.g. {word}: 0)" if isinstance(v, bool) else "")
        raise SchemaError(f"{path}.{word}: must be a number, got {v!r}{hint}")
    value = _decimal(v)
    _, digits, exponent = value.as_tuple()
    if max(len(digits), len(digits) + exponent, -exponent) > BOUND_DIGITS:
        raise SchemaError(f"{path}.{word}: {v!r} needs more than {BOUND_DIGITS} digits "
                          f"written out; use a shorter bound")
    return value, exclusive


def _decimal(v: int | float) -> Decimal:
    """A JSON number as the decimal it was written as (a float by its shortest repr)."""
    return Decimal(v) if isinstance(v, int) else Decimal(repr(v))


def _tighter(a: Bound, b: Bound, low: bool) -> Bound:
    """The stricter of two bounds on the same side."""
    if a is None or b is None:
        return a or b
    if a[0] != b[0]:
        return max(a, b) if low else min(a, b)
    return a if a[1] else b  # the same value: exclusive is stricter


def _check_bounds(lo: int, hi: int | None, lo_word: str, hi_word: str, path: str) -> None:
    if hi is not None and hi < lo:
        raise SchemaError(f"{path}: {hi_word} {hi} is below {lo_word} {lo}")


def _value_key(v: Any) -> Any:
    """A key equal for values JSON Schema calls equal (1 and 1.0; objects in any key order;
    true is not 1)."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return (type(v).__name__, v)
    if isinstance(v, (int, float)):
        return ("number", _decimal(v))
    if isinstance(v, list):
        return ("array", tuple(_value_key(x) for x in v))
    return ("object", tuple(sorted((k, _value_key(x)) for k, x in v.items())))


def _describe(schema: Any) -> str:
    title = schema.get("title") if isinstance(schema, dict) else None
    return f"schema {title!r}" if isinstance(title, str) else "schema"


def _check_finite(nodes: list[tuple], root: int) -> None:
    """Refuse a schema with a part that allows no finite value (a `$ref` back to itself
    through required properties or items): the grammar would let a model open it and nest
    until MAX_DEPTH, where no byte continues the output."""
    finite = [False] * len(nodes)
    grew = True
    while grew:  # least fixed point: a node is finite once what it must hold is
        grew = False
        for i in reversed(range(len(nodes))):  # children mostly come after their parent
            if not finite[i] and _finite_node(nodes[i], finite):
                finite[i] = grew = True
    seen, todo = {root}, [root]
    while todo:
        i = todo.pop()
        if not finite[i]:
            raise SchemaError("schema: a part of it allows no finite value (a $ref that "
                              "refers back to itself through required properties or items, "
                              "or a choice that only does); make the reference optional")
        for j in _children(nodes[i]):
            if j not in seen:
                seen.add(j)
                todo.append(j)


def _finite_node(node: tuple, finite: list[bool]) -> bool:
    kind = node[0]
    if kind == "alt":
        return any(finite[j] for j in node[1])
    if kind == "arr":
        _, items, lo, _, prefix = node
        # (the prefix's nodes, then `items` once: a loop over all `lo` items took minutes
        # for a minItems of 10**9, a server request that blocked every other)
        return all(finite[p] for p in prefix[:lo]) and (lo <= len(prefix) or finite[items])
    if kind == "obj":
        _, props, req, extra, _, lo, _, keys, _ = node
        if not all(finite[props[k]] for k in req):
            return False
        optional = sum(finite[v] for k, v in props.items() if k not in req)
        others = (extra is not None and finite[extra]) or \
            (keys is not None and any(finite[v] for _, v in keys[3]))
        return others or len(req) + optional >= lo
    return True


def _children(node: tuple) -> list[int]:
    kind = node[0]
    if kind == "alt":
        return list(node[1])
    if kind == "arr":
        return [node[1], *node[4]]
    if kind == "obj":
        _, props, _, extra, _, _, _, keys, _ = node
        return [*props.values(), *([] if extra is None else [extra]),
                *([] if keys is None else [v for _, v in keys[3]])]
    return []


_INTEGER_SPELLINGS = "0|-?[1-9][0-9]*"


class _Exclusive:
    """Whether two nodes of a built grammar share no JSON value (sufficient tests only: False
    means "may overlap")."""

    MAX_DEPTH = 8  # object properties followed down to find a discriminating one

    def __init__(self, g: Grammar):
        self.g, self.nodes = g, g.nodes

    def apart(self, a: int, b: int, depth: int = 0) -> bool:
        return all(self._nodes_apart(x, y, depth) for x in self.g.alternatives[a]
                   for y in self.g.alternatives[b])

    def _nodes_apart(self, x: int, y: int, depth: int) -> bool:
        nx, ny = self.nodes[x], self.nodes[y]
        kind = _kind(nx)
        if kind != _kind(ny):
            return True
        if x == y or kind in ("true", "false", "null"):
            return False
        if nx[0] == "lit" and ny[0] == "lit":
            return _value_key(json.loads(nx[1])) != _value_key(json.loads(ny[1]))
        try:
            if kind == "string":
                return _strings_apart(nx, ny)
            if kind == "number":
                return _numbers_apart(nx, ny)
        except RegexError:  # a product too large to build: say they may overlap
            return False
        if kind == "object" and nx[0] == ny[0] == "obj" and depth < self.MAX_DEPTH:
            shared = nx[2] & ny[2]  # required in both: a value apart keeps the objects apart
            return any(self.apart(nx[1][k], ny[1][k], depth + 1) for k in shared
                       if k in nx[1] and k in ny[1])
        return False


def _kind(node: tuple) -> str:
    kind = node[0]
    if kind in ("str", "pat"):
        return "string"
    if kind in ("num", "re"):
        return "number"
    if kind == "obj":
        return "object"
    if kind in ("arr", "set"):
        return "array"
    first = node[1][:1]  # a literal
    return {b'"': "string", b"{": "object", b"[": "array", b"t": "true", b"f": "false",
            b"n": "null"}.get(first, "number")


def _string_rule(node: tuple) -> tuple[Nfa | None, int, int | None] | str:
    """A string node as its literal, or (NFA or None for any, min length, max length)."""
    if node[0] == "lit":
        return json.loads(node[1])
    if node[0] == "pat":
        return node[1], node[2], node[3]
    return None, node[1], node[2]


def _strings_apart(nx: tuple, ny: tuple) -> bool:
    a, b = _string_rule(nx), _string_rule(ny)
    if isinstance(a, str) or isinstance(b, str):
        text, (nfa, lo, hi) = (a, b) if isinstance(a, str) else (b, a)
        return not (lo <= len(text) and (hi is None or len(text) <= hi)
                    and (nfa is None or nfa.matches(text)))
    lo = max(a[1], b[1])
    hi = a[2] if b[2] is None else b[2] if a[2] is None else min(a[2], b[2])
    if hi is not None and lo > hi:
        return True
    nfas = [n for n in (a[0], b[0]) if n is not None]
    if not nfas:
        return False
    nfa = nfas[0] if len(nfas) == 1 else intersect(*nfas)
    return not nfa.fits(nfa.start, lo, hi)


def _number_rule(node: tuple) -> Nfa | None | str:
    """A number node as its literal's plainest spelling, or an NFA of the plainest spellings
    of its values (None: any number). Bounds and multiples accept each value they allow in
    its plainest spelling, so two nodes share a value only if their NFAs share a string."""
    if node[0] == "lit":
        value = Decimal(node[1].decode())
        if value == value.to_integral_value():
            return str(int(value))
        return format(value.normalize(), "f")
    if node[0] == "re":
        return node[1]
    return compile_regex(_INTEGER_SPELLINGS) if node[1] else None


def _numbers_apart(nx: tuple, ny: tuple) -> bool:
    a, b = _number_rule(nx), _number_rule(ny)
    if isinstance(a, str) or isinstance(b, str):
        text, nfa = (a, b) if isinstance(a, str) else (b, a)
        return nfa is not None and not nfa.matches(text)
    if a is None or b is None:
        return False
    both = intersect(a, b)
    return not both.fits(both.start, 0, None)
