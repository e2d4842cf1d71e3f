"""An object's keys beyond its declared properties: JSON Schema's `propertyNames` (what every
key must be) and `patternProperties` (the value schema of keys a regular expression matches),
turned into what kvcap's object recogniser (kvcap/sampling/json_grammar.py) runs.

Both are compiled exactly or refused by name:
  - `propertyNames` with `enum` / `const` lists the keys: they become optional declared
    properties (valued by the pattern they match, else `additionalProperties`), which also
    keeps each of them to one use. Otherwise its `pattern`, `format`, `minLength` and
    `maxLength` make a gate: the characters of every other key run through its NFA.
    A declared property the names refuse is dropped (it can never appear), or refused when
    required.
  - `patternProperties`: each other key takes the value schema of the pattern it matches
    (patterns searched, as JSON Schema says, unless anchored), else `additionalProperties`.
    Patterns with the same schema are one class; classes must not share a key (kvcap compiles
    one value schema per key), nor may a declared property match a pattern of another schema.
    As with `properties`, an object that lists `patternProperties` and not
    `additionalProperties` takes no other keys (kvcap writes what the schema names).
Without `additionalProperties` the keys allowed are those the patterns match (and the names
allow). A gate (which an open object with declared properties always gets) never lets
through a declared property's name (however its key is spelt), so that another key is never a
repeat, nor a prefix whose only ends are properties written already; when that leaves no key,
no other key is compiled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvcap.sampling.regex import Nfa, RegexError, compile_regex, either, excluding, intersect

NAME_WORDS = {"type", "pattern", "format", "minLength", "maxLength", "enum", "const"}


@dataclass
class KeyRules:
    props: dict[str, Any]  # the declared properties, after the rules
    extra: Any  # the schema of other keys that match no pattern, or None
    gate: tuple[Nfa, int, int | None] | None = None  # what other keys' characters must match
    # disjoint key classes: (NFA, value schema, its patterns as the schema spells them)
    patterns: list[tuple[Nfa, Any, str]] = field(default_factory=list)


def key_rules(s: dict, path: str, props: dict[str, Any], required: list[str], extra: Any,
              words) -> KeyRules:
    """The rules of object schema `s` (`extra`: its additionalProperties, None for none).
    `words` is the schema compiler's toolkit: `string_regex(schema, path)` (a string schema's
    NFA), `count(schema, word, path, default)` (a non-negative keyword), `annotations`, and
    `error` (its SchemaError)."""
    error = words.error
    names = s.get("propertyNames", True)
    if names is False:
        if required:
            raise error(f"{path}.propertyNames: false allows no key, but {required} are "
                        f"required")
        return KeyRules({}, None)
    groups = _pattern_groups(s.get("patternProperties", {}), path, error)
    props = dict(props)
    if names is True or names == {}:
        listed, gate = None, None
    else:
        listed, gate = _names(names, f"{path}.propertyNames", words)
    for name, sub in list(props.items()):
        if not (name in listed if listed is not None else
                gate is None or _fits(gate, name)):
            if name in required:
                raise error(f"{path}.required: {name!r} is not a key propertyNames allows")
            del props[name]
            continue
        for nfa, schema, spelt in groups:
            if nfa.matches(name) and _canonical(sub) != _canonical(schema):
                raise error(f"{path}: property {name!r} also matches patternProperties "
                            f"{spelt!r}, so its value would have to meet both schemas; kvcap "
                            f"compiles one schema per key: give them the same schema")
    if listed is not None:  # the keys are named: each becomes a declared property
        for name in listed:
            if name not in props:
                value = next((schema for nfa, schema, _ in groups if nfa.matches(name)), extra)
                if value is not None and value is not False:
                    props[name] = value
        return KeyRules(props, None)
    if extra is None or extra is False:
        if not groups:
            return KeyRules(props, None)
        extra = None
        union = _built(path, error, either, *(nfa for nfa, _, _ in groups))
        gate = (_built(path, error, intersect, gate[0], union), gate[1], gate[2]) if gate \
            else (union, 0, None)
    if gate is None and props:
        # other keys are free (valued by a pattern or `extra`), but one spelt with escapes
        # ("\u0061") may still be a declared property's name: the gate below refuses those,
        # so that no property is written twice (json.loads keeps the last) or valued under
        # another schema than its own
        gate = (compile_regex("", search=True), 0, None)
    if gate is not None:  # other keys never spell a declared property (a repeat, or a
        # prefix whose only ends are properties written already: a key it could not finish)
        nfa, lo, hi = gate
        nfa = _built(path, error, lambda: intersect(nfa, excluding(props)))
        if not nfa.fits(nfa.start, lo, hi):
            return KeyRules(props, None)  # the gate lets through declared properties only
        gate = (nfa, lo, hi)
    return KeyRules(props, extra, gate, groups)


def _names(names: Any, path: str, words):
    """propertyNames: (the listed keys, None) or (None, (NFA, min length, max length))."""
    error, annotations = words.error, words.annotations
    if not isinstance(names, dict):
        raise error(f"{path}: must be a schema (an object, or true / false)")
    unknown = sorted(set(names) - NAME_WORDS - annotations)
    if unknown:
        raise error(f"{path}: {', '.join(map(repr, unknown))} not supported for keys "
                    f"(supported: {', '.join(sorted(NAME_WORDS))})")
    if names.get("type", "string") != "string":
        raise error(f"{path}.type: keys are strings, got {names['type']!r}")
    if "enum" in names or "const" in names:
        if set(names) - annotations - {"type", "enum", "const"}:
            raise error(f"{path}: give either the keys (enum / const) or a pattern, format "
                        f"and lengths, not both")
        values = [names["const"]] if "const" in names else names["enum"]
        if not isinstance(values, list) or not values:
            raise error(f"{path}.enum: must be a non-empty list")
        return [v for v in dict.fromkeys(values) if isinstance(v, str)], None
    lo, hi = words.count(names, "minLength", path, 0), words.count(names, "maxLength", path, None)
    if hi is not None and hi < lo:
        raise error(f"{path}: maxLength {hi} is below minLength {lo}")
    nfa = words.string_regex(names, path) or compile_regex("", search=True)
    if not nfa.fits(nfa.start, lo, hi):
        raise error(f"{path}: no key of the pattern / format has a length within "
                    f"{lo}..{'' if hi is None else hi}")
    return None, (nfa, lo, hi)


def _pattern_groups(patterns: Any, path: str, error) -> list[tuple[Nfa, Any, str]]:
    """patternProperties as disjoint classes: (NFA of the keys, value schema, patterns)."""
    if not isinstance(patterns, dict):
        raise error(f"{path}.patternProperties: must be an object of schemas")
    by_schema: dict[str, tuple[list[Nfa], Any, list[str]]] = {}
    for pattern, schema in patterns.items():
        try:
            nfa = compile_regex(pattern, search=True)
        except RegexError as e:
            raise error(f"{path}.patternProperties: {e}") from None
        nfas, _, spelt = by_schema.setdefault(_canonical(schema), ([], schema, []))
        nfas.append(nfa)
        spelt.append(pattern)
    groups = [(nfas[0] if len(nfas) == 1 else _built(path, error, either, *nfas), schema,
               " / ".join(spelt))
              for nfas, schema, spelt in by_schema.values()]
    for i, (a, _, sa) in enumerate(groups):
        for b, _, sb in groups[i + 1:]:
            both = _built(path, error, intersect, a, b)
            if both.fits(both.start, 0, None):
                raise error(f"{path}.patternProperties: a key can match both {sa!r} and {sb!r}, "
                            f"whose schemas differ; kvcap compiles one schema per key: make "
                            f"the patterns exclusive")
    return groups


def _built(path: str, error, make, *args) -> Nfa:
    """An automaton of the keys' rules, or the schema's error when it grows too large."""
    try:
        return make(*args)
    except RegexError as e:
        raise error(f"{path}: the automaton of its keys (propertyNames, patternProperties and "
                    f"the declared properties they must not repeat) is too large: {e}") from None


def _canonical(schema: Any) -> str:
    return json.dumps(schema, sort_keys=True)


def _fits(gate: tuple[Nfa, int, int | None], name: str) -> bool:
    nfa, lo, hi = gate
    return lo <= len(name) and (hi is None or len(name) <= hi) and nfa.matches(name)
