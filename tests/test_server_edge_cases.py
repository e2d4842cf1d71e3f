"""Edge cases of the OpenAI routes on servers the main suite does not build: a KV pool smaller
than max_model_len (which LLM allows, with a warning), a model whose every layer slides, and
request values at the edges of their types. In-process (FastAPI's TestClient) and 2-layer random
models with the real SmolLM2 tokenizer keep it cheap."""

from __future__ import annotations

import json
import shutil

import pytest
from fastapi.testclient import TestClient
from server_helpers import TOKENIZER_FILES

from kvcap import LLM
from kvcap.server.app import create_app

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Say hi"}]
VOCAB = 49152  # SmolLM2's


@pytest.fixture(scope="module")
def small_pool(tiny_dir):
    """max_model_len 256 over a pool of 4 blocks of 16 tokens: 64 tokens."""
    llm = LLM(model=str(tiny_dir), device="cpu", num_blocks=4, max_num_seqs=4)
    assert llm.max_model_len == 256 and llm.pool.num_tokens == 64
    with TestClient(create_app(llm, served_model_name="tiny", max_pending=6,
                               poll_s=0.2)) as client:
        yield client


def test_default_max_tokens_fits_a_pool_smaller_than_the_context(small_pool):
    """Without max_tokens (chat's OpenAI default; completions' with null) a request gets what
    fits: the context, or the pool where it holds less. It used to be sized by the context
    alone, and such a server refused every request that left max_tokens out."""
    r = small_pool.post(CHAT, json={"model": "tiny", "messages": MSGS, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["total_tokens"] == 64 and r.json()["choices"][0]["finish_reason"] == "length"
    r = small_pool.post(CMPL, json={"model": "tiny", "prompt": [5] * 10, "max_tokens": None,
                                    "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 54
    # an explicit max_tokens past the pool is still refused, naming it
    r = small_pool.post(CMPL, json={"model": "tiny", "prompt": [5] * 10, "max_tokens": 60})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # a prompt that fills the pool leaves no room: refused, naming the prompt
    r = small_pool.post(CMPL, json={"model": "tiny", "prompt": [5] * 64, "max_tokens": None})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "the KV pool holds 64 tokens" in err["message"]


@pytest.mark.parametrize("top_k", [2**31, 2**63])
def test_top_k_past_the_vocabulary_keeps_every_token(small_pool, top_k):
    """top_k above the vocabulary samples as top_k = the vocabulary. It used to reach the
    sampler, whose int32 top_k overflowed inside the engine step: a 500 for this request and
    for every other request in that step."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 1.0,
            "seed": 3}
    r = small_pool.post(CMPL, json={**body, "top_k": top_k})
    assert r.status_code == 200, r.text
    want = small_pool.post(CMPL, json={**body, "top_k": VOCAB}).json()["choices"][0]["text"]
    assert r.json()["choices"][0]["text"] == want
    events = small_pool.post(CMPL, json={**body, "top_k": top_k, "stream": True}).text
    assert "error" not in events and events.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("key", ["\u00b2", "\u2460"])  # superscript two, circled one
def test_logit_bias_key_that_is_a_digit_but_not_a_number(small_pool, key):
    """str.isdigit accepts these, int() does not: it used to be a 500."""
    r = small_pool.post(CMPL, json={"model": "tiny", "prompt": "x", "max_tokens": 1,
                                    "logit_bias": {key: 1.0}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and err["message"].startswith(
        "logit_bias: keys must be token ids")


@pytest.fixture(scope="module")
def sliding(default_model_dir, tmp_path_factory):
    """A 2-layer random Mistral whose every layer slides over 32 tokens, steps of at most 16
    tokens and a pool of 4 blocks of 16 tokens: a request holds at most 4 blocks however long
    it grows (kvcap.kv_cache.spec.peak_blocks), so the pool takes any length."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    dst = tmp_path_factory.mktemp("sliding") / "model"
    cfg = json.loads((default_model_dir / "config.json").read_text())
    keep = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "rope_theta",
            "rms_norm_eps", "tie_word_embeddings")
    cfg = {k: cfg[k] for k in keep if k in cfg}
    cfg.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=256, sliding_window=32)
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(**cfg)).save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, dst / name)
    llm = LLM(model=str(dst), device="cpu", num_blocks=4, max_num_seqs=2,
              max_num_batched_tokens=16)
    assert llm.spec.sliding_window == 32
    with TestClient(create_app(llm, served_model_name="tiny", poll_s=0.2)) as client:
        yield client


def test_sliding_window_requests_longer_than_the_pool(sliding):
    """The pool check counts blocks as the scheduler admits them (a sliding window's, not the
    whole sequence's); it used to refuse requests the engine serves."""
    body = {"model": "tiny", "prompt": [5] * 20, "max_tokens": 100, "ignore_eos": True}
    r = sliding.post(CMPL, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 100
    r = sliding.post(CMPL, json={**body, "max_tokens": None})  # the whole context
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == 256
