"""Server bugs found by a third hunt over kvcap/server/, each once answered wrongly. In-process:
FastAPI's TestClient over a 2-layer random Llama with the real SmolLM2 tokenizer and a chat
template that renders each turn's `name`."""

from __future__ import annotations

import pytest
from server_helpers import tiny_client

from kvcap import LLM
from kvcap.models.text_prompt import chat_messages

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Say hi"}]
# renders every turn's name, as templates of models trained on named participants do
NAMED_TEMPLATE = ("{% for m in messages %}[{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}]"
                  " {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]"
                  "{% endif %}")


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir), device="cpu", num_blocks=32, max_num_seqs=4,
               chat_template=NAMED_TEMPLATE)


@pytest.fixture(scope="module")
def client(llm):
    with tiny_client(llm) as c:
        yield c


# ----------------------------------------------------------------------------- guided_regex
@pytest.mark.parametrize("route, body", [
    (CMPL, {"prompt": "hi", "guided_regex": ["a"]}),
    (CHAT, {"messages": MSGS, "guided_regex": {"pattern": "a+"}}),
    (CHAT, {"messages": MSGS, "structured_outputs": {"regex": ["a", "b"]}}),
])
def test_a_regex_that_is_not_a_string_is_a_400_not_a_500(client, route, body):
    """The regex's compile cache hashed a list or an object before its type was checked:
    "internal error: unhashable type: 'list'", a 500 and a traceback in the log."""
    r = client.post(route, json={"model": "tiny", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] in ("guided_regex", "structured_outputs"), err
    assert "the regex must be a non-empty string" in err["message"], err


# ----------------------------------------------------------------------------- names
def test_a_users_name_reaches_the_chat_template(client, llm):
    """OpenAI's `name` of a participant reached the template on tool turns only: a user's or
    system's name was dropped, so the server rendered another prompt than LLM.chat (and
    vLLM) render for the same messages."""
    msgs = [{"role": "system", "content": "Be brief", "name": "rules"},
            {"role": "user", "content": "Say hi", "name": "bob"}]
    r = client.post("/tokenize", json={"model": "tiny", "messages": msgs})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == llm.apply_chat_template(chat_messages(msgs))
    assert "[user bob] Say hi" in llm.tokenizer.decode(r.json()["tokens"])
    r = client.post(CHAT, json={"model": "tiny", "messages": msgs, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == len(llm.apply_chat_template(
        chat_messages(msgs)))


# ----------------------------------------------------------------------------- vLLM fields
@pytest.mark.parametrize("route, extra, param", [
    (CMPL, {"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    (CHAT, {"allowed_token_ids": [5]}, "allowed_token_ids"),
    (CMPL, {"bad_words": ["hi"]}, "bad_words"),
    (CHAT, {"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    (CMPL, {"prompt_logprobs": 1}, "prompt_logprobs"),
    (CHAT, {"chat_template": "{{ messages[0].content }}"}, "chat_template"),
    (CHAT, {"documents": [{"title": "t", "text": "x"}]}, "documents"),
    (CHAT, {"echo": True}, "echo"),
    ("/tokenize", {"chat_template": "{{ messages[0].content }}"}, "chat_template"),
    (CMPL, {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    (CHAT, {"guided_json": {"type": "object"}, "guided_whitespace_pattern": "[ ]?"},
     "guided_whitespace_pattern"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
])
def test_vllm_fields_that_change_the_answer_are_refused_not_ignored(client, route, extra,
                                                                     param):
    """vLLM's request extensions that kvcap lacks were dropped as unknown fields: the reply
    was sampled without allowed_token_ids / bad_words, the prompt rendered with the server's
    template instead of the request's own chat_template -- answered 200 as if honoured."""
    body = {"prompt": "hi"} if route == CMPL else {"messages": MSGS}
    r = client.post(route, json={"model": "tiny", "max_tokens": 2, **body, **extra})
    assert r.status_code == 400, r.text  # (/tokenize counted another prompt's tokens)
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "unsupported_parameter", err


@pytest.mark.parametrize("route, extra", [
    (CMPL, {"allowed_token_ids": None, "bad_words": [], "truncate_prompt_tokens": None,
            "prompt_logprobs": None}),
    (CHAT, {"chat_template": None, "documents": None, "echo": False, "bad_words": []}),
    (CHAT, {"echo": None}),
    (CHAT, {"modalities": ["text"], "audio": None, "return_tokens_as_token_ids": False}),
])
def test_those_fields_at_their_neutral_value_are_taken(client, route, extra):
    body = {"prompt": "hi"} if route == CMPL else {"messages": MSGS}
    r = client.post(route, json={"model": "tiny", "max_tokens": 2, **body, **extra})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- HTTP details
def test_a_405_says_which_methods_the_route_takes(client):
    """The error handler rebuilt every HTTP error without the exception's headers: a GET on a
    POST route answered 405 without `Allow`, which HTTP requires of a 405."""
    r = client.get(CMPL)
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    assert r.json()["error"]["message"] == "Method Not Allowed"


def test_metrics_name_every_route_and_bound_the_rest(client):
    """/version, /tokenize, /detokenize and /v1/models/<name> were all counted as "other",
    the label of unknown paths, so their traffic and errors could not be told apart."""
    client.get("/version")
    client.post("/tokenize", json={"model": "tiny", "prompt": "hi"})
    client.post("/detokenize", json={"model": "tiny", "tokens": [1, 2]})
    client.get("/v1/models/tiny")
    client.get("/v1/models/someone-elses")
    client.get("/no/such/route")
    text = client.get("/metrics").text
    lines = [ln for ln in text.splitlines() if ln.startswith("kvcap_http_requests_total{")]
    for endpoint, status in (("/version", 200), ("/tokenize", 200), ("/detokenize", 200),
                             ("/v1/models/{model}", 200), ("/v1/models/{model}", 404),
                             ("other", 404)):
        assert any(f'endpoint="{endpoint}"' in ln and f'status="{status}"' in ln
                   for ln in lines), (endpoint, status, lines)
    assert not any("someone-elses" in ln for ln in lines)
    # the load generator's parser reads a label value holding braces (it dropped the sample)
    from kvcap.bench.serving import parse_metrics

    parsed = parse_metrics(text)
    assert len(parsed) == sum(not ln.startswith("#") for ln in text.splitlines() if ln)
    assert parsed['kvcap_http_requests_total{endpoint="/v1/models/{model}",status="404"}'] >= 1
