"""Tool calling on the chat route (kvcap/server/tools.py): a named function and
tool_choice "required" give tool calls whose arguments validate under the tools' schemas
(jsonschema), streamed calls join to the same calls, multi-turn tool messages reach the chat
template, and every bad tools / tool_choice value is a 400 naming its field. A 2-layer random
Llama with the real SmolLM2 tokenizer: its text is noise, so only the format is checked."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest
from server_helpers import ThreadedServer, make_tiny_model

from kvcap import LLM
from kvcap.sampling.json_schema import compile_schema
from kvcap.server import protocol as P
from kvcap.server.app import create_app
from kvcap.server.tools import calls_schema

CHAT = "/v1/chat/completions"
WEATHER = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer"}},
           "required": ["unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]  # no parameters: {}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(default_model_dir, tmp_path_factory):
    tiny = make_tiny_model(default_model_dir, tmp_path_factory.mktemp("tiny") / "model",
                           max_position_embeddings=1024)
    llm = LLM(model=str(tiny), device="cpu", num_blocks=96, max_num_seqs=4)
    with ThreadedServer(create_app(llm, served_model_name="tiny")) as server:
        server.http = httpx.Client(base_url=server.url, timeout=120)
        server.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        yield server


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "mistral", "pythonic"])
def auto_srv(default_model_dir, tmp_path_factory, request):
    tiny = make_tiny_model(default_model_dir, tmp_path_factory.mktemp("tiny") / "model",
                           max_position_embeddings=1024)
    llm = LLM(model=str(tiny), device="cpu", num_blocks=96, max_num_seqs=4)
    app = create_app(llm, served_model_name="tiny", tool_call_parser=request.param)
    with ThreadedServer(app) as server:
        server.parser = request.param
        server.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        yield server


def _check(call, schemas) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_named_function_call(srv):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = srv.client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS,
                                           tool_choice=choice, max_tokens=200, seed=1,
                                           temperature=1.0)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None  # as OpenAI, named: stop
    [call] = c.message.tool_calls
    assert call.function.name == "get_weather"
    _check(call, {"get_weather": WEATHER})
    # streamed: the first delta names the call, the argument pieces join to the same text
    pieces, names, finish = [], [], None
    for ev in srv.client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS,
                                                 tool_choice=choice, max_tokens=200, seed=1,
                                                 temperature=1.0, stream=True):
        d = ev.choices[0].delta
        for tc in d.tool_calls or []:
            assert tc.index == 0
            names.append(tc.function.name)
            pieces.append(tc.function.arguments or "")
        finish = ev.choices[0].finish_reason or finish
    assert names[0] == "get_weather" and set(names[1:]) <= {None}
    assert "".join(pieces).strip() == call.function.arguments and finish == "stop"


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_calls(srv, parallel):
    schemas = {"get_weather": WEATHER, "ping": {}}
    kw = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
              max_tokens=400, seed=2, temperature=1.0, parallel_tool_calls=parallel)
    r = srv.client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert 1 <= len(c.message.tool_calls) and (parallel or len(c.message.tool_calls) == 1)
    for call in c.message.tool_calls:
        _check(call, schemas)
    streamed = [tc for ev in srv.client.chat.completions.create(**kw, stream=True)
                for tc in (ev.choices[0].delta.tool_calls or []) if ev.choices]
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == \
        [(k, t.function.name, t.function.arguments) for k, t in enumerate(c.message.tool_calls)]


def test_none_is_text_and_tool_turns_reach_the_template(srv):
    r = srv.client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS,
                                           tool_choice="none", max_tokens=5, seed=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    turns = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    body = {"model": "tiny", "messages": turns, "tools": TOOLS}
    tok = srv.http.post("/tokenize", json=body)
    assert tok.status_code == 200 and tok.json()["count"] > 0, tok.text
    conv = P.conversation([P.ChatMessage.model_validate(m) for m in turns])
    assert conv[1]["tool_calls"][0]["function"]["arguments"] == {"unit": "c"}  # a dict
    assert conv[2] == {"role": "tool", "content": "21 degrees", "tool_call_id": "call_1"}
    r = srv.http.post(CHAT, json={**body, "tool_choice": "none", "max_tokens": 3})
    assert r.status_code == 200, r.text


REPLIES = {
    "hermes": ("Let me look.\n", '<tool_call>\n{"name": "get_weather", "arguments": '
               '{"unit": "c"}}\n</tool_call>\n<tool_call>{"name": "ping", "arguments": {}}'
               '</tool_call>'),
    "llama3_json": ("", '<|python_tag|>{"name": "get_weather", "parameters": {"unit": "c"}}; '
                    '{"name": "ping", "parameters": {}}'),
    "mistral": ("Let me look. ", '[TOOL_CALLS][{"name": "get_weather", "arguments": '
                '{"unit": "c"}}, {"name": "ping", "arguments": {}}]'),
    "pythonic": ("", '[get_weather(unit="c"), ping()]'),
}


@pytest.mark.parametrize("calls", [True, False])
def test_auto_tool_calls_are_parsed_from_the_reply(auto_srv, calls):
    """tool_choice auto with --tool-call-parser: guided_choice makes the random model write
    exactly a reply in the family's syntax; the server returns its calls (or, for a reply
    without any, its text), streamed and not."""
    content, tail = REPLIES[auto_srv.parser]
    reply = content + tail if calls else "Just text, no <tool"
    kw = dict(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=200,
              extra_body={"guided_choice": [reply]})
    c = auto_srv.client.chat.completions.create(**kw).choices[0]
    events = [ev.choices[0] for ev in auto_srv.client.chat.completions.create(**kw, stream=True)
              if ev.choices]
    streamed_text = "".join(e.delta.content or "" for e in events)
    streamed_calls = [t for e in events for t in e.delta.tool_calls or []]
    if not calls:
        assert c.message.content == reply and not c.message.tool_calls
        assert c.finish_reason == "stop" and streamed_text == reply
        return
    assert c.finish_reason == "tool_calls" == events[-1].finish_reason
    assert (c.message.content or "") == content.strip() and streamed_text == content
    got = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
    assert got == [("get_weather", {"unit": "c"}), ("ping", {})]
    assert [(t.index, t.function.name, json.loads(t.function.arguments))
            for t in streamed_calls] == [(k, *g) for k, g in enumerate(got)]
    # nothing of the call was sent as content before the finish
    assert all(not e.delta.content or e.delta.content in content for e in events)


@pytest.mark.parametrize("extra, message", [
    ({"tools": TOOLS}, "tool_choice: 'auto' (the default with tools)"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "needs the server started with --tool-call-parser"),
    ({"tool_choice": "required"}, "tool_choice: needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "no tool named 'nope'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice: must be"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"},
     "tools[0].function.name"),
    ({"tools": [TOOLS[1], TOOLS[1]], "tool_choice": "none"}, "'ping' is given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string", "format": "idn-hostname"}}}], "tool_choice": "none"},
     "tools[0].function.parameters: schema.format: 'idn-hostname' is not supported"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "give one structured output format"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{oops"}}]}], "tools": TOOLS,
      "tool_choice": "none"}, "messages[0].tool_calls[0].function.arguments: not valid JSON"),
])
def test_tool_errors_name_their_field(srv, extra, message):
    r = srv.http.post(CHAT, json={"model": "tiny", "messages": MSGS, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"], r.json()


class Address(pydantic.BaseModel):
    city: str


class Person(pydantic.BaseModel):
    name: str
    home: Address


class Company(pydantic.BaseModel):
    boss: Person
    offices: list[Address]


def test_calls_schema_keeps_each_tools_references_apart():
    """Two pydantic schemas, each with its own $defs named alike: nested in one array, each
    tool's references still resolve to its own definitions."""
    params = {"person": Person.model_json_schema(), "company": Company.model_json_schema()}
    schema = calls_schema(params, parallel=True)
    g = compile_schema(schema)
    doc = [{"name": "company", "parameters": {"boss": {"name": "A", "home": {"city": "B"}},
                                              "offices": [{"city": "C"}]}},
           {"parameters": {"name": "D", "home": {"city": "E"}}, "name": "person"}]
    jsonschema.validate(doc, schema)
    assert g.complete(g.feed(g.start, json.dumps(doc).encode()))
    bad = [{"name": "person", "parameters": {"boss": {"name": "A"}}}]
    assert g.feed(g.start, json.dumps(bad).encode()) is None
