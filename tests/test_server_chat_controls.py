"""The chat route's reply shaping and template controls: `--reasoning-parser` splits a reply's
thinking into reasoning_content (streamed and not, with tool calls after it), and
chat_template_kwargs / add_generation_prompt / continue_final_message reach the chat template
as vLLM passes them. guided_choice makes the 2-layer random model write an exact reply."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import ThreadedServer, make_tiny_model

from kvcap import LLM
from kvcap.server.app import create_app

MSGS = [{"role": "user", "content": "Think, then answer."}]
TOOLS = [{"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def srv(default_model_dir, tmp_path_factory):
    tiny = make_tiny_model(default_model_dir, tmp_path_factory.mktemp("tiny") / "model",
                           max_position_embeddings=1024)
    llm = LLM(model=str(tiny), device="cpu", num_blocks=96, max_num_seqs=4)
    app = create_app(llm, served_model_name="tiny", reasoning_parser="qwen3",
                     tool_call_parser="hermes")
    with ThreadedServer(app) as server:
        server.llm, server.serving = llm, app.state.serving
        server.http = httpx.Client(base_url=server.url, timeout=120)
        server.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        yield server


def _ask(srv, reply: str, **kw):
    body = dict(model="tiny", messages=MSGS, max_tokens=120,
                extra_body={"guided_choice": [reply]}, **kw)
    whole = srv.client.chat.completions.create(**body).choices[0]
    events = [e.choices[0] for e in srv.client.chat.completions.create(**body, stream=True)
              if e.choices]
    return whole, events


def _joined(events, field: str) -> str:
    return "".join(getattr(e.delta, field, None) or (e.delta.model_extra or {}).get(field)
                   or "" for e in events)


@pytest.mark.parametrize("reply, thinking, answer", [
    ("<think>\nstep one\n</think>\n\nDone.", "\nstep one\n", "Done."),
    ("No thinking here.", None, "No thinking here."),
])
def test_reasoning_is_split_from_the_answer(srv, reply, thinking, answer):
    whole, events = _ask(srv, reply)
    assert whole.message.content == answer and whole.finish_reason == "stop"
    assert (whole.message.model_extra or {}).get("reasoning_content") == thinking
    assert _joined(events, "content") == answer
    assert (_joined(events, "reasoning_content") or None) == thinking


def test_tool_calls_after_thinking(srv):
    reply = '<think>need a ping</think>\n<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    whole, events = _ask(srv, reply, tools=TOOLS, tool_choice="auto")
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert whole.message.model_extra["reasoning_content"] == "need a ping"
    assert [c.function.name for c in whole.message.tool_calls] == ["ping"]
    assert _joined(events, "reasoning_content") == "need a ping"
    assert [t.function.name for e in events for t in e.delta.tool_calls or []] == ["ping"]
    assert events[-1].finish_reason == "tool_calls" and not _joined(events, "content")


def _rendered(srv, body) -> str:
    r = srv.http.post("/tokenize", json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return srv.llm.tokenizer.decode(r.json()["tokens"])


def test_template_controls_reach_the_template(srv):
    saved = srv.llm.tokenizer.chat_template
    # a template that shows its variables, on the engine's tokenizer and the server's copy
    template = ("{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
                "{% if add_generation_prompt %}[assistant:{% endif %}"
                "{% if mood is defined %}({{ mood }}){% endif %}")
    for t in _tokenizers(srv):
        t.chat_template = template
    try:
        assert _rendered(srv, {"messages": MSGS}) == "[user:Think, then answer.][assistant:"
        assert _rendered(srv, {"messages": MSGS, "add_generation_prompt": False,
                               "chat_template_kwargs": {"mood": "calm"}}) == \
            "[user:Think, then answer.](calm)"
        prefill = MSGS + [{"role": "assistant", "content": "Sure"}]
        text = _rendered(srv, {"messages": prefill, "add_generation_prompt": False,
                               "continue_final_message": True})
        assert text.endswith("[assistant:Sure") and not text.endswith("]")
        for body, message in [
            ({"messages": prefill, "continue_final_message": True},
             "needs add_generation_prompt: false"),
            ({"messages": MSGS, "add_generation_prompt": False,
              "continue_final_message": True}, "the last message must be the assistant's"),
            ({"messages": MSGS, "chat_template_kwargs": {"tokenize": False}},
             "set by the request itself"),
        ]:
            r = srv.http.post("/v1/chat/completions", json={"model": "tiny", **body})
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    finally:
        for t in _tokenizers(srv):
            t.chat_template = saved


def test_a_template_that_refuses_the_conversation_is_a_400(srv):
    """A template refuses what it does not take by raising (raise_exception, as real templates
    do for roles); its message, on one line, goes back as a 400 on `messages`."""
    saved = srv.llm.tokenizer.chat_template
    for t in _tokenizers(srv):
        t.chat_template = ("{% for m in messages %}{% if m.role == 'user' %}"
                           "{{ raise_exception('no users\nhere') }}{% endif %}{% endfor %}")
    try:
        r = srv.http.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"] == "messages: the chat template refused them: no users here"
        assert error["param"] == "messages"
    finally:
        for t in _tokenizers(srv):
            t.chat_template = saved


def _tokenizers(srv):
    """The engine's tokenizer and the server's own copy (create_app loads one for the event
    loop)."""
    return [srv.llm.tokenizer, srv.serving.tokenizer]


def test_structured_requests_think_first_with_a_reasoning_parser(srv, monkeypatch):
    """With --reasoning-parser, a structured chat request's format applies after the thinking
    (SamplingParams.reasoning); a plain one is left as it is."""
    seen = []
    real = srv.llm.engine.add_request

    def add_request(rid, ids, params, *a, **kw):
        seen.append(params)
        return real(rid, ids, params, *a, **kw)

    monkeypatch.setattr(srv.llm.engine, "add_request", add_request)
    _ask(srv, "yes")
    srv.client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)
    assert [p.reasoning for p in seen] == ["qwen3", "qwen3", None]
