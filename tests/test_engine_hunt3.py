"""Engine / scheduler / block regressions found by a third bug hunt (tiny random model, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import test_scheduler_hunt

from kvcap import SamplingParams
from kvcap.errors import ConfigError

# test_scheduler_hunt's tiny random Llama (64 blocks of 4 tokens) and its step loop
llm = test_scheduler_hunt.llm
_drain = test_scheduler_hunt._drain


# --- prompt logits keep the decode graphs once the prompt is done ------------------------------
class _Graphs:
    """Stands in for captured decode graphs: every decode batch fits them."""

    def can_run(self, num_seqs, max_seq_len):
        return True


def test_prompt_logprobs_request_in_decode_keeps_the_decode_graphs(llm):
    """A request asking for prompt logprobs (or prompt logits) needs the eager path for the
    steps that compute its prompt rows. Its decode steps have none, yet every decode step of
    the whole batch ran eagerly (no CUDA graph) until that request finished: one
    `echo + logprobs` completion of 256 tokens took the graphs away from every request beside
    it for 256 steps."""
    from kvcap.engine.model_runner import RequestExtras
    from kvcap.engine.request import Request
    from kvcap.engine.scheduler import ScheduledChunk

    runner = llm.runner
    plain = Request("plain", [3, 4, 5], SamplingParams(temperature=0))
    scored = Request("scored", [3, 4, 5, 6], SamplingParams(temperature=0, prompt_logprobs=1))
    logits = Request("logits", [7, 8], SamplingParams(temperature=0), needs_all_prompt_rows=True)
    for r in (plain, scored, logits):
        r.output_token_ids = [9, 10]
    extras = {"plain": RequestExtras(seed=0), "scored": RequestExtras(seed=0),
              "logits": RequestExtras(seed=0, want_prompt_logits=True)}
    old = runner.graphs
    runner.graphs = _Graphs()
    try:
        decode = [ScheduledChunk(r, r.num_tokens - 1, 1, True) for r in (plain, scored, logits)]
        plan = runner.make_plan(decode, extras)
        assert plan.use_graph and not plan.prompt_rows
        # the step that computes the last prompt token still runs eagerly, with its prompt row
        last = ScheduledChunk(scored, scored.num_prompt_tokens - 1, 1, False)
        plan = runner.make_plan([decode[0], last], extras)
        assert not plan.use_graph and plan.prompt_rows == [(1, 1, 2)]
    finally:
        runner.graphs = old


# --- Engine.add_request: array prompts and wrong params types --------------------------------
def test_engine_takes_a_numpy_array_prompt(llm):
    """Engine.add_request takes numpy integer ids inside a list, but a numpy array of them (what
    a tokenizer's return_tensors="np" gives) failed on its first line with numpy's "truth
    value of an array ... is ambiguous"."""
    eng = llm.engine
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.add_request("arr", np.array([5, 9, 13, 2], dtype=np.int64), p)
    eng.add_request("list", [5, 9, 13, 2], p)
    done = _drain(eng)
    assert done["arr"] == done["list"] and len(done["arr"]) == 3
    with pytest.raises(ConfigError, match="empty"):
        eng.add_request("none", np.array([], dtype=np.int64), p)
    with pytest.raises(ConfigError, match="integers"):
        eng.add_request("floats", np.array([5.0, 9.0]), p)
    assert not eng.has_unfinished() and "none" not in eng.requests


@pytest.mark.parametrize("params", [None, {"max_tokens": 3}])
def test_engine_refuses_params_that_are_not_sampling_params(llm, params):
    """A dict or None as params was an AttributeError ('logit_bias') from inside add_request;
    LLM.generate refuses them by name, the engine (the server's entry point) now too."""
    with pytest.raises(ConfigError, match="SamplingParams"):
        llm.engine.add_request("bad-params", [5, 9, 13], params)
    assert "bad-params" not in llm.engine.requests and not llm.engine.has_unfinished()


# --- a waiting prompt's prefix hashes are computed once -------------------------------------
def test_a_waiting_prompt_is_not_rehashed_every_lookup():
    """A prompt waiting for blocks is looked up twice a step (blocks_to_admit, then
    allocate_prompt): each lookup re-hashed its whole cached prefix, ~12 ms a call for a
    128K-token one, a stall of every decode step beside it. The chained hashes are kept while
    it waits; a new request under a finished one's id gets its own."""
    from test_block_manager import BS, make_req, run_prompt

    from kvcap.engine.block_manager import BlockManager

    bm = BlockManager(64, BS)
    tokens = list(range(100, 165))  # 16 full blocks and a token
    first = make_req("first", tokens)
    run_prompt(bm, first)
    bm.free(first)  # its blocks stay cached
    calls = []
    plain_hash = bm._hash
    bm._hash = lambda parent, toks: calls.append(1) or plain_hash(parent, toks)
    again = make_req("again", tokens + [7])
    for _ in range(3):
        assert bm.blocks_to_admit(again) == 17  # the 16 cached blocks (on the free list) + 1
    assert len(calls) == 16
    assert bm.allocate_prompt(again) and again.num_computed_tokens == 16 * BS
    assert len(calls) == 16 and len(again.block_ids) == 16
    bm.free(again)
    other = make_req("again", list(range(300, 365)))  # same id, other tokens: no hit
    assert bm.allocate_prompt(other) and other.num_computed_tokens == 0
    bm.check_invariants([other])
