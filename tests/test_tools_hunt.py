"""Tool-call and reasoning output of real models that the parsers mis-read (as compared with
what vLLM's parsers of the same names answer), and a stream property: a reply split at any
points gives, joined, what the whole reply gives (content, reasoning, calls, finish)."""

from __future__ import annotations

import json
import random

import pytest
from fastapi.responses import JSONResponse

from kvcap.server import protocol as P
from kvcap.server.chat_reply import ChoiceStream, chat_message
from kvcap.server.serving import sse
from kvcap.server.tool_parsers import parse_tool_calls
from kvcap.server.tools import ToolPlan


def test_mistral_v11_call_id_is_not_part_of_the_name():
    # mistral-common's v11 tokenizer (Mistral Small 3.1 / 3.2, Devstral, Magistral) writes
    # `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` where the conversation's calls carry ids: the
    # name is the function's alone (it was "get_weather[CALL_ID]a1B2c3D4e")
    text = ('Checking.[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}'
            '[TOOL_CALLS]ping[CALL_ID]Zz9Yy8Xx7[ARGS]{}')
    end, calls = parse_tool_calls("mistral", text)
    assert text[:end] == "Checking."
    assert calls == [("get_weather", '{"city": "Paris"}'), ("ping", "{}")]


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n'
               '</tool_call>'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "parameters": {"city": "Paris"}}]'),
])
def test_arguments_written_as_parameters_are_not_dropped(parser, text):
    # a model that names them "parameters" (the key of the tools' schema in the prompt) got a
    # call with {} arguments: what it asked for was silently lost
    end, calls = parse_tool_calls(parser, text)
    assert end == 0 and calls == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>'),  # inf
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": -Infinity}"}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"x": Infinity}}'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 2e400}'),
])
def test_arguments_are_always_json(parser, text):
    # Python's decoder takes NaN / Infinity / an overflowing number; written back they were
    # `NaN` / `Infinity`, which no JSON parser reads: such a reply is content (as pythonic's)
    end, calls = parse_tool_calls(parser, text)
    for _, args in calls:
        json.loads(args, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert (end, calls) == (len(text), [])


@pytest.mark.parametrize("parser, text, args", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"s": "\\ud83d"}}</tool_call>',
     {"s": "\ud83d"}),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"\\udc00": 1}}</tool_call>',
     {"\udc00": 1}),
    ("llama3_json", '{"name": "f", "parameters": {"s": "a\\ud83d"}}', {"s": "a\ud83d"}),
    ("pythonic", '[f(s="\\ud83d")]', {"s": "\ud83d"}),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"s": "\\ud83d"}', {"s": "\ud83d"}),
])
def test_a_lone_surrogate_escape_is_sent_not_a_500(parser, text, args):
    # a model that writes JSON escaped as ASCII (\ud83d\ude00 for an emoji) may write half a
    # pair: the arguments then held a lone surrogate that UTF-8 cannot encode, and the reply
    # failed to serialize (500 / a broken stream); the escape stays as written
    end, calls = parse_tool_calls(parser, text)
    [(name, got)] = calls
    assert name == "f" and json.loads(got) == args
    got.encode("utf-8")
    reply = chat_message(text, "stop", ToolPlan("auto", []), parser, None)
    JSONResponse(reply["message"].model_dump()).body.decode()
    sse(reply["message"])


def test_a_lone_surrogate_in_the_name_is_content():
    text = '<tool_call>{"name": "f\\ud800", "arguments": {}}</tool_call>'
    assert parse_tool_calls("hermes", text) == (len(text), [])


# --- streaming: any split joins to the whole reply ------------------------------------------

def _whole(text, finish, tp, rp):
    m = chat_message(text, finish, ToolPlan("auto", []) if tp else None, tp, rp)
    msg = m["message"]
    return ((msg.content or "").strip(), msg.reasoning_content or "",
            [(c["function"]["name"], c["function"]["arguments"]) for c in msg.tool_calls],
            m["finish_reason"])


def _streamed(pieces, finish, tp, rp):
    content, reasoning, calls, fin = join_choice_stream(
        ChoiceStream(ToolPlan("auto", []) if tp else None, tp, rp), pieces, finish)
    return content.strip(), reasoning, calls, fin


def join_choice_stream(s, pieces, finish):
    """(content, reasoning, [(name, arguments)], finish_reason) that a client joins from a
    ChoiceStream fed `pieces`, the last with `finish`; each call's id comes once."""
    content, reasoning, calls, ids, fin = "", "", {}, set(), None
    for k, piece in enumerate(pieces):
        d, f, _ = s.event(piece, finish if k == len(pieces) - 1 else None, (0, 0))
        if d is None:
            continue
        content += d.get("content") or ""
        reasoning += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["id"] not in ids and tc["type"] == "function"
                ids.add(tc["id"])
            c = calls.setdefault(tc["index"], ["", ""])
            c[0] += tc["function"].get("name") or ""
            c[1] += tc["function"].get("arguments") or ""
        fin = f if f is not None else fin
    assert len(ids) == len(calls)
    return content, reasoning, [tuple(calls[i]) for i in sorted(calls)], fin


HERMES = ('<tool_call>\n{"name": "f", "arguments": {"x": "a{b}\\"c</tool", "é": [1, {"n": null}]}}'
          '\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
STREAMS = [
    ("hermes", None, "Sure.\n" + HERMES, "stop"),
    ("hermes", "qwen3", "<think>\nI should call f. a < b </thi\n</think>\n\n" + HERMES, "stop"),
    ("hermes", "qwen3", "<think>\nstill thinking <tool_call>", "length"),
    ("hermes", "deepseek_r1", "call f.</think>\n\n" + HERMES, "stop"),
    ("hermes", None, 'Sure.\n<tool_call>\n{"name": "f", "argu', "length"),
    ("llama3_json", None, '<|python_tag|>{"name": "f", "parameters": {"x": "}{"}}; '
                          '{"name": "g", "parameters": {}}', "stop"),
    ("llama3_json", "qwen3", '<think>hmm</think>\n{"name": "f", "parameters": {"x": 1}}', "stop"),
    ("llama3_json", None, "The set {1, 2}", "stop"),
    ("pythonic", None, '[f(a=[1, -2.5], b={"k": None}, c=True, d=False), g()]', "stop"),
    ("pythonic", "deepseek_r1", "think</think>[f(a=-1)", "stop"),
    ("mistral", None, 'Hi [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}, "id": "a1B2c3D4e"}]',
     "stop"),
    ("mistral", None, 'Hi [TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{"x": 1}[TOOL_CALLS]g{}', "stop"),
    ("mistral", "qwen3", '<think>x</think>[TOOL_CALLS]f[ARGS]{"x": ', "stop"),
]


@pytest.mark.parametrize("tp, rp, text, finish", STREAMS)
def test_stream_at_any_split_joins_to_the_whole_reply(tp, rp, text, finish):
    whole = _whole(text, finish, tp, rp)
    assert (whole[3] == "tool_calls") == bool(whole[2])
    rng = random.Random(text)
    splits = [[k] for k in range(1, len(text))] + [
        sorted(rng.sample(range(1, len(text)), rng.randint(1, 8))) for _ in range(100)]
    for cuts in splits:
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _streamed(pieces, finish, tp, rp) == whole, pieces


def test_reply_message_serializes():
    # the protocol object the route sends for every case above
    for tp, rp, text, finish in STREAMS:
        msg = chat_message(text, finish, ToolPlan("auto", []), tp, rp)["message"]
        assert isinstance(msg, P.ChatResponseMessage)
        sse(msg)
