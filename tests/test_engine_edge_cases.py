"""Edge cases of the offline API a vLLM user hits: stop strings completed by the last token a
limit allows, stop_token_ids outside the vocabulary, NaN temperature."""

from __future__ import annotations

import pytest

from kvcap import LLM, SamplingParams
from kvcap.errors import ConfigError

PROMPT = "Count: 1, 2, 3, 4,"


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(model=str(default_model_dir), device="cpu", max_model_len=256, num_blocks=96)


def _greedy(llm, prompt, **kw):
    p = SamplingParams(temperature=0, ignore_eos=True, **kw)
    return llm.generate([prompt], p, use_tqdm=False)[0]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_completed_by_the_last_allowed_token_stops(llm, include):
    """A stop string that the max_tokens-th token completes is a stop, as on any earlier
    token (vLLM checks stop strings before the length limit): finish_reason 'stop' and the
    text cut at it, not 'length' with the stop string left in the text."""
    ref = _greedy(llm, PROMPT, max_tokens=8)
    k = 3
    text_k = llm.tokenizer.decode(ref.token_ids[:k])
    stop = text_k[-2:]  # ends exactly at token k's text
    assert stop not in llm.tokenizer.decode(ref.token_ids[:k - 1])
    cut = text_k[:text_k.index(stop)] + (stop if include else "")
    # the stop string on the last token max_tokens allows ...
    out = _greedy(llm, PROMPT, max_tokens=k, stop=[stop], include_stop_str_in_output=include)
    # ... and with room for more tokens (the reference behaviour)
    more = _greedy(llm, PROMPT, max_tokens=8, stop=[stop], include_stop_str_in_output=include)
    assert (more.finish_reason, more.text) == ("stop", cut)
    assert (out.finish_reason, out.text) == ("stop", cut)
    assert out.token_ids == ref.token_ids[:k]


def test_stop_string_completed_at_max_model_len_stops(llm):
    """The same where the context limit (max_model_len) ends the request."""
    ids = llm.tokenizer.encode(PROMPT)
    k = 3
    # left-pad with the prompt's first token so prompt + k tokens fill the context exactly
    padded = [ids[0]] * (llm.max_model_len - k - len(ids)) + ids
    base = _greedy(llm, padded, max_tokens=50)
    assert base.finish_reason == "length" and len(base.token_ids) == k
    text_k = llm.tokenizer.decode(base.token_ids)
    stop = text_k[-2:]
    if stop in llm.tokenizer.decode(base.token_ids[:k - 1]):
        pytest.skip("the padded prompt's outputs do not end a fresh stop string")
    out = _greedy(llm, padded, max_tokens=50, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == text_k[:text_k.index(stop)]


@pytest.mark.parametrize("bad", [[-1], 5, ["a"], [1.5]])
def test_bad_stop_token_ids_are_refused(bad):
    with pytest.raises(ConfigError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=bad)


@pytest.mark.parametrize("field, bad", [
    ("top_k", True), ("max_tokens", True), ("seed", False), ("min_tokens", True),
    ("logprobs", True), ("stop_token_ids", [True]), ("temperature", True),
    ("frequency_penalty", True), ("json_object", "no"), ("json_object", 1),
    ("stop", None), ("stop", 3), ("logit_bias", [(1, 2.0)]), ("logit_bias", {True: 1.0}),
    ("choice", "yes")])
def test_bools_and_wrong_containers_are_refused(field, bad):
    """True is an int to Python: top_k=True sampled with top_k 1, max_tokens=True gave one
    token, seed=False seeded with 0, and json_object="no" (truthy) turned JSON mode on. A
    stop or logit_bias of the wrong type was a TypeError / AttributeError from inside, and
    choice="yes" was the choices "y", "e", "s"."""
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: bad})


def test_stop_token_id_outside_the_vocabulary_is_refused_and_engine_keeps_serving(llm):
    """An id past the vocabulary would fail the whole step under min_tokens (its logit is
    masked by index) and could never be generated anyway: refused at add_request, as
    logit_bias ids are, and the other requests go on."""
    vocab = llm.runner.model.spec.vocab_size
    ok = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.engine.add_request("ok", llm.tokenizer.encode(PROMPT), ok)
    bad = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[vocab])
    with pytest.raises(ConfigError, match="stop_token_ids"):
        llm.engine.add_request("bad", llm.tokenizer.encode(PROMPT), bad)
    finished = []
    while llm.engine.has_unfinished():
        finished += [o for o in llm.engine.step() if o.finished]
    assert [(o.request_id, len(o.token_ids)) for o in finished] == [("ok", 4)]
    assert llm.block_manager.num_used_blocks == 0


def test_nan_temperature_is_refused():
    with pytest.raises(ConfigError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=float("nan"))


def test_stop_string_and_max_tokens_in_one_step_of_kept_drafts(default_model_dir, llm):
    """With prompt-lookup drafts one step may keep several tokens: where one of them completes
    a stop string and a later one reaches max_tokens, the output ends at the stop string, as
    one-token steps (`llm`, no drafts) end it."""
    drafting = LLM(model=str(default_model_dir), device="cpu", max_model_len=256, num_blocks=96,
                   num_speculative_tokens=4)
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"
    ref = _greedy(llm, prompt, max_tokens=12)
    texts = [llm.tokenizer.decode(ref.token_ids[:j]) for j in range(13)]
    compared = 0
    for j in range(2, 9):
        stop = texts[j][-3:]
        if stop in texts[j - 1]:
            continue
        for m in range(j, j + 4):
            want = _greedy(llm, prompt, max_tokens=m, stop=[stop])
            got = _greedy(drafting, prompt, max_tokens=m, stop=[stop])
            assert want.finish_reason == "stop" and want.text == texts[j][:texts[j].index(stop)]
            assert (got.finish_reason, got.text, got.token_ids) == (
                want.finish_reason, want.text, want.token_ids), (j, m, stop)
            compared += 1
    assert compared and drafting.engine.num_accepted_tokens > 0
