"""A forced tool call (tool_choice named or "required") cut short -- by max_tokens (finish
"length") or a stop string -- must read the same streamed and not. A named call cut by
max_tokens was streamed as `tool_calls` deltas (its partial arguments) but answered whole as
plain `content`: a client saw a call or text depending on `stream`. As OpenAI (a truncated
forced function call is a tool call with the truncated arguments, finish_reason "length")
and vLLM (a named choice's output is always the call's arguments) answer, both are now the
call. "required" output (a JSON array of {"name", "parameters"}) held back in streaming
cannot name its calls until it parses: cut short it is content, streamed and not."""

from __future__ import annotations

import random

import openai
import pytest
from server_helpers import tiny_client
from test_tools_hunt import join_choice_stream

from kvcap import LLM
from kvcap.server.chat_reply import ChoiceStream, chat_message
from kvcap.server.tools import ToolPlan, plan_tools

WEATHER = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer"}},
           "required": ["unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_dir):
    llm = LLM(model=str(tiny_dir), device="cpu", num_blocks=32, max_num_seqs=4)
    with tiny_client(llm) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                            max_retries=0)


def _whole_reply(client, kw):
    c = client.chat.completions.create(**kw).choices[0]
    return (c.message.content or "",
            [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
            c.finish_reason)


def _streamed_reply(client, kw):
    content, calls, ids, finish = "", {}, set(), None
    for ev in client.chat.completions.create(**kw, stream=True):
        if not ev.choices:
            continue
        d = ev.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            if t.id is not None:
                assert t.id not in ids and t.type == "function"
                ids.add(t.id)
            c = calls.setdefault(t.index, ["", ""])
            c[0] += t.function.name or ""
            c[1] += t.function.arguments or ""
        finish = ev.choices[0].finish_reason or finish
    assert len(ids) == len(calls)  # each call opens with its id
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("max_tokens", [1, 4, 12])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_named_call_cut_by_max_tokens_is_a_tool_call_streamed_and_not(client, seed,
                                                                      max_tokens):
    """The random model writes whitespace then JSON: a few tokens in it is cut mid-arguments
    (or before the JSON began). Before: non-streamed content '\\n\\n{"unit":\\n ', streamed
    a get_weather call with arguments '{"unit":' (and whitespace alone: content vs nothing)."""
    kw = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=NAMED, seed=seed,
              max_tokens=max_tokens, temperature=1.0)
    whole = _whole_reply(client, kw)
    assert _streamed_reply(client, kw) == whole
    content, calls, finish = whole
    assert finish == "length" and content == ""
    # a call once any of the arguments was written: the truncated text, edges stripped
    assert all(name == "get_weather" and args and args == args.strip()
               for name, args in calls) and len(calls) <= 1


@pytest.mark.parametrize("max_tokens", [1, 4, 12])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_required_calls_cut_by_max_tokens_read_the_same_streamed_and_not(client, seed,
                                                                         max_tokens):
    kw = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", seed=seed,
              max_tokens=max_tokens, temperature=1.0)
    whole = _whole_reply(client, kw)
    assert _streamed_reply(client, kw) == whole
    assert whole[2] == "length" and whole[1] == []  # the cut array stays text


def test_named_call_reaches_length_in_some_case(client):
    # the cases above are not all whitespace: at least one cut call exists
    kw = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=NAMED, seed=2,
              max_tokens=12, temperature=1.0)
    _, calls, finish = _whole_reply(client, kw)
    assert finish == "length" and calls and calls[0][1].startswith("{")


@pytest.mark.parametrize("choice", [NAMED, "required"])
@pytest.mark.parametrize("seed", [0, 1])
def test_forced_calls_cut_by_a_stop_string_read_the_same_streamed_and_not(client, seed,
                                                                          choice):
    """A stop string inside the JSON ends it with finish "stop", unparsed: a named call was
    streamed as the call but answered whole as content (as at "length")."""
    kw = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice, seed=seed,
              max_tokens=60, temperature=1.0, stop=[":"])
    whole = _whole_reply(client, kw)
    assert _streamed_reply(client, kw) == whole
    content, calls, finish = whole
    assert finish == "stop"
    if choice == NAMED:
        assert content == "" and [n for n, _ in calls] == ["get_weather"]
    else:
        assert calls == [] and content.strip().startswith("[")


# --- the reply shaping alone: any split of a cut output joins to the whole reply ------------

def _plan(mode):
    return plan_tools(TOOLS, NAMED if mode == "named" else mode, parallel=True)


def _whole(plan, text, finish, rp):
    m = chat_message(text, finish, plan, None, rp)
    msg = m["message"]
    return (msg.content or "", msg.reasoning_content or "",
            [(c["function"]["name"], c["function"]["arguments"]) for c in msg.tool_calls],
            m["finish_reason"])


def _streamed(plan, pieces, finish, rp):
    return join_choice_stream(ChoiceStream(plan, None, rp), pieces, finish)


CUT = [
    # (mode, reasoning parser, output, finish, the whole reply's calls)
    ("named", None, ' \n{"unit": "c", "da', "length", [("get_weather", '{"unit": "c", "da')]),
    ("named", None, '\n\t {"unit"  \n', "length", [("get_weather", '{"unit"')]),
    ("named", None, " \n\t ", "length", []),  # cut before the arguments began
    ("named", None, "", "length", []),
    # a stop string hit inside the arguments: finish "stop", the JSON does not parse
    ("named", None, '{"unit": "c", "days": 1', "stop",
     [("get_weather", '{"unit": "c", "days": 1')]),
    ("named", "qwen3", "<think>\nweather? ", "length", []),  # cut while thinking
    ("named", "qwen3", '<think>ok</think>\n\n{"unit": "f"', "length",
     [("get_weather", '{"unit": "f"')]),
    ("required", None, ' [{"name": "get_weather", "parameters": {"unit": ', "length", []),
    ("required", None, '[{"name": "ping", "parameters": {}}, {"na', "length", []),
    ("required", None, "  ", "length", []),
    ("required", "qwen3", '<think>x</think>[{"name": "pi', "length", []),
]


@pytest.mark.parametrize("mode, rp, text, finish, want", CUT)
def test_cut_forced_calls_stream_at_any_split_as_the_whole_reply(mode, rp, text, finish, want):
    plan: ToolPlan = _plan(mode)
    whole = _whole(plan, text, finish, rp)
    assert whole[2] == want and whole[3] == finish
    if mode == "named":
        assert whole[0] == ""  # the arguments, or nothing: never content
    rng = random.Random(text)
    splits = [[]] + [[k] for k in range(1, len(text))] + [
        sorted(rng.sample(range(1, len(text)), rng.randint(1, min(6, len(text) - 1))))
        for _ in range(60) if len(text) > 1]
    for cuts in splits:
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _streamed(plan, pieces, finish, rp) == whole, pieces
