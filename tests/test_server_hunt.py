"""Behaviours an OpenAI client meets on the server, each once answered wrongly: fields the
OpenAI API declares nullable sent as null, request values the engine refuses (a 400 naming the
field, before any stream opens, never a 500), ... In-process (FastAPI's TestClient) over a
2-layer random Llama with the real SmolLM2 tokenizer."""

from __future__ import annotations

import json

import pytest
from server_helpers import tiny_client

from kvcap import LLM

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def client(tiny_dir):
    llm = LLM(model=str(tiny_dir), device="cpu", num_blocks=32, max_num_seqs=4)
    with tiny_client(llm) as c:
        yield c


def _events(client, path: str, body: dict) -> tuple[int, list]:
    """(status, the SSE data payloads) of a streamed request."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    return 200, [d if d == "[DONE]" else json.loads(d) for d in data]


# ----------------------------------------------------------------------------- null fields
# The OpenAI API reference declares these "or null" (and vLLM's schemas Optional): clients
# that spell out every field (LangChain, SDKs built from the spec) send null for "the default".
@pytest.mark.parametrize("path, extra", [
    (CHAT, {"logprobs": None}),
    (CHAT, {"n": None}),
    (CHAT, {"stream": None}),
    (CHAT, {"parallel_tool_calls": None}),
    (CMPL, {"echo": None}),
    (CMPL, {"n": None}),
    (CMPL, {"stream": None}),
    (CMPL, {"stream_options": None}),
])
def test_null_means_the_default(client, path, extra):
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, **extra}
    body.update({"messages": MSGS} if path == CHAT else {"prompt": "Say hi"})
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 1 and choices[0]["logprobs"] is None


# ----------------------------------------------------------------------------- stop_token_ids
@pytest.mark.parametrize("ids", [[-5], [49152], [7, 10**9]])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_stop_token_ids_are_a_400_naming_the_field(client, ids, stream):
    """A negative id was a 500 ("internal error: invalid SamplingParams ..."); one past the
    vocabulary was refused by the engine only after the stream had opened (HTTP 200, then
    an error event without a param)."""
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "stop_token_ids": ids}
    status, events = _events(client, CMPL, body) if stream else \
        (lambda r: (r.status_code, [r.json()]))(client.post(CMPL, json=body))
    assert status == 400, events
    err = events[0]["error"]
    assert err["param"] == "stop_token_ids" and err["type"] == "invalid_request_error", err
    assert err["message"].startswith("stop_token_ids: "), err


# ----------------------------------------------------------------- max_completion_tokens
@pytest.mark.parametrize("value, message", [
    (0, "max_completion_tokens: must be at least 1, got 0"),
    (1000, "max_completion_tokens: "),  # past the context of 256
])
def test_max_completion_tokens_errors_name_it(client, value, message):
    """OpenAI's current name for chat's limit (LangChain sends it for max_tokens): its errors
    named max_tokens, a field the request did not have."""
    r = client.post(CHAT, json={"model": "tiny", "messages": MSGS,
                                "max_completion_tokens": value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_completion_tokens" and err["message"].startswith(message), err
    r = client.post(CHAT, json={"model": "tiny", "messages": MSGS, "max_tokens": value})
    assert r.json()["error"]["param"] == "max_tokens"


# ----------------------------------------------------------------------------- legacy functions
@pytest.mark.parametrize("extra, param", [
    ({"functions": [{"name": "get_weather", "parameters": {"type": "object"}}]}, "functions"),
    ({"functions": [{"name": "get_weather"}], "function_call": "auto"}, "functions"),
    ({"function_call": {"name": "get_weather"}}, "function_call"),
])
def test_legacy_function_calling_is_refused_not_ignored(client, extra, param):
    """OpenAI's deprecated `functions` / `function_call` (older SDK code, LangChain's
    bind_functions) were dropped as unknown fields: the reply was text, the functions silently
    ignored -- what the server refuses for tools without a parser."""
    r = client.post(CHAT, json={"model": "tiny", "messages": MSGS, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "unsupported_parameter", err
    assert "send tools" in err["message"], err


# ----------------------------------------------------------------------------- malformed tools
F = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize("extra, message", [
    ({"tools": [F], "tool_choice": {"type": "function", "function": "f"}},
     "tool_choice: must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": 5}}}], "tool_choice": "required"},
     "tools[0].function.parameters: $defs must be an object"),
])
def test_malformed_tools_are_a_400_not_a_500(client, extra, message):
    """A function given as a string in tool_choice, a tool's $defs that is no object: each
    was a 500 ("internal error: 'str' object has no attribute 'get'")."""
    r = client.post(CHAT, json={"model": "tiny", "messages": MSGS, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(message), r.json()


# ----------------------------------------------------------------------------- guided_choice
@pytest.mark.parametrize("extra, param", [
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs"),
])
def test_a_choice_given_as_one_string_is_refused(client, extra, param):
    """guided_choice: "yes" was read as the choices "y", "e" and "s": the reply was one
    letter, with a 200."""
    r = client.post(CMPL, json={"model": "tiny", "prompt": "Hi", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "must be a list of strings" in err["message"], err


@pytest.mark.parametrize("path, body, param", [
    (CMPL, {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"messages": MSGS, "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"messages": MSGS, "structured_outputs": {"json_object": "yes"}},
     "structured_outputs"),
])
def test_switches_that_mean_nothing_are_refused(client, path, body, param):
    """stream_options without stream: true was accepted and ignored (OpenAI and vLLM answer
    400); structured_outputs' json_object "yes" was read as true (a 500 since SamplingParams
    refuses a non-bool)."""
    r = client.post(path, json={"model": "tiny", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_takes_null_as_the_default(client):
    """/tokenize refused add_generation_prompt: null (400, not a valid boolean) where the chat
    route takes null as the default; now the same ids as without the field."""
    body = {"model": "tiny", "messages": MSGS}
    plain = client.post("/tokenize", json=body)
    nulls = client.post("/tokenize", json={**body, "add_generation_prompt": None,
                                          "continue_final_message": None})
    assert plain.status_code == nulls.status_code == 200, nulls.text
    assert nulls.json()["tokens"] == plain.json()["tokens"]
