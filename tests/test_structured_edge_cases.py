"""Edge cases of structured output, tool-call parsing and reasoning parsing found by review:
each a case where the output broke its schema, a grammar reached a state no byte continues,
a parser raised instead of answering, or a stream disagreed with the whole reply."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from kvcap.sampling.json_schema import SchemaError, compile_schema, regex_grammar
from kvcap.server.reasoning import ReasoningStream, split_reasoning
from kvcap.server.tool_parsers import parse_tool_calls


def accepts(g, text: str) -> bool:
    return g.complete(g.feed(g.start, text.encode()))


@pytest.mark.parametrize("schema, values", [
    ({"type": "string", "enum": ["a", 1]}, ['"a"', "1"]),
    ({"enum": ["a", "bbbb"], "maxLength": 2}, ['"a"', '"bbbb"']),
    ({"type": "integer", "enum": [1, 5, "x"], "minimum": 3}, ["1", "5", '"x"']),
    ({"const": "x", "enum": ["x", "y"]}, ['"x"', '"y"']),
    ({"type": "object", "required": ["k"], "properties": {"k": {"type": "integer"}},
      "enum": [{"k": 1}, {"j": 2}, {"k": "s"}]}, ['{"k":1}', '{"j":2}', '{"k":"s"}']),
])
def test_enum_and_const_keep_only_the_values_the_other_keywords_allow(schema, values):
    """enum / const beside other keywords: a value must meet them all (the enum used to be
    compiled alone, so `{"type": "string", "enum": ["a", 1]}` let the model write 1)."""
    g = compile_schema(schema)
    for text in values:
        valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        assert accepts(g, text) == valid, (schema, text)


def test_a_pydantic_model_class_as_the_schema_names_its_schema():
    """README: "a schema (pydantic's, or any dict)"; the model class itself was refused with
    only "Object of type ModelMetaclass is not JSON serializable"."""
    pydantic = pytest.importorskip("pydantic")

    class Pet(pydantic.BaseModel):
        name: str

    with pytest.raises(SchemaError, match=r"not JSON data: .*Model\.model_json_schema\(\)"):
        compile_schema(Pet)
    assert accepts(compile_schema(Pet.model_json_schema()), '{"name": "Ava"}')


@pytest.mark.parametrize("schema", [
    {"const": "x", "enum": ["y"]},
    {"type": "string", "enum": [1, 2]},
    {"enum": ["abc"], "maxLength": 2},
])
def test_enum_that_the_other_keywords_empty_is_refused(schema):
    with pytest.raises(SchemaError, match="enum / const"):
        compile_schema(schema)


@pytest.mark.parametrize("extra", [True, {"type": "string"}])
def test_open_object_refuses_an_escaped_spelling_of_a_declared_key(extra):
    """`"\\u0061"` is the key "a": written as another key it would repeat a declared property
    or give it a value of the wrong schema (json.loads keeps the last)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "additionalProperties": extra}
    g = compile_schema(schema)
    for text in ['{"a":1,"\\u0061":"x"}', '{"\\u0061":"x"}', '{"\\u0061":1}']:
        assert not accepts(g, text), text
    for text in ['{"a":1,"b":"x"}', '{"\\u0062":"x"}', '{"a\\"":"x"}', '{"ab":"x"}']:
        assert accepts(g, text), text
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))


@pytest.mark.parametrize("pattern", ["^$", "(?:)", "a{0}", "[^\\s\\S]", "[\\uD800-\\uDFFF]"])
def test_regex_without_a_nonempty_match_is_refused(pattern):
    """The output cannot be empty (EOS needs a complete match first): a regex that matches
    only empty text, or no text a JSON-encoded reply can hold, left every request stuck."""
    with pytest.raises(SchemaError):
        regex_grammar(pattern)


def test_regex_never_enters_a_branch_no_character_can_finish():
    g = regex_grammar("a[\\uD800-\\uDFFF]|ab")
    assert g.feed(g.start, b"a") is not None and accepts(g, "ab")
    g = regex_grammar("a(?:[^\\s\\S])|bc")
    assert g.feed(g.start, b"a") is None and accepts(g, "bc")


def test_regex_counts_are_ascii_digits_only():
    """`{²}` is no repeat count (ECMA-262 reads it as literal text); int('²') used to raise a
    bare ValueError out of the compiler."""
    g = regex_grammar("a{²}")
    assert accepts(g, "a{²}") and not accepts(g, "aa")
    compile_schema({"type": "string", "pattern": "^x{²}$"})


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + DEEP + "}}</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": "' + "[" * 100_000 + '"}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": ' + DEEP + "}}"),
    ("mistral", "[TOOL_CALLS]" + DEEP),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": ' + DEEP + "}"),
    ("pythonic", "[f(a=" + "-" * 200_000 + "1)]"),
    ("pythonic", "[f(a=" + "(" * 5_000 + "1" + ")" * 5_000 + ")]"),
])
def test_tool_parsers_answer_deeply_nested_replies_as_content(parser, text):
    """A reply nested past the decoder's recursion limit is not a call: plain content,
    never an exception out of the reply's shaping."""
    assert parse_tool_calls(parser, text) == (len(text), [])


@pytest.mark.parametrize("text", ["abc</think>answer", "<thi</think>x", "a\n</think>\n\nb"])
def test_qwen3_reply_that_does_not_open_with_think_is_all_answer(text):
    """qwen3 thinks only if the reply opens with <think> (as the grammar's ReasoningGate reads
    it); the whole reply split an unopened one at a later </think> while the stream had sent
    it as answer already, so the two disagreed."""
    assert split_reasoning("qwen3", text) == (None, text)
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 4)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream, got = ReasoningStream("qwen3"), ["", ""]
        for k, piece in enumerate(pieces):
            r, a = stream.feed(piece, final=k == len(pieces) - 1)
            got[0] += r
            got[1] += a
        assert got == ["", text], pieces


@pytest.mark.parametrize("text, calls", [
    ('{"name": "Bob", "age": 3}', []),  # a JSON answer, not a call to "Bob"
    ('{"name": "ping", "parameters": {}}', [("ping", "{}")]),
    ('{"name": "ping", "arguments": {"x": 1}}', [("ping", '{"x": 1}')]),
    ('<|python_tag|>{"name": "ping"}', [("ping", "{}")]),  # the tag says it is a call
])
def test_llama3_json_untagged_reply_needs_its_arguments_to_be_a_call(text, calls):
    end, got = parse_tool_calls("llama3_json", text)
    assert got == calls and end == (len(text) if not calls else 0)
