"""Tool-call parsers (tool_choice "auto"): whole replies, replies that are not calls, and the
stream's hold-back point over every split of a reply."""

from __future__ import annotations

import json

import pytest

from kvcap.server.tool_parsers import parse_tool_calls, tool_call_start

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
LLAMA = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "ping", "parameters": {}}')
PYTHONIC = '<|python_start|>[get_weather(city="Paris"), ping()]<|python_end|>'
MISTRAL_LIST = ('Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "ping", "arguments": {}}]')
MISTRAL_ARGS = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]ping[ARGS]{}'
CALLS = [("get_weather", json.dumps({"city": "Paris"})), ("ping", "{}")]


@pytest.mark.parametrize("parser, text, content", [
    ("hermes", HERMES, "Let me look.\n"), ("llama3_json", LLAMA, ""),
    ("llama3_json", LLAMA.replace("<|python_tag|>", "  "), ""),
    ("pythonic", PYTHONIC, ""), ("pythonic", ' [get_weather(city="Paris"), ping()]', ""),
    ("mistral", MISTRAL_LIST, "Checking. "), ("mistral", MISTRAL_ARGS, ""),
    ("mistral", MISTRAL_ARGS.replace("[ARGS]", ""), ""),
])
def test_calls_are_parsed(parser, text, content):
    end, calls = parse_tool_calls(parser, text)
    assert text[:end] == content and calls == CALLS


def test_hermes_block_left_open_at_the_end_still_parses():
    end, calls = parse_tool_calls("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert end == 0 and calls == [("f", '{"a": 1}')]


@pytest.mark.parametrize("parser, text", [
    ("hermes", "No tools needed: 4."),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": </tool_call>'),  # broken JSON
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("llama3_json", "The answer is {1, 2}."),
    ("llama3_json", '{"name": "f", "parameters": [1]}'),  # arguments not an object
    ("llama3_json", '{"name": "f", "parameters": {}} and then text'),
    ("pythonic", "[1, 2, 3]"), ("pythonic", "[f(1)]"),  # a list, a positional argument
    ("pythonic", "[f(x=__import__('os').getcwd())]"),  # never evaluated: not a literal
    ("pythonic", "[f(x={1, 2})]"), ("pythonic", "[f(x=1e999)]"),  # a set, inf: not JSON
    ("pythonic", "[f(**kw)]"), ("pythonic", "[f(x=1)"), ("pythonic", "Call [f(x=1)] now"),
    ("mistral", "No calls here."), ("mistral", "[TOOL_CALLS]nothing"),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": [1]}]'),
])
def test_replies_that_are_not_calls_stay_content(parser, text):
    assert parse_tool_calls(parser, text) == (len(text), [])


@pytest.mark.parametrize("parser, text, start", [
    ("hermes", HERMES, HERMES.index("<tool_call>")), ("hermes", "plain", 5),
    ("hermes", "ends with <tool_", len("ends with ")), ("hermes", "a <b", 4),
    ("llama3_json", LLAMA, 0), ("llama3_json", "  {", 0), ("llama3_json", "", 0),
    ("llama3_json", "<|pyth", 0), ("llama3_json", "Sure: {", 7),
    ("pythonic", PYTHONIC, 0), ("pythonic", " [", 0), ("pythonic", "<|python_st", 0),
    ("pythonic", "Sure: [", 7), ("mistral", MISTRAL_LIST, MISTRAL_LIST.index("[TOOL_CALLS]")),
    ("mistral", "ok [TOOL_", 3),
])
def test_stream_holds_back_from_where_a_call_may_begin(parser, text, start):
    assert tool_call_start(parser, text) == start
    # as the reply grows the point only moves on, and never past where the call begins
    cuts = [tool_call_start(parser, text[:k]) for k in range(len(text) + 1)]
    assert cuts == sorted(cuts) and max(cuts) == start, cuts


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="unknown tool-call parser 'granite'"):
        parse_tool_calls("granite", "x")
