"""QSA: bugs found by a correctness hunt (each test failed before its fix)."""

from __future__ import annotations

import json

import pytest
import torch

from kvcap import LLM, SamplingParams
from kvcap.qsa.config import QSAConfig

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qsa_hunt") / "config.json"
    path.write_text(json.dumps(TINY))
    return f"dummy:{path}"


def _run_engine(model, summary: str, params: SamplingParams, overlap: bool, host_rows: bool):
    """One request through a fresh QSA LLM (so both runs get the same blocks); with
    `host_rows`, every third sampled step leaves its row to the host, as the fused sampler
    does for rows needing top-p's exact pass. Returns (tokens, side caches, steps ahead)."""
    cfg = QSAConfig(layer_rule="all_but_first", first_dense=1, topk_groups=2, summary=summary)
    llm = LLM(model=model, device="cpu", num_blocks=32, max_model_len=128,
              max_num_batched_tokens=48, qsa=cfg)
    eng, sampler = llm.engine, llm.runner.sampler
    eng.overlap = overlap  # off on CPU by default; the same scheduling code as on CUDA
    real, calls = sampler.sample, [0]

    def sample(logits, batch, resolve=True):
        tok = real(logits, batch, resolve=resolve)
        calls[0] += 1
        if host_rows and not resolve and calls[0] % 3 == 0:
            tok = tok.clone()
            tok[0] = -1
        return tok

    sampler.sample = sample
    prompt = torch.randint(0, 320, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    eng.add_request("a", prompt, params)
    tokens = None
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                tokens = o.token_ids
    side = llm.runner.backend.side
    caches = [t.clone() for i in side.layers for t in (side.layer(i).comp, side.layer(i).hi,
                                                       side.layer(i).raw) if t is not None]
    return tokens, caches, eng.num_steps_ahead


def test_overlap_drop_leaves_no_placeholder_key_in_minmax_bounds(tiny_model):
    """A step launched ahead is dropped and run again when a row of the step before came back
    to the host sampler (top-p); it had been fed a placeholder token. The min/max bounds fold
    every key written, so the placeholder's key stayed in its group's bounds: other
    selections (and tokens) than the serial loop's, in blocks that could then enter the prefix
    cache. Now the engine does not look ahead under such a backend while a request samples
    with top-p; the ring of the mean summary is overwritten in place and was never affected."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=40,
                            ignore_eos=True)
    for summary in ("minmax", "mean"):
        serial = _run_engine(tiny_model, summary, params, overlap=False, host_rows=False)
        overlapped = _run_engine(tiny_model, summary, params, overlap=True, host_rows=True)
        assert overlapped[0] == serial[0], summary
        for a, b in zip(serial[1], overlapped[1], strict=True):
            assert torch.equal(a, b), summary


def test_minmax_qsa_still_looks_ahead_without_top_p(tiny_model):
    """The fix is narrow: without top-p no row is left to the host, so steps still run ahead
    (and give the serial loop's outputs and side caches)."""
    params = SamplingParams(temperature=0.9, top_k=50, seed=3, max_tokens=24, ignore_eos=True)
    serial = _run_engine(tiny_model, "minmax", params, overlap=False, host_rows=False)
    overlapped = _run_engine(tiny_model, "minmax", params, overlap=True, host_rows=False)
    assert overlapped[2] > 10
    assert overlapped[0] == serial[0]
    for a, b in zip(serial[1], overlapped[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("flag", ["--decode", "--prompt", "--chunk", "--topk"])
def test_refrun_refuses_sizes_below_one(flag, capsys):
    """--decode 0 sliced oa[-0:], scoring every row as a decode row; the others failed deep
    inside the run: each is now a usage error before any model is built."""
    from kvcap.qsa import refrun

    with pytest.raises(SystemExit) as e:
        refrun.main([flag, "0"])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_include_tail_must_be_a_bool():
    """include_tail="no" was truthy, so taken as True."""
    from kvcap.errors import ConfigError

    with pytest.raises(ConfigError, match="include_tail must be true or false"):
        QSAConfig(include_tail="no").validate()
    assert QSAConfig(include_tail=True).validate().include_tail is True
