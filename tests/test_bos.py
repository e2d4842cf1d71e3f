"""A tokenizer that adds a BOS (Llama, Mistral): text prompts are encoded with it, as
transformers and vLLM encode them -- LLM.generate, /v1/completions, /tokenize -- unless a request
says add_special_tokens false; chat prompts get only what the chat template writes."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import ThreadedServer, make_tiny_model

from kvcap import LLM, SamplingParams
from kvcap.server.app import create_app

BOS = 1  # SmolLM2's <|im_start|>, made the BOS of the copied tokenizer


@pytest.fixture(scope="module")
def bos_dir(default_model_dir, tmp_path_factory):
    path = make_tiny_model(default_model_dir, tmp_path_factory.mktemp("bos") / "model")
    tok = json.loads((path / "tokenizer.json").read_text())
    name = "<|im_start|>"
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": name, "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": name, "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {name: {"id": name, "ids": [BOS], "tokens": [name]}}}
    (path / "tokenizer.json").write_text(json.dumps(tok))
    return path


@pytest.fixture(scope="module")
def llm(bos_dir):
    return LLM(model=str(bos_dir), device="cpu", num_blocks=64)


def test_text_prompts_get_the_bos(llm):
    plain = llm.tokenizer.encode("Hello world", add_special_tokens=False)
    assert llm.tokenizer.encode("Hello world") == [BOS, *plain]  # the tokenizer adds it
    out = llm.generate("Hello world", SamplingParams(max_tokens=2, temperature=0),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == [BOS, *plain]
    chat = llm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat[0] == BOS and chat[1] != BOS  # the template's own start token, once
    # a text that opens with the BOS itself (a chat template the client rendered) keeps one
    rendered = llm.tokenizer.decode(chat)
    assert llm.generate(rendered, SamplingParams(max_tokens=1), use_tqdm=False)[0] \
        .prompt_token_ids == chat


def test_server_encodes_prompts_with_the_bos_unless_told(llm):
    app = create_app(llm, served_model_name="bos")
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        plain = llm.tokenizer.encode("Hello world", add_special_tokens=False)
        r = http.post("/tokenize", json={"model": "bos", "prompt": "Hello world"}).json()
        assert r["tokens"] == [BOS, *plain]
        r = http.post("/tokenize", json={"model": "bos", "prompt": "Hello world",
                                         "add_special_tokens": False}).json()
        assert r["tokens"] == plain
        r = http.post("/tokenize", json={"model": "bos", "add_special_tokens": True,
                                         "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        body = {"model": "bos", "prompt": "Hello world", "max_tokens": 3, "temperature": 0}
        with_bos = http.post("/v1/completions", json=body).json()
        without = http.post("/v1/completions", json={**body, "add_special_tokens": False}).json()
        assert with_bos["usage"]["prompt_tokens"] == len(plain) + 1
        assert without["usage"]["prompt_tokens"] == len(plain)
    # offline, once the server (which drives the same engine) has stopped
    ref = llm.generate([[BOS, *plain]], SamplingParams(max_tokens=3, temperature=0),
                       use_tqdm=False)[0]
    assert with_bos["choices"][0]["text"] == ref.text


def test_corpora_and_eval_prompts_begin_as_served_prompts(llm, default_model_dir):
    """Calibration and evaluation records, the plain generation prompts and the retrieval
    prompts begin with the tokenizer's text prefix, as a served text prompt does (the K/V of the
    sequence start is then observed by calibration); the embedded model's tokenizer has none."""
    from transformers import AutoTokenizer

    from kvcap.eval import corpora, generation, retrieval
    from kvcap.models.text_prompt import text_prefix

    tok = llm.tokenizer
    assert text_prefix(tok) == [BOS]
    assert text_prefix(AutoTokenizer.from_pretrained(str(default_model_dir))) == []
    shards = corpora.build_shards(tok, ["code"], max_tokens=3000, record_tokens=64,
                                  progress=False)
    records = [r for s in shards for r in s.records]
    assert len(records) > 10 and all(len(r) <= 64 for r in records)
    assert all(r[0] == BOS and r[1] != BOS for r in records)
    plain = [p for p in generation.build_prompts(tok, 2, 0) if p.kind == "plain"]
    assert plain and all(p.ids[0] == BOS and p.ids[1] != BOS for p in plain)
    hay, docs = retrieval.haystack_ids(tok, 2000)
    for case in (retrieval.passkey_case(tok, hay, docs, 512, 50, 0),
                 retrieval.kv_case(tok, 512, 50, 0)):
        assert case.prompt_ids[0] == BOS and case.prompt_ids[1] != BOS
        assert len(case.prompt_ids) <= 512 - retrieval.MAX_NEW_TOKENS
