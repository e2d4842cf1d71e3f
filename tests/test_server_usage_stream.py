"""vLLM's `stream_options.continuous_usage_stats`: with `include_usage`, every streamed chunk
that carries a choice (chat's role chunk, text and tool-call deltas, completions' echo, the
finish chunk) also carries that choice's usage so far -- its prompt, the tokens generated up
to that chunk -- while the final usage-only chunk keeps the request's totals. Without it (or
with include_usage false, which vLLM needs for it too) chunks stay as they were: `usage: null`
but on the last. As in vLLM, include_usage defaults to true once stream_options is given.
In-process (FastAPI's TestClient) over a 2-layer random Llama with the real SmolLM2
tokenizer."""

from __future__ import annotations

import json

import pytest
from server_helpers import make_tiny_model, tiny_client

from kvcap import LLM

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Say hi"}]
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                   "required": ["unit"]}}}]


@pytest.fixture(scope="module")
def client(default_model_dir, tmp_path_factory):
    # a longer context than tiny_dir's 256: the tool-call prompt renders the tools' schema
    tiny = make_tiny_model(default_model_dir, tmp_path_factory.mktemp("tiny") / "model",
                           max_position_embeddings=1024)
    llm = LLM(model=str(tiny), device="cpu", num_blocks=96, max_num_seqs=4)
    with tiny_client(llm) as c:
        yield c


def _events(client, path: str, body: dict) -> list[dict]:
    """The SSE data payloads of a streamed request, [DONE] left out."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _body(path: str, **kw) -> dict:
    return {"model": "tiny", **({"messages": MSGS} if path == CHAT else {"prompt": "Say hi"}),
            **kw}


def _prompt_len(client, path: str) -> int:
    """The prompt's length as /tokenize counts it (chat: through the chat template)."""
    r = client.post("/tokenize", json={"messages": MSGS} if path == CHAT else
                    {"prompt": "Say hi"})
    return r.json()["count"]


def _check_continuous(events: list[dict], n: int, prompt_len: int) -> dict[int, int]:
    """Every chunk with a choice has that choice's usage so far; the last has the totals.
    Returns each choice's final completion_tokens."""
    *chunks, last = events
    seen: dict[int, int] = {}  # each choice's completion_tokens so far
    finals: dict[int, int] = {}  # ... on its finish chunk
    for ev in chunks:
        [choice] = ev["choices"]
        u, i = ev["usage"], choice["index"]
        assert u is not None, ev
        assert u["prompt_tokens"] == prompt_len, ev
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], ev
        assert i not in finals, f"choice {i} has a chunk after its finish: {ev}"
        assert u["completion_tokens"] >= seen.get(i, 0), ev  # never decreases
        seen[i] = u["completion_tokens"]
        if choice["finish_reason"] is not None:
            finals[i] = u["completion_tokens"]
    assert sorted(finals) == list(range(n))
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": prompt_len, "completion_tokens": sum(finals.values()),
        "total_tokens": prompt_len + sum(finals.values())}
    return finals


def _texts(events: list[dict], path: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for ev in events:
        for c in ev["choices"]:
            piece = c["text"] if path == CMPL else c["delta"].get("content") or ""
            out[c["index"]] = out.get(c["index"], "") + piece
    return out


@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("n", [1, 2])
def test_every_choice_chunk_carries_its_usage_so_far(client, path, n):
    body = _body(path, n=n, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    prompt_len = _prompt_len(client, path)
    events = _events(client, path, {**body, "stream_options": CONTINUOUS})
    # ignore_eos: each choice generates all 6 tokens, which its finish chunk counts
    assert _check_continuous(events, n, prompt_len) == dict.fromkeys(range(n), 6)
    if path == CHAT:  # the role chunks open the stream, before any token
        assert [(e["choices"][0]["index"], e["choices"][0]["delta"].get("role"),
                 e["usage"]["completion_tokens"]) for e in events[:n]] == \
            [(i, "assistant", 0) for i in range(n)]
    # include_usage defaults to true within stream_options (vLLM's StreamOptions): the
    # continuous stream without naming it
    implied = _events(client, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert _check_continuous(implied, n, prompt_len) == dict.fromkeys(range(n), 6)
    # without it -- and, as in vLLM, with it but with include_usage false -- the same stream
    # as before: usage null on every chunk but the last (and no usage at all with
    # include_usage false); an empty stream_options includes the totals
    for options, totals in [({"include_usage": True}, True), ({}, True),
                            ({"include_usage": False, "continuous_usage_stats": True}, False),
                            ({"include_usage": False}, False)]:
        plain = _events(client, path, {**body, "stream_options": options})
        assert _texts(plain, path) == _texts(events, path)
        chunks = plain[:-1] if totals else plain
        assert all(e["choices"] and "usage" in e and e["usage"] is None for e in chunks), options
        if totals:
            assert plain[-1]["choices"] == [] and \
                plain[-1]["usage"] == events[-1]["usage"]


def test_echo_chunk_counts_the_prompt_alone(client):
    prompt_len = _prompt_len(client, CMPL)
    for max_tokens in (4, 0):  # 0: the prompt's echo alone (scoring), nothing generated
        body = _body(CMPL, max_tokens=max_tokens, temperature=0, echo=True, ignore_eos=True,
                     stream_options=CONTINUOUS)
        events = _events(client, CMPL, body)
        assert events[0]["choices"][0]["text"] == "Say hi"
        assert events[0]["usage"]["completion_tokens"] == 0
        assert _check_continuous(events, 1, prompt_len) == {0: max_tokens}


def test_tool_call_deltas_carry_usage(client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": TOOLS, "max_tokens": 200, "seed": 1, "temperature": 1.0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = client.post("/tokenize", json={"messages": body["messages"], "tools": TOOLS})
    events = _events(client, CHAT, {**body, "stream_options": CONTINUOUS})
    finals = _check_continuous(events, 1, r.json()["count"])
    calls = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("tool_calls")]
    assert calls and all(e["usage"]["completion_tokens"] > 0 for e in calls)
    whole = client.post(CHAT, json=body).json()
    assert whole["choices"][0]["message"]["tool_calls"]
    assert finals == {0: whole["usage"]["completion_tokens"]}
