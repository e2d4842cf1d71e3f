"""The OpenAI server over loopback: official `openai` client (stream / non-stream, completions /
chat) against offline greedy outputs, raw HTTP for malformed requests, disconnects, overload,
engine failures, metrics. A 2-layer random Llama with the real SmolLM2 tokenizer keeps it fast.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from server_helpers import (
    StepDelay,
    ThreadedServer,
    metrics,
    wait_drained,
    wait_until,
)

from kvcap import LLM, SamplingParams
from kvcap.server.app import create_app

KEY = "test-key"
MAX_PENDING = 6  # max_num_seqs 4 + 2 queued


@pytest.fixture(scope="module")
def offline(tiny_dir):
    return LLM(model=str(tiny_dir), device="cpu", num_blocks=64)


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlap"])
def srv(tiny_dir, request):
    llm = LLM(model=str(tiny_dir), device="cpu", num_blocks=64, max_num_seqs=4)
    # The engine overlap is on by default on CUDA only; every server test also runs with it
    # forced on (steps launched ahead of their tokens, stopping and disconnecting mid-flight).
    llm.engine.overlap = request.param
    # Checked here rather than at teardown: under pytest-xdist a worker may get only this
    # module's one-token or refused requests, which never launch a step ahead.
    llm.generate("Warm up", SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert (llm.engine.num_steps_ahead > 0) == request.param
    delay = StepDelay(llm.engine)
    app = create_app(llm, served_model_name="tiny", api_key=KEY, max_pending=MAX_PENDING,
                     poll_s=0.2)
    with ThreadedServer(app) as server:
        server.llm, server.delay = llm, delay
        server.http = httpx.Client(base_url=server.url, timeout=60,
                                   headers={"Authorization": f"Bearer {KEY}"})
        server.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        yield server
        server.http.close()


def greedy(offline, prompt: str, n: int, chat: bool = False, **kw) -> str:
    params = SamplingParams(max_tokens=n, temperature=0.0, **kw)
    if chat:
        return offline.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0].text
    return offline.generate(prompt, params, use_tqdm=False)[0].text


# ----------------------------------------------------------------------------- openai client
def test_completion_matches_offline(srv, offline):
    r = srv.client.completions.create(model="tiny", prompt="The capital of France is",
                                      max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny"
    assert r.choices[0].text == greedy(offline, "The capital of France is", 6)
    assert r.choices[0].finish_reason == "length"
    n_prompt = len(offline.tokenizer.encode("The capital of France is", add_special_tokens=False))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        n_prompt, 6, n_prompt + 6)


def test_completion_stream_matches_offline(srv, offline):
    chunks = list(srv.client.completions.create(model="tiny", prompt="Once upon a time",
                                                max_tokens=7, temperature=0, stream=True))
    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == greedy(offline, "Once upon a time", 7)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_matches_offline(srv, offline):
    r = srv.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=5,
        temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == greedy(offline, "Say hi", 5, chat=True)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_chat_stream_with_usage(srv, offline):
    chunks = list(srv.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=5,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == greedy(offline, "Say hi", 5, chat=True)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    prompt_len = len(offline.apply_chat_template([{"role": "user", "content": "Say hi"}]))
    assert chunks[-1].usage.prompt_tokens == prompt_len


def test_stop_string_is_never_streamed(srv, offline):
    full = greedy(offline, "Hello", 12, ignore_eos=True)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[:full.find(stop)]
    kw = dict(model="tiny", prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    r = srv.client.completions.create(**kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    streamed = "".join(c.choices[0].text for c in srv.client.completions.create(**kw,
                                                                                stream=True))
    assert streamed == expected
    kw["extra_body"]["include_stop_str_in_output"] = True  # vLLM's: the stop string kept
    assert srv.client.completions.create(**kw).choices[0].text == expected + stop
    streamed = "".join(c.choices[0].text for c in srv.client.completions.create(**kw,
                                                                                stream=True))
    assert streamed == expected + stop


def test_stop_tokens_and_special_tokens_text(srv, offline):
    """A stop token ends the text without its own text unless include_stop_str_in_output
    (as vLLM); skip_special_tokens: false keeps special tokens' text (here EOS and a token
    forced by logit_bias)."""
    tok = offline.tokenizer
    want = offline.generate("Hello", SamplingParams(temperature=1.0, seed=7, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False)[0]
    # the last new token of a seeded run (greedy, the tiny model repeats one token)
    stop_at = max(k for k in range(8) if want.token_ids[k] not in want.token_ids[:k])
    assert stop_at > 0
    stop_tok = want.token_ids[stop_at]
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 1.0,
            "seed": 7, "ignore_eos": True, "stop_token_ids": [stop_tok]}

    def text(**extra) -> str:
        r = srv.http.post(CMPL, json={**body, **extra}).json()
        return r["choices"][0]["text"]

    assert text() == tok.decode(want.token_ids[:stop_at])
    assert text(include_stop_str_in_output=True) == tok.decode(want.token_ids[:stop_at + 1])
    eos, special = tok.eos_token_id, tok.convert_tokens_to_ids(tok.all_special_tokens[0])
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0,
            "logit_bias": {str(special): 100}}
    assert text() == ""
    assert text(skip_special_tokens=False) == tok.decode([special, special])
    body["logit_bias"] = {str(eos): 100}
    assert text(skip_special_tokens=False) == ""  # EOS: a stop token
    assert text(skip_special_tokens=False, include_stop_str_in_output=True) == \
        tok.decode([eos])
    assert text(include_stop_str_in_output=True) == ""  # its text is special: skipped


def test_models_health_batch(srv):
    assert [m.id for m in srv.client.models.list().data] == ["tiny"]
    assert srv.client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        srv.client.models.retrieve("other")
    assert srv.http.get("/version").json() == {"version": __import__("kvcap").__version__}
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    r = srv.client.completions.create(model="tiny", prompt=["a b", "c d e"], max_tokens=3)
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens <= 6


# ----------------------------------------------------------------------------- logprobs, echo, n
def _hf_logprobs(tiny_dir, ids: list[int]):
    """log_softmax of HF transformers' logits at each position, FP32 (an independent model)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_completion_echo_logprobs_match_hf_and_the_engine(srv, offline, tiny_dir):
    prompt = "The capital of France is"
    r = srv.http.post(CMPL, json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                  "temperature": 0, "logprobs": 3, "echo": True}).json()
    choice = r["choices"][0]
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                            use_tqdm=False)[0]
    assert choice["text"] == prompt + want.text
    lp = choice["logprobs"]
    ids = want.prompt_token_ids + want.token_ids
    n_prompt = len(want.prompt_token_ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == choice["text"]  # byte-level tokens join to the text
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(len(ids))]
    ref = _hf_logprobs(tiny_dir, ids)  # position k - 1 predicts token k
    for k in range(1, len(ids)):
        assert lp["token_logprobs"][k] == pytest.approx(float(ref[k - 1, ids[k]]), abs=2e-4)
        top = lp["top_logprobs"][k]
        assert len(top) in (3, 4) and lp["tokens"][k] in top  # the top 3 and the chosen one
        best = float(ref[k - 1].max())
        assert max(top.values()) == pytest.approx(best, abs=2e-4)
    for k, d in enumerate(want.logprobs):  # generated part: the engine's own values
        assert lp["token_logprobs"][n_prompt + k] == pytest.approx(d[want.token_ids[k]])


def test_completion_logprobs_stream_equals_non_stream(srv):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
            "logprobs": 2, "echo": True, "stop": [" the"], "ignore_eos": True}
    whole = srv.http.post(CMPL, json=body).json()["choices"][0]
    del body["ignore_eos"]
    chunks = list(srv.client.completions.create(**body, stream=True,
                                                extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks)
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.choices[0].logprobs is not None:
            for key, val in merged.items():
                val += getattr(c.choices[0].logprobs, key)
    assert text == whole["text"] and merged == whole["logprobs"]


def test_echo_with_max_tokens_0_scores_the_prompt_alone(srv):
    """echo + max_tokens 0 (OpenAI's legacy scoring call, vLLM's echo without generation): the
    prompt's text and logprobs, nothing generated or counted, streamed or not."""
    body = {"model": "tiny", "prompt": "Once upon a time", "temperature": 0, "logprobs": 2,
            "echo": True}
    full = srv.http.post(CMPL, json={**body, "max_tokens": 3}).json()
    r = srv.http.post(CMPL, json={**body, "max_tokens": 0}).json()
    choice, n_prompt = r["choices"][0], r["usage"]["prompt_tokens"]
    assert choice["text"] == "Once upon a time" and choice["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0,
                          "total_tokens": n_prompt}
    head = {k: v[:n_prompt] for k, v in full["choices"][0]["logprobs"].items()}
    assert choice["logprobs"] == head
    chunks = list(srv.client.completions.create(**body, max_tokens=0, stream=True,
                                                stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    bad = srv.http.post(CMPL, json={**body, "echo": False, "max_tokens": 0})
    assert bad.status_code == 400 and "needs echo" in bad.json()["error"]["message"]


def test_chat_logprobs_through_the_openai_client(srv, offline):
    msgs = [{"role": "user", "content": "Say hi"}]
    r = srv.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5,
                                           temperature=0, logprobs=True, top_logprobs=2)
    want = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=5, logprobs=2),
                        use_tqdm=False)[0]
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.token_ids) == 5
    assert b"".join(bytes(t.bytes) for t in content).decode() == r.choices[0].message.content
    for t, tok, d in zip(content, want.token_ids, want.logprobs, strict=True):
        assert t.logprob == pytest.approx(d[tok])
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].logprob == pytest.approx(max(d.values()))  # greedy: the best
    chunks = list(srv.client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
        stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]
    plain = srv.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_token_texts_give_each_tokens_exact_bytes(offline):
    from kvcap.engine.token_bytes import TokenTexts

    texts = TokenTexts(offline.tokenizer)
    assert texts.byte_level
    text = "héllo 世界 wörld <|im_start|>\n\t x"
    ids = offline.tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(bytes(texts(t)[1]) for t in ids).decode() == text
    partial = [texts(t)[0] for t in ids if "\ufffd" in texts(t)[0]]
    assert partial  # 世界 is split inside its UTF-8 sequences
    assert TokenTexts(None)(7) == ("token_id:7", list(b"token_id:7"))


def test_penalties_and_logit_bias_match_offline(srv, offline):
    kw = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.1)
    want = greedy(offline, "Once upon a time", 10, ignore_eos=True, **kw,
                  logit_bias={262: 4.0})
    r = srv.client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0,
        presence_penalty=0.5, frequency_penalty=1.0, logit_bias={"262": 4.0},
        extra_body={"ignore_eos": True, "repetition_penalty": 1.1})
    assert r.choices[0].text == want
    assert want != greedy(offline, "Once upon a time", 10, ignore_eos=True)


def test_tokenize_and_detokenize(srv, offline):
    text = "The capital of France is"
    r = srv.http.post("/tokenize", json={"model": "tiny", "prompt": text}).json()
    assert r["tokens"] == offline.tokenizer.encode(text, add_special_tokens=False)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    msgs = [{"role": "user", "content": "Say hi"}]
    r = srv.http.post("/tokenize", json={"model": "tiny", "messages": msgs}).json()
    assert r["tokens"] == offline.apply_chat_template(msgs)
    back = srv.http.post("/detokenize", json={"model": "tiny", "tokens": r["tokens"]}).json()
    assert back["prompt"] == offline.tokenizer.decode(r["tokens"])
    bad = srv.http.post("/tokenize", json={"model": "tiny", "prompt": "x", "messages": msgs})
    assert bad.status_code == 400 and "exactly one of prompt and messages" in bad.text
    bad = srv.http.post("/detokenize", json={"model": "tiny", "tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{srv.url}/tokenize", json={"model": "tiny", "prompt": "x"}
                      ).status_code == 401  # the API key guards it
    # vLLM's routes take the model as optional: the served one; a wrong one is still a 404
    plain = srv.http.post("/tokenize", json={"prompt": text}).json()
    assert plain["tokens"] == offline.tokenizer.encode(text, add_special_tokens=False)
    assert srv.http.post("/detokenize", json={"tokens": plain["tokens"]}).json()["prompt"] == \
        offline.tokenizer.decode(plain["tokens"])
    assert srv.http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def test_chat_template_override(tiny_dir, tmp_path):
    from kvcap.errors import ModelLoadError

    (tmp_path / "t.jinja").write_text(TEMPLATE)
    msgs = [{"role": "user", "content": "Say hi"}]
    for given in (TEMPLATE, str(tmp_path / "t.jinja")):
        llm = LLM(model=str(tiny_dir), device="cpu", num_blocks=8, chat_template=given)
        want = llm.tokenizer.encode("[user] Say hi\n[assistant]", add_special_tokens=False)
        assert llm.apply_chat_template(msgs) == want
    app = create_app(llm, served_model_name="tiny")
    with ThreadedServer(app) as server:  # the server renders with the same template
        r = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": msgs})
        assert r.json()["tokens"] == want
    with pytest.raises(ModelLoadError, match="Jinja syntax error at line 1"):
        LLM(model=str(tiny_dir), device="cpu", num_blocks=8, chat_template="{% for x %}")
    with pytest.raises(ModelLoadError, match="neither a file nor a Jinja template"):
        LLM(model=str(tiny_dir), device="cpu", num_blocks=8, chat_template="no-such.jinja")


def test_checkpoint_sampling_defaults(tiny_dir, offline, tmp_path):
    import shutil

    from kvcap.errors import ModelLoadError
    from kvcap.models.loader import read_sampling_defaults

    model = tmp_path / "m"
    shutil.copytree(tiny_dir, model)
    cfg = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**cfg, "temperature": 0.0, "top_p": 0.5, "do_sample": True}))
    defaults = read_sampling_defaults(model)
    assert defaults == {"temperature": 0.0, "top_p": 0.5}
    llm = LLM(model=str(model), device="cpu", num_blocks=16)
    with ThreadedServer(create_app(llm, served_model_name="tiny",
                                   sampling_defaults=defaults)) as server:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8,
                "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body).json()
        assert r["choices"][0]["text"] == greedy(offline, "Once upon a time", 8,
                                                 ignore_eos=True)  # the default: greedy
        sampled = [httpx.post(f"{server.url}/v1/completions",
                              json={**body, "temperature": 1.0, "seed": s}).json()
                   for s in range(3)]  # a request's own value wins
        assert len({o["choices"][0]["text"] for o in sampled}) > 1
    (model / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ModelLoadError, match="top_p = 7 is not a valid sampling value"):
        read_sampling_defaults(model)
    assert read_sampling_defaults(None) == {}


def test_json_object_response_format(srv):
    from kvcap.sampling.json_schema import object_grammar

    g = object_grammar()
    msgs = [{"role": "user", "content": "Answer in JSON"}]
    r = srv.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10,
                                           temperature=0.9, seed=2,
                                           response_format={"type": "json_object"})
    text = r.choices[0].message.content  # a random model: at least a JSON object's start
    assert text.lstrip().startswith("{") and g.feed(g.start, text.encode()) is not None
    streamed = "".join(c.choices[0].delta.content or "" for c in srv.client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=10, temperature=0.9, seed=2, stream=True,
        response_format={"type": "json_object"}) if c.choices)
    assert streamed == text


PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                        "legs": {"type": "integer"}},
       "required": ["name", "legs"]}


def test_json_schema_and_choice_outputs(srv):
    """OpenAI's response_format json_schema and vLLM's guided_json / guided_choice /
    structured_outputs: a random model's output is a prefix the schema allows (streamed ==
    not), and a choice ends, finished, on one of the strings."""
    from kvcap.sampling.json_schema import compile_schema

    g = compile_schema(PET)
    msgs = [{"role": "user", "content": "A pet, as JSON"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    r = srv.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12,
                                           temperature=1.0, seed=5, response_format=fmt)
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{") and g.feed(g.start, text.encode()) is not None
    streamed = "".join(c.choices[0].delta.content or "" for c in srv.client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=12, temperature=1.0, seed=5, stream=True,
        response_format=fmt) if c.choices)
    assert streamed == text
    body = {"model": "tiny", "prompt": "Pick:", "max_tokens": 12, "temperature": 1.0, "seed": 5}
    as_text = srv.http.post(CMPL, json={**body, "guided_json": json.dumps(PET)}).json()
    assert g.feed(g.start, as_text["choices"][0]["text"].encode()) is not None
    for extra in ({"guided_choice": ["alpha", "beta gamma"]},
                  {"structured_outputs": {"choice": ["alpha", "beta gamma"]}}):
        for seed in range(3):
            c = srv.http.post(CMPL, json={**body, **extra, "seed": seed}).json()["choices"][0]
            assert c["text"] in ("alpha", "beta gamma") and c["finish_reason"] == "stop", c
    for extra in ({"guided_regex": "[0-9]{3}-[a-c]{2}"},
                  {"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}}):
        c = srv.http.post(CMPL, json={**body, **extra}).json()["choices"][0]
        assert re.fullmatch("[0-9]{3}-[a-c]{2}", c["text"]) and c["finish_reason"] == "stop", c


@pytest.mark.parametrize("extra, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {}}}}}, "response_format",
     "response_format: schema: 'not' not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type must be text"),
    ({"guided_json": "{broken"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "response_format",
     "give one structured output format"),
    ({"guided_grammar": "root ::= x"}, "guided_grammar", "only the default value"),
    ({"guided_regex": "(?=a)"}, "guided_regex", "guided_regex: pattern '(?=a)': look-around"),
    ({"structured_outputs": {"grammar": "x"}}, "structured_outputs", "not supported"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "guided_choice", "ends with EOS"),
])
def test_structured_output_errors_name_their_field(srv, extra, param, message):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, **extra}
    r = srv.http.post(CMPL, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_n_choices_with_a_seed(srv):
    body = {"model": "tiny", "prompt": ["Hello", "Once upon"], "max_tokens": 6,
            "temperature": 1.0, "seed": 11, "ignore_eos": True}
    one = [srv.http.post(CMPL, json={**body, "prompt": p, "seed": 11 + j}).json()
           for p in body["prompt"] for j in range(3)]
    r = srv.http.post(CMPL, json={**body, "n": 3}).json()
    assert [c["index"] for c in r["choices"]] == list(range(6))
    # prompt p's choice j is the single request with seed + j
    assert [c["text"] for c in r["choices"]] == [o["choices"][0]["text"] for o in one]
    assert r["usage"]["prompt_tokens"] == sum(o["usage"]["prompt_tokens"] for o in one[::3])
    assert r["usage"]["completion_tokens"] == 36
    chat = srv.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4, n=2, seed=5,
        stream=True, stream_options={"include_usage": True})
    chunks = list(chat)
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert chunks[-1].usage.completion_tokens == 8


# ----------------------------------------------------------------------------- bad input
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
CASES = [
    (CMPL, b"{not json", 400, None, "invalid JSON body"),
    (CMPL, b"[1, 2]", 400, None, "the request body must be a JSON object"),
    (CMPL, {"model": "tiny", "prompt": "x", "max_tokens": "8"}, 400, "max_tokens",
     "max_tokens: Input should be a valid integer"),
    (CMPL, {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature",
     "temperature: Input should be a valid number"),
    (CMPL, {"model": "tiny", "prompt": 5}, 400, "prompt", "prompt: "),
    (CMPL, {"model": "tiny"}, 400, "prompt", "prompt: Field required"),
    (CMPL, {"model": "nope", "prompt": "x"}, 404, "model",
     "model: the model 'nope' does not exist; this server serves 'tiny'"),
    (CMPL, {"model": "tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens",
     "max_tokens: must be at least 1, got -3"),
    (CMPL, {"model": "tiny", "prompt": [5] * 300}, 400, "prompt",
     "prompt: the prompt has 300 tokens but the context (max_model_len) is 256 tokens"),
    (CMPL, {"model": "tiny", "prompt": [5] * 200, "max_tokens": 100}, 400, "max_tokens",
     "max_tokens: 200 prompt tokens + 100 completion tokens exceed the context"),
    (CMPL, {"model": "tiny", "prompt": [49152]}, 400, "prompt",
     "prompt: token ids must be in [0, 49152)"),
    (CMPL, {"model": "tiny", "prompt": "x", "n": 0}, 400, "n", "n: must be in [1, 128], got 0"),
    (CMPL, {"model": "tiny", "prompt": ["x", "y"], "n": 4}, 400, "prompt",
     "prompt: at most 6 prompts x n choices per request"),
    (CMPL, {"model": "tiny", "prompt": "x", "best_of": 3}, 400, "best_of",
     "best_of: only the default value is supported"),
    (CMPL, {"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty",
     "presence_penalty: must be in [-2, 2], got 2.5"),
    (CMPL, {"model": "tiny", "prompt": "x", "repetition_penalty": 0.0}, 400,
     "repetition_penalty", "repetition_penalty: must be a positive number"),
    (CMPL, {"model": "tiny", "prompt": "x", "logit_bias": {"abc": 1.0}}, 400, "logit_bias",
     "logit_bias: keys must be token ids, got 'abc'"),
    (CMPL, {"model": "tiny", "prompt": "x", "logit_bias": {"5": 300}}, 400, "logit_bias",
     "logit_bias: values must be in [-100, 100], got 300"),
    (CMPL, {"model": "tiny", "prompt": "x", "logit_bias": {"49152": 1}}, 400, "logit_bias",
     "logit_bias: token ids must be in [0, 49152)"),
    (CMPL, {"model": "tiny", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400,
     "min_tokens", "min_tokens: must be in [0, max_tokens = 4], got 5"),
    (CMPL, {"model": "tiny", "prompt": "x", "use_beam_search": True}, 400, "use_beam_search",
     "use_beam_search: only the default value is supported"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
            "guided_grammar": "root ::= x"}, 400, "guided_grammar",
     "guided_grammar: only the default value is supported"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     "response_format", "response_format: type json_schema needs json_schema.schema"),
    (CMPL, {"model": "tiny", "prompt": "x", "response_format": {"type": "json_object"},
            "ignore_eos": True}, 400, "response_format",
     "response_format: structured output ends with EOS once complete"),
    (CMPL, {"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs",
     "logprobs: must be in [0, 20], got 21"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
            "top_logprobs": 2}, 400, "top_logprobs", "top_logprobs: needs logprobs: true"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
            "top_logprobs": -1}, 400, "top_logprobs", "top_logprobs: must be in [0, 20]"),
    (CMPL, {"model": "tiny", "prompt": "x", "temperature": 7.5}, 400, "temperature",
     "temperature: must be in [0, 2], got 7.5"),
    (CHAT, {"model": "tiny", "messages": "hi"}, 400, "messages", "messages: "),
    (CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages", "messages: Input should be"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages", "messages: content part 1 has type 'image_url': this server's models read "
     "text only"),
    (CHAT, {"model": "tiny", "messages": []}, 400, "messages",
     "messages: must contain at least one message"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x " * 300}]}, 400,
     "messages", "messages: the prompt has"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
            "stream": "yes"}, 400, "stream", "stream: Input should be a valid boolean"),
]


@pytest.mark.parametrize("path,body,status,param,message", CASES)
def test_bad_requests(srv, path, body, status, param, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = srv.http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"].startswith(message), err
    assert err["type"] == "invalid_request_error"


def test_unknown_route_uses_openai_error_body(srv):
    r = srv.http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"


def test_api_key(srv):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    r = httpx.post(f"{srv.url}/v1/completions", json=body)
    assert r.status_code == 401
    assert r.json()["error"]["message"] == "missing API key: send 'Authorization: Bearer <key>'"
    r = httpx.post(f"{srv.url}/v1/completions", json=body,
                   headers={"Authorization": "Bearer wrong"})
    assert (r.status_code, r.json()["error"]["message"]) == (401, "incorrect API key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{srv.url}/health").status_code == 200  # probes need no key
    assert httpx.get(f"{srv.url}/metrics").status_code == 200


# ----------------------------------------------------------------------------- robustness
def _long_stream(srv, max_tokens: int = 200):
    body = {"model": "tiny", "prompt": "Tell me a story", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    return srv.http.send(srv.http.build_request("POST", CMPL, json=body), stream=True)


def _first_text(lines) -> str:
    """Read up to the first text chunk. The caller keeps `lines` (resp.iter_lines()) alive:
    a collected line iterator closes the response, i.e. disconnects."""
    for line in lines:
        if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
            return line
    raise AssertionError("stream ended before any text")


def test_disconnect_mid_stream_frees_blocks(srv):
    aborts = metrics(srv.url)['kvcap_requests_total{outcome="abort"}']
    srv.delay.delay = 0.05
    try:
        resp = _long_stream(srv)
        assert resp.status_code == 200
        lines = resp.iter_lines()
        _first_text(lines)
        m = metrics(srv.url)
        assert m["kvcap_requests_in_flight"] == 1 and m["kvcap_kv_blocks_used"] > 0
        resp.close()  # the client goes away mid-stream
        m = wait_drained(srv.url, timeout=20)
    finally:
        srv.delay.delay = 0.0
    assert m['kvcap_requests_total{outcome="abort"}'] == aborts + 1


def test_disconnect_non_stream_aborts(srv):
    aborts = metrics(srv.url)['kvcap_requests_total{outcome="abort"}']
    srv.delay.delay = 0.05
    try:
        with pytest.raises(httpx.ReadTimeout):
            srv.http.post(CMPL, json={"model": "tiny", "prompt": "x", "max_tokens": 200,
                                      "ignore_eos": True}, timeout=1.0)
        m = wait_drained(srv.url, timeout=20)
    finally:
        srv.delay.delay = 0.0
    assert m['kvcap_requests_total{outcome="abort"}'] == aborts + 1


def test_overload_answers_429_with_bounded_queue(srv):
    srv.delay.delay = 0.05
    streams = []
    try:
        for _ in range(MAX_PENDING):
            streams.append(_long_stream(srv))
            assert streams[-1].status_code == 200
        m = metrics(srv.url)
        assert m["kvcap_requests_in_flight"] == MAX_PENDING
        r = srv.http.post(CMPL, json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert r.json()["error"]["message"].startswith("server overloaded: 6 requests in flight")
        with pytest.raises(openai.RateLimitError):
            srv.client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1)
        # the engine admits the submitted requests within an iteration or two
        wait_until(lambda: (m := metrics(srv.url))["kvcap_requests_running"] == 4
                   and m["kvcap_queue_length"] == 2, 10, "4 running and 2 queued")
    finally:
        for s in streams:
            s.close()
        srv.delay.delay = 0.0
    wait_drained(srv.url, timeout=30)
    assert srv.client.completions.create(model="tiny", prompt="x", max_tokens=2).choices


def test_engine_error_fails_only_affected_requests(srv):
    runner = srv.llm.runner
    real = runner.launch  # the engine's entry into the runner (then `finish`)
    calls = {"n": 0}

    def failing_once(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real(*a, **kw)

    errors = metrics(srv.url)["kvcap_engine_step_errors_total"]
    runner.launch = failing_once
    try:
        r = srv.http.post(CMPL, json={"model": "tiny", "prompt": "x", "max_tokens": 3})
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "engine error: injected failure"
        assert r.json()["error"]["type"] == "server_error"
        calls["n"] = 0
        with pytest.raises(openai.APIError, match="injected failure"):
            list(srv.client.completions.create(model="tiny", prompt="x", max_tokens=3,
                                               stream=True))
        ok = srv.client.completions.create(model="tiny", prompt="x", max_tokens=3)
        assert ok.choices[0].finish_reason in ("stop", "length")
    finally:
        runner.launch = real
    m = wait_drained(srv.url)
    assert m["kvcap_engine_step_errors_total"] == errors + 2
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_metrics_exposition(srv):
    before = metrics(srv.url)
    srv.client.completions.create(model="tiny", prompt="count me", max_tokens=2)
    srv.http.post(CMPL, json={"model": "nope", "prompt": "x"})
    r = httpx.get(f"{srv.url}/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = r.text.strip().splitlines()
    samples = [ln for ln in lines if not ln.startswith("#")]
    names = {ln.split("{")[0].split(" ")[0] for ln in samples}
    for name in names:  # every sample has HELP and TYPE
        assert f"# TYPE {name} " in r.text and f"# HELP {name} " in r.text
    m = metrics(srv.url)
    assert len(m) == len(samples)
    ok = 'kvcap_http_requests_total{endpoint="/v1/completions",status="200"}'
    bad = 'kvcap_http_requests_total{endpoint="/v1/completions",status="404"}'
    assert m[ok] == before.get(ok, 0) + 1 and m[bad] == before.get(bad, 0) + 1
    assert m["kvcap_generation_tokens_total"] == before["kvcap_generation_tokens_total"] + 2
    assert m["kvcap_kv_blocks_total"] == 64
    assert m["kvcap_kv_blocks_used"] + m["kvcap_kv_blocks_free"] == 64
    assert m['kvcap_kv_cache_info{model="tiny",dtype="fp32",scale_source="none"}'] == 1
    assert m['kvcap_kv_scale_gate{status="not_required"}'] == 1


# ----------------------------------------------------------------------------- load generator
def test_bench_fixed_rate_run(srv):
    from kvcap.bench.serving import LoadConfig, run_load

    cfg = LoadConfig(url=srv.url, api_key=KEY, num_requests=6, concurrency=3, rate=20.0,
                     arrival="fixed", max_tokens=3, endpoint="chat", progress=False,
                     disconnect_fraction=0.34)
    report = asyncio.run(run_load(cfg))
    assert report["requests"] == {"planned": 6, "sent": 6, "completed": 4, "disconnected": 2,
                                  "failed": 0}
    assert report["finish_reasons"] == {"length": 4}
    assert report["throughput"]["output_tokens"] == 12
    assert report["ttft_s"]["p50"] > 0 and report["tpot_s"]["max"] > 0
    server = report["server"]
    assert server["drained"] and server["kv_blocks_free"] == server["kv_blocks_total"] == 64
    assert sum(server["requests_ended_during_run"].values()) == 6


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com",
                                 "http://0.0.0.0:8000"])
def test_bench_refuses_non_loopback(url):
    from kvcap.bench.serving import main

    assert main(["--url", url, "--num-requests", "1"]) == 2
