"""Logit bias and repetition / presence / frequency penalties: the vectorised adjustment against
a per-element loop, and greedy decoding through the engine against a step-by-step loop that
re-scores the whole sequence (teacher-forced logits) and applies the penalties by hand."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvcap import LLM, SamplingParams
from kvcap.errors import ConfigError
from kvcap.sampling.penalties import PenaltyState, adjust_logits


def reference(row: torch.Tensor, sp: SamplingParams, prompt: list[int], out: list[int],
              stops: tuple[int, ...] = ()):
    """One row, one element at a time, in the documented order."""
    row = row.clone()
    for tok, b in (sp.logit_bias or {}).items():
        row[tok] += b
    counts = Counter(out)
    for tok in set(prompt) | set(out):
        x = float(row[tok])
        row[tok] = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
    for tok, c in counts.items():
        row[tok] -= sp.presence_penalty + sp.frequency_penalty * c
    if len(out) < sp.min_tokens:
        for tok in stops:
            row[tok] = float("-inf")
    return row


def test_adjust_logits_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g) * 3
    cases = {
        0: SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
        2: SamplingParams(repetition_penalty=1.3, logit_bias={3: 5.0, 49: -100.0}),
        3: SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=2.0,
                          logit_bias={7: 1.5}, min_tokens=10, max_tokens=20),
        4: SamplingParams(min_tokens=9, max_tokens=20),  # 9 generated: no longer masked
    }
    stops = (2, 7, 31)
    seqs = {r: (torch.randint(0, 50, (12,), generator=g).tolist(),
                torch.randint(0, 50, (9,), generator=g).tolist()) for r in cases}
    states = []
    for r in cases:
        st = PenaltyState(stops=list(stops))
        prompt, out = seqs[r]
        st.update(prompt, out[:4])  # counts grow a token at a time in the engine
        st.update(prompt, out)
        states.append(st)
    got = adjust_logits(logits, list(cases), list(cases.values()), states)
    for r in range(5):
        want = reference(logits[r], cases[r], *seqs[r], stops) if r in cases else logits[r]
        torch.testing.assert_close(got[r], want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, logits)  # a copy was adjusted, the input was not
    assert torch.equal(logits, torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(presence_penalty=2.5), "presence_penalty must be in"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a positive number"),
    (dict(logit_bias={5: 101.0}), "logit_bias values must be in"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens must be an integer in"),
])
def test_bad_penalties_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(model=str(default_model_dir), device="cpu", max_model_len=256, num_blocks=64)


def test_greedy_with_penalties_matches_rescoring_by_hand(llm):
    prompt = llm.tokenizer.encode("List the numbers: one, two, three, one, two,")
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=0.7,
                        frequency_penalty=0.4, repetition_penalty=1.2,
                        logit_bias={prompt[-1]: -3.0})
    got = llm.generate([prompt], sp, use_tqdm=False)[0].token_ids
    out: list[int] = []
    for _ in range(10):  # the last row of a full re-score predicts the next token
        logits = llm.generate([prompt + out], SamplingParams(temperature=0, max_tokens=1),
                              use_tqdm=False, want_prompt_logits=True)[0].prompt_logits[-1]
        out.append(int(torch.argmax(reference(logits.float(), sp, prompt, out))))
    assert got == out
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0].token_ids
    assert plain != got  # the penalties changed the output


def test_logit_bias_forces_a_token_and_logprobs_stay_raw(llm):
    tok = llm.tokenizer.encode(" banana")[0]
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True,
                        logit_bias={tok: 100.0}, logprobs=0)
    out = llm.generate(["Hello"], sp, use_tqdm=False)[0]
    assert out.token_ids == [tok] * 5
    assert all(d[tok] < -1.0 for d in out.logprobs)  # the model's own probability, unbiased
    with pytest.raises(ConfigError, match="logit_bias token ids must be in"):
        llm.engine.add_request("x", [1, 2], SamplingParams(logit_bias={10**6: 1.0}))


def test_min_tokens_holds_back_eos_and_stop_strings(llm):
    msgs = [{"role": "user", "content": "Say hi"}]
    free = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 40  # it ends by itself
    n = len(free.token_ids) + 5
    held = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64, min_tokens=n),
                    use_tqdm=False)[0]
    eos = llm.runner.eos_token_ids
    assert len(held.token_ids) >= n and not eos & set(held.token_ids[:n])
    assert held.token_ids[:len(free.token_ids) - 1] == free.token_ids[:-1]  # same until EOS
    stop = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64, min_tokens=n,
                                         stop=[free.text[:2]]), use_tqdm=False)[0]
    assert len(stop.token_ids) >= n  # the stop string at the very start was not applied,
    assert stop.text.startswith(free.text[:2])  # nor found there once min_tokens had passed
