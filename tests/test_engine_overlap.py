"""Engine overlap (a decode step launched before the previous step's tokens are read back)
gives exactly the serial loop's outputs, frees every block, and drops a step that was fed a
token the host had to sample. Runs on CPU, where the overlap is off by default and forced on
here: the device-side token feed and the scheduling ahead are the same code as on CUDA."""

from __future__ import annotations

import pytest

from kvcap import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(default_model_dir):
    # 24 blocks of 16 tokens: long runs grow new blocks while scheduled ahead, and the five
    # concurrent requests below run the pool close to full.
    return LLM(model=str(default_model_dir), device="cpu", max_model_len=160, num_blocks=24,
               max_num_seqs=4)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there",
           "List three colours:", "1, 2, 3, 4,"]


def _params(stop_tok: int | None) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=0.5,
                       repetition_penalty=1.1, logit_bias={13: 2.0}),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=11, max_tokens=33,
                       ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, min_p=0.05, seed=5, max_tokens=50),
        SamplingParams(temperature=0, max_tokens=29, ignore_eos=True,
                       stop_token_ids=[stop_tok] if stop_tok is not None else []),
        SamplingParams(temperature=0, max_tokens=130, ignore_eos=True, stop=[" 23,"]),
    ]


def _run(llm: LLM, overlap: bool, params: list[SamplingParams], late_abort: bool = False):
    """Two requests first, three more arriving mid-run, one aborted mid-run."""
    eng = llm.engine
    eng.overlap = overlap
    eng.num_steps_ahead = 0
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    for i in range(2):
        eng.add_request(f"r{i}", ids[i], params[i])
    outs, steps = {}, 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
            elif late_abort and o.request_id == "r2" and len(o.token_ids) == 10:
                eng.abort_request("r2")  # (by progress: arrivals may start a step later)
        steps += 1
        if steps == 3:
            for i in range(2, 5):
                eng.add_request(f"r{i}", ids[i], params[i])
    eng.overlap = False
    assert llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_invariants([])
    return outs, eng.num_steps_ahead


@pytest.fixture(scope="module")
def plain_serial(llm) -> dict:
    """The serial loop on `_params(None)`: both tests' starting point, run once."""
    return _run(llm, False, _params(None))[0]


def _same(a, b) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        x, y = a[rid], b[rid]
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason), rid
        assert (x.logprobs is None) == (y.logprobs is None)
        if x.logprobs is not None:
            assert [sorted(d) for d in x.logprobs] == [sorted(d) for d in y.logprobs]


def test_overlap_matches_serial_loop(llm, plain_serial):
    # stop on a token the greedy request really produces (its 7th), to stop mid-stream
    stop_tok = plain_serial["r3"].token_ids[6]
    assert plain_serial["r4"].finish_reason == "stop" and len(plain_serial["r4"].token_ids) < 100
    params = _params(stop_tok)
    serial, none_ahead = _run(llm, False, params, late_abort=True)
    overlapped, ahead = _run(llm, True, params, late_abort=True)
    assert none_ahead == 0 and ahead > 20
    _same(serial, overlapped)
    assert serial["r3"].finish_reason == "stop" and serial["r2"].finish_reason == "abort"


def test_step_fed_a_host_sampled_token_is_dropped(llm, plain_serial, monkeypatch):
    params = _params(None)
    sampler = llm.runner.sampler
    real = sampler.sample
    calls = {"n": 0}

    def leave_row_to_host(logits, batch, resolve=True):
        tok = real(logits, batch, resolve=resolve)
        calls["n"] += 1
        if not resolve and calls["n"] % 3 == 0:
            tok = tok.clone()
            tok[0] = -1  # as the fused kernel does for a row outside its candidates
        return tok

    monkeypatch.setattr(sampler, "sample", leave_row_to_host)
    dropped0 = llm.engine.num_ahead_dropped
    overlapped, ahead = _run(llm, True, params)
    assert ahead > 0 and llm.engine.num_ahead_dropped > dropped0
    _same(plain_serial, overlapped)
