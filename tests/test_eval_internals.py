"""Per-layer attention capture and same-input injection on a tiny random-weight model."""

from __future__ import annotations

import json

import pytest
import torch

from kvcap.eval import heldout
from kvcap.eval.internals import AttnOutCapture, LayerInputCapture, LayerInputInjection
from kvcap.eval.metrics import tensor_error

CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
       "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
       "intermediate_size": 96, "vocab_size": 97, "max_position_embeddings": 256,
       "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    from kvcap.llm import LLM

    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(CFG))
    common = dict(model=f"dummy:{path}", device="cpu", num_blocks=32, block_size=16,
                  max_num_batched_tokens=16, enable_prefix_caching=False, seed=3)
    scales = {f"model.layers.{i}.self_attn.{t}_scale": 0.02 for i in range(3) for t in "kv"}
    return {"reference": LLM(kv_cache_dtype="fp32", **common),
            "same": LLM(kv_cache_dtype="fp32", **common),
            "e4m3": LLM(kv_cache_dtype="fp8_e4m3", kv_scales=scales, **common)}


IDS = [int(i) for i in torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(0))]


def test_capture_rows_and_chunked_injection(llms):
    ref = llms["reference"]
    with AttnOutCapture(ref.model) as cap, LayerInputCapture(ref.model) as rec:
        ref.prompt_logits([IDS])
    outs = cap.layer_outputs(len(IDS))
    inputs = rec.inputs(len(IDS))
    assert [o.shape for o in outs] == [torch.Size([40, 64])] * 3
    assert inputs[0][1] is None and inputs[1][1].shape == (40, 64)  # layer 0: no residual yet
    assert len(rec.rows[0]) == 3  # 40 tokens in chunks of 16: the injection must follow them
    same = llms["same"]
    with AttnOutCapture(same.model) as cap2, LayerInputInjection(same.model, inputs):
        same.prompt_logits([IDS])
    for a, b in zip(outs, cap2.layer_outputs(len(IDS)), strict=True):
        assert torch.equal(a, b)


def test_isolated_layer_sees_only_the_reference_stream(llms):
    """Isolated means layer i's inputs are the reference's whole stream (x and the residual
    the fused add sums into it): injecting at every layer or at the last layer alone gives
    the last layer the same attention output, whatever the arm's other layers computed."""
    ref, arm = llms["reference"], llms["e4m3"]
    with LayerInputCapture(ref.model) as rec:
        ref.prompt_logits([IDS])
    inputs = rec.inputs(len(IDS))
    outs = {}
    for name, layers in (("all", None), ("last", [2])):
        with AttnOutCapture(arm.model) as cap, LayerInputInjection(arm.model, inputs, layers):
            arm.prompt_logits([IDS])
        outs[name] = cap.layer_output(2, len(IDS))
    assert torch.equal(outs["all"], outs["last"])
    with AttnOutCapture(arm.model) as cap:  # and the injection did change what it saw
        arm.prompt_logits([IDS])
    assert not torch.equal(cap.layer_output(2, len(IDS)), outs["all"])


def test_isolated_vs_end_to_end(llms):
    summary, kl = heldout.run_heldout({"reference": llms["reference"], "e4m3": llms["e4m3"]},
                                      "reference", [_shard()], internals=True)
    arm = summary["arms"]["e4m3"]
    iso, e2e = arm["internals_isolated"]["per_layer"], arm["internals"]["per_layer"]
    assert iso[0]["cosine"] == pytest.approx(e2e[0]["cosine"], rel=1e-12)
    assert iso[0]["cosine"] < 1.0  # quantization is visible
    assert iso[2]["rel_l2"] != pytest.approx(e2e[2]["rel_l2"], rel=1e-9)
    assert len(kl["e4m3"]) == len(IDS) and arm["positions"] == len(IDS)
    assert 0.0 <= arm["top1_agreement"] <= 1.0


def test_identical_arms_score_perfectly(llms):
    summary, _ = heldout.run_heldout({"reference": llms["reference"], "same": llms["same"]},
                                     "reference", [_shard()], internals=True)
    arm = summary["arms"]["same"]
    assert arm["top1_agreement"] == 1.0
    assert arm["kl_mean"] == pytest.approx(0.0, abs=1e-12)
    assert arm["ppl_delta_pct"] == pytest.approx(0.0, abs=1e-9)
    assert arm["internals_isolated"]["min_cosine"] == pytest.approx(1.0, abs=1e-9)
    err = tensor_error(torch.ones(3), torch.ones(3))
    assert err.rel_l2 == 0.0


def _shard():
    from kvcap.eval.corpora import Shard

    return Shard("tiny", [IDS], [{"generator": "test"}])


def test_internals_through_a_cuda_runners_padded_pieces(llms):
    """A CUDA runner pads each prefill step to a token bucket and replays piecewise graphs,
    where no decoder layer is called as a module: the input capture found no rows (a
    RuntimeError once the arms had loaded), and eager, the arm's padded forward did not match
    the recorded rows. Simulated on the CPU: the buckets, and the pieces as plain calls."""
    from kvcap.engine.piecewise_graph import PiecewiseGraphs, token_buckets

    arms = {"reference": llms["reference"], "e4m3": llms["e4m3"]}
    want, _ = heldout.run_heldout(arms, "reference", [_shard()], internals=True)
    try:
        for llm in arms.values():
            runner = llm.runner
            runner.token_buckets = token_buckets(llm.config.max_num_batched_tokens)
            assert runner.token_buckets == [16]  # 40 tokens: the last chunk of 8 is padded
            runner.piecewise = PiecewiseGraphs(llm.model, runner.backend, llm.pool,
                                               torch.device("cpu"), runner.token_buckets,
                                               graphs=False)
            runner.piecewise.capture()
        got, _ = heldout.run_heldout(arms, "reference", [_shard()], internals=True)
        assert all(llm.runner.piecewise is not None for llm in arms.values())  # put back
    finally:
        for llm in arms.values():
            llm.runner.token_buckets, llm.runner.piecewise = [], None
    for key in ("internals", "internals_isolated"):
        for a, b in zip(want["arms"]["e4m3"][key]["per_layer"],
                        got["arms"]["e4m3"][key]["per_layer"], strict=True):
            assert b["cosine"] == pytest.approx(a["cosine"], rel=1e-6)
            assert b["rel_l2"] == pytest.approx(a["rel_l2"], rel=1e-4)
    assert got["arms"]["e4m3"]["kl_mean"] == pytest.approx(want["arms"]["e4m3"]["kl_mean"],
                                                           rel=1e-4)
