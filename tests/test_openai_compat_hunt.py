"""What the official `openai` client (its helpers included) and common tools expect of the
server, each once answered wrongly. In-process: the `openai` client over FastAPI's TestClient
(an httpx.Client) against a 2-layer random Llama with the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pydantic
import pytest
from fastapi.testclient import TestClient
from server_helpers import tiny_client

from kvcap import LLM
from kvcap.server.app import create_app

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def http(tiny_dir):
    llm = LLM(model=str(tiny_dir), device="cpu", num_blocks=32, max_num_seqs=4)
    with tiny_client(llm) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0)


# ----------------------------------------------------------------------------- named tool
class GetWeather(pydantic.BaseModel):
    unit: Literal["c", "f"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_named_tool_arguments_work_with_the_sdk_stream_helper(client, seed):
    """A named function's arguments were streamed as the model wrote them, whitespace before
    the JSON included (the grammar allows it; the random model writes plenty), while the
    non-streamed reply strips it. The SDK's stream helper partially parses the arguments of a
    strict tool (`openai.pydantic_function_tool`) after every delta, and a whitespace-only
    snapshot raised `ValueError: EOF while parsing a value` out of the stream."""
    tool = openai.pydantic_function_tool(GetWeather)
    kw = dict(model="tiny", messages=MSGS, tools=[tool], max_tokens=60, seed=seed,
              temperature=1.0, tool_choice={"type": "function",
                                            "function": {"name": "GetWeather"}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop", whole
    [call] = whole.message.tool_calls
    pieces = [tc.function.arguments or "" for ev in client.chat.completions.create(
        **kw, stream=True) if ev.choices for tc in ev.choices[0].delta.tool_calls or []]
    assert "".join(pieces) == call.function.arguments  # the same text, streamed or not
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    [got] = final.choices[0].message.tool_calls
    assert got.function.parsed_arguments == GetWeather(**json.loads(call.function.arguments))


# ----------------------------------------------------------------------------- auto tools
PING = [{"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}}}}]
TWO_CALLS = ('<tool_call>{"name": "ping", "arguments": {"n": 1}}</tool_call>'
             '<tool_call>{"name": "ping", "arguments": {"n": 2}}</tool_call>')


@pytest.fixture(scope="module")
def hermes(tiny_dir):
    llm = LLM(model=str(tiny_dir), device="cpu", num_blocks=32, max_num_seqs=4)
    app = create_app(llm, served_model_name="tiny", max_pending=8, poll_s=0.2,
                     tool_call_parser="hermes")
    with TestClient(app, raise_server_exceptions=False) as c:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c,
                            max_retries=0)


@pytest.mark.parametrize("parallel", [False, True])
def test_auto_tool_calls_honour_parallel_tool_calls(hermes, parallel):
    """tool_choice "auto" with parallel_tool_calls: false answered every call the model
    wrote (the flag was read for "required" only): LangGraph-style agents that ask for one
    call per turn got two. As vLLM does, the calls after the first are dropped, streamed and
    not; with parallel_tool_calls true (the default) every call is kept."""
    kw = dict(model="tiny", messages=MSGS, tools=PING, max_tokens=100,
              parallel_tool_calls=parallel, extra_body={"guided_choice": [TWO_CALLS]})
    want = [{"n": 1}, {"n": 2}] if parallel else [{"n": 1}]
    c = hermes.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls"
    assert [json.loads(t.function.arguments) for t in c.message.tool_calls] == want
    streamed = [t for ev in hermes.chat.completions.create(**kw, stream=True) if ev.choices
                for t in ev.choices[0].delta.tool_calls or []]
    assert [(t.index, json.loads(t.function.arguments)) for t in streamed] == \
        list(enumerate(want))


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_a_named_calls_last_event_text_is_streamed_with_its_finish(finish):
    """The event that finishes a named call may carry text (the closing brace, or what the
    length cut left): its finish returned an empty delta and that text never went out."""
    from kvcap.server.tools import ToolPlan, ToolStream

    stream = ToolStream(ToolPlan("named", [], name="f", schema={"type": "object"}))
    first, _ = stream.event(' {"a": 1', None)
    last, reason = stream.event("}\n", finish)
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in (first, last))
    assert args == '{"a": 1}'
    assert reason == ("length" if finish == "length" else stream.plan.finish_reason)
