"""QSA through the engine on a tiny random Llama: a budget covering the context is dense
attention exactly; the rollback switch; side caches follow the block lifecycle (prefix
caching, preemption, abort)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvcap import LLM, SamplingParams
from kvcap.qsa.config import ENV_DISABLE_QSA, QSAConfig
from kvcap.qsa.enable import disable_qsa, enable_qsa, qsa_side_bytes_per_token

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
SMALL = QSAConfig(layer_rule="all_but_first", first_dense=1, topk_groups=4)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qsa_tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return f"dummy:{path}"


def _llm(model, **kw):
    kw.setdefault("num_blocks", 64)
    return LLM(model=model, max_num_batched_tokens=kw.pop("chunk", 48), **kw)


def _prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (n,), generator=g).tolist() for n in lengths]


def _same(outs_a, outs_b):
    for a, b in zip(outs_a, outs_b, strict=True):
        assert a.token_ids == b.token_ids
        la = [next(iter(d.values())) for d in a.logprobs]
        lb = [next(iter(d.values())) for d in b.logprobs]
        assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 1e-4


@pytest.mark.parametrize("summary", ["mean", "minmax"])
def test_full_budget_equals_dense_exactly(tiny_model, summary):
    prompts = _prompts(0, [150, 37, 5])
    dense = _llm(tiny_model)
    qsa = _llm(tiny_model)
    enable_qsa(qsa, QSAConfig(layer_rule="all_but_first", first_dense=1, topk_groups=64,
                              summary=summary))
    for a, b in zip(dense.prompt_logits(prompts), qsa.prompt_logits(prompts), strict=True):
        assert torch.equal(a, b)  # chunked prefill (48-token chunks), bit for bit
    p = SamplingParams(max_tokens=20, temperature=0.0)
    for a, b in zip(dense.generate(prompts, p, use_tqdm=False),
                    qsa.generate(prompts, p, use_tqdm=False), strict=True):
        assert a.token_ids == b.token_ids
    enable_qsa(qsa, QSAConfig(layer_rule="all_but_first", first_dense=1, topk_groups=4,
                              summary=summary))
    small = qsa.prompt_logits(prompts[:1])[0]
    assert float((small - dense.prompt_logits(prompts[:1])[0]).abs().max()) > 1e-3


def test_rollback_switch(tiny_model, monkeypatch):
    prompts = _prompts(1, [120])
    dense = _llm(tiny_model)
    qsa = _llm(tiny_model)
    enable_qsa(qsa, SMALL)
    ref = dense.prompt_logits(prompts)[0]
    assert not torch.equal(qsa.prompt_logits(prompts)[0], ref)
    monkeypatch.setenv(ENV_DISABLE_QSA, "1")
    assert torch.equal(qsa.prompt_logits(prompts)[0], ref)
    monkeypatch.delenv(ENV_DISABLE_QSA)
    disable_qsa(qsa)
    assert torch.equal(qsa.prompt_logits(prompts)[0], ref)


def test_prefix_cache_reuses_side_rows(tiny_model):
    """B reuses A's cached prefix blocks: its output must equal a fresh run, which needs the
    side rows of those blocks; zeroing them (a lifecycle bug) must change B's output."""
    shared = _prompts(2, [96])[0]  # 6 full blocks
    a, b = shared + _prompts(3, [21])[0], shared + _prompts(4, [17])[0]
    fresh = _llm(tiny_model, enable_prefix_caching=False)
    enable_qsa(fresh, SMALL)
    want = fresh.generate([b], GREEDY, use_tqdm=False)
    llm = _llm(tiny_model)
    be = enable_qsa(llm, SMALL)
    llm.generate([a], GREEDY, use_tqdm=False)
    assert llm.block_manager.num_cached_blocks >= 6
    _same(llm.generate([b], GREEDY, use_tqdm=False), want)
    for layer in be.side.layers:
        be.side.layer(layer).comp.zero_()
    broken = llm.generate([b], GREEDY, use_tqdm=False)[0]
    la = [next(iter(d.values())) for d in broken.logprobs]
    lb = [next(iter(d.values())) for d in want[0].logprobs]
    assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) > 1e-3


def test_preemption_and_abort(tiny_model, caplog):
    prompts = _prompts(5, [70, 60, 50])
    # Long enough generations that two admitted requests outgrow the 14-block pool (the
    # admission watermark keeps a third from starting): preemption by recompute must happen.
    long = SamplingParams(max_tokens=48, temperature=0.0, logprobs=0)
    ample = _llm(tiny_model, enable_prefix_caching=False)
    enable_qsa(ample, SMALL)
    want = ample.generate(prompts, long, use_tqdm=False)
    tight = _llm(tiny_model, num_blocks=14, enable_prefix_caching=False)
    enable_qsa(tight, SMALL)
    with caplog.at_level(logging.INFO, logger="kvcap.engine.scheduler"):
        got = tight.generate(prompts, long, use_tqdm=False)
    assert any("preempted" in r.message for r in caplog.records)
    _same(got, want)
    # abort one request mid-flight; its blocks go to the next request
    eng = tight.engine
    eng.add_request("x", prompts[0], long)
    eng.add_request("y", prompts[1], long)
    for _ in range(4):
        eng.step()
    eng.abort_request("x")
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    _same([outs["y"]], want[1:2])
    _same(tight.generate(prompts[2:], long, use_tqdm=False), want[2:])


def test_side_bytes_per_token():
    from kvcap.config import ModelSpec

    spec = ModelSpec.from_hf_config(TINY)
    # 3 QSA layers x (4 ring + 4 compressed rows) x 2 heads x 16 dims x 2 B / 16 tokens
    assert qsa_side_bytes_per_token(SMALL, spec, 16) == 3 * 8 * 2 * 16 * 2 // 16
    bounds = QSAConfig(layer_rule="all_but_first", first_dense=1, summary="minmax")
    assert qsa_side_bytes_per_token(bounds, spec, 16) == 3 * 8 * 2 * 16 * 2 // 16  # no ring
    ref = QSAConfig(indexer="trained")
    assert qsa_side_bytes_per_token(ref, spec, 16, index_dim=128) == 1 * 8 * 128 * 2 // 16
