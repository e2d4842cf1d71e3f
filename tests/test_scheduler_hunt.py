"""Scheduler / block / engine-loop regressions found by a bug hunt (tiny random model on CPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvcap import LLM, SamplingParams
from kvcap.errors import ConfigError

CFG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
       "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
       "tie_word_embeddings": False, "rope_theta": 10000.0, "eos_token_id": 1}


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = tmp_path_factory.mktemp("sched_hunt") / "config.json"
    path.write_text(json.dumps(CFG))
    return LLM(model=f"dummy:{path}", device="cpu", num_blocks=64, block_size=4)


def _drain(eng) -> dict[str, list[int]]:
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = list(o.token_ids)
    return done


@pytest.mark.parametrize("bad", [[3.0, 4.0, 5.0, 6.0, 7.0, 8.0], [True, 4, 5, 6, 7, 8],
                                 [3, 4, 5, 6, 7, 8.5]])
def test_engine_refuses_non_integer_prompt_ids_and_keeps_serving(llm, bad):
    """Engine.add_request (a documented entry point) took float and bool token ids: the range
    check passes 3.0 and True. The first step then crashed inside the block manager's prefix
    hashing (array('q') refuses floats), and the request stayed at the head of the waiting
    queue, so every later step crashed too: the engine was wedged for every request."""
    eng = llm.engine
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.add_request("ok", [3, 4, 5, 6, 7, 8, 9], p)
    with pytest.raises(ConfigError, match="token ids"):
        eng.add_request("bad", bad, p)
    assert "bad" not in eng.requests
    done = _drain(eng)
    assert list(done) == ["ok"] and len(done["ok"]) == 3
    assert llm.block_manager.num_used_blocks == 0


def test_engine_takes_numpy_integer_prompt_ids(llm):
    """Integers of numpy's types are token ids (as LLM.generate takes them)."""
    eng = llm.engine
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ref = llm.generate([[3, 4, 5, 6, 7, 8, 9]], p, use_tqdm=False)[0]
    eng.add_request("np", list(np.arange(3, 10, dtype=np.int64)), p)
    assert _drain(eng) == {"np": list(ref.token_ids)}


def test_generate_after_an_interrupted_generate_counts_only_its_own_requests(llm, monkeypatch):
    """An interrupted generate aborts its unfinished requests; the engine reports them at its
    next step, inside the next generate, which counted them in its progress bar (3 of 2)."""
    import kvcap.llm as llm_module

    eng, real_step = llm.engine, llm.engine.step
    calls = []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step()

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    monkeypatch.setattr(eng, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13]], params, use_tqdm=False)
    monkeypatch.setattr(eng, "step", real_step)

    counted = []

    class CountingBar:
        def __init__(self, *a, **k):
            pass

        def update(self, n):
            counted.append(n)

        def close(self):
            pass

    monkeypatch.setattr(llm_module, "tqdm", CountingBar)
    outs = llm.generate([[3, 4, 5, 6], [7, 8, 9, 10]], params)
    assert sum(counted) == 2
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert not eng.has_unfinished() and not eng.requests
