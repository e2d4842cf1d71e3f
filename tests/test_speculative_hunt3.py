"""Speculative decoding by prompt lookup: bugs found by a third hunt (stop strings and
min_tokens in steps of kept drafts whose text the detokenizer keeps back; prompt logits of
drafts verified as decode rows).

A step of kept drafts must end a request where one-token steps end it: same tokens, text and
finish reason. One-token steps search each token's text for stop strings once the detokenizer
releases it (a token that ends mid-character is kept back until the character completes) and
pass over the text made under min_tokens. The tests below run a tiny random Llama (CPU) with
and without drafts, under a byte-level tokenizer stand-in whose table is chosen from where the
drafting run's steps begin and end, so that a stop string or a kept-back character falls
inside a step of several tokens.
"""

from __future__ import annotations

import json

import pytest

from kvcap import LLM, SamplingParams

CFG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
       "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
       "tie_word_embeddings": False, "rope_theta": 10000.0, "eos_token_id": 1}
PROMPT = [41, 9, 33, 39, 42, 23, 56, 14, 17, 3, 48, 19, 9]
N = 24  # tokens generated


class _Bytes:
    """A byte-level tokenizer stand-in: each token is some bytes ("a" unless listed), decoded
    together as UTF-8 (an incomplete or stray byte renders as U+FFFD, as byte-level BPE's)."""

    eos_token_id = None

    def __init__(self, table: dict[int, bytes]):
        self.table = table

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return b"".join(self.table.get(i, b"a") for i in ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("hunt3") / "config.json"
    path.write_text(json.dumps(CFG))
    kw = dict(model=f"dummy:{path}", device="cpu", num_blocks=64, block_size=4,
              max_model_len=128)
    return LLM(**kw), LLM(**kw, num_speculative_tokens=4, prompt_lookup_min=1)


def _steps(llm: LLM) -> tuple[list[int], list[tuple[int, int]]]:
    """The drafting run's output without stops, and each step's (tokens before, after)."""
    eng = llm.engine
    eng.add_request("steps", PROMPT, SamplingParams(temperature=0, max_tokens=N,
                                                    ignore_eos=True))
    lens = [0]
    while eng.has_unfinished():
        for o in eng.step():
            lens.append(len(o.token_ids))
            ids = list(o.token_ids)
    return ids, list(zip(lens, lens[1:], strict=False))


def _drafted(steps: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The steps that kept drafts (more than one token)."""
    return [(b, e) for b, e in steps if e - b >= 2]


def _before_a_held_last(ids: list[int], steps: list[tuple[int, int]]):
    """(k, last, e) for each earlier token k of a drafted step ending at e whose last token is
    `last`, where neither k's nor last's id came before (so the table's entries for them
    touch no earlier token)."""
    for b, e in _drafted(steps):
        last = ids[e - 1]
        for k in range(b, e - 1):
            if not (ids[k] in ids[:k] or ids[k] == last or last in ids[:k]):
                yield k, last, e


def _same(pair, table: dict[int, bytes], **kw) -> None:
    plain, drafting = pair
    plain.engine.tokenizer = drafting.engine.tokenizer = _Bytes(table)
    p = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, **kw)
    want = plain.generate([PROMPT], p, use_tqdm=False)[0]
    got = drafting.generate([PROMPT], p, use_tqdm=False)[0]
    assert (list(got.token_ids), got.text, got.finish_reason) == (
        list(want.token_ids), want.text, want.finish_reason), (table, kw)


def test_min_tokens_text_crossed_in_a_step_of_kept_drafts_stays_passed_over(pair):
    """A step of kept drafts that crosses min_tokens worked out the text made under it but did
    not keep it: the next step's look-back searched with the older, shorter one and stopped on
    a stop string lying wholly under min_tokens (text and tokens cut short)."""
    ids, steps = _steps(pair[1])
    compared = 0
    for b, e in _drafted(steps):
        for k in range(b, e - 1):  # "Q" at token k, under min_tokens = k + 2 < e
            if ids[k] in ids[:k] or e > k + 4:  # (first "Q"; within the next look-back)
                continue
            _same(pair, {ids[k]: b"Q"}, stop=["Q"], min_tokens=k + 2)
            compared += 1
    assert compared


def test_stop_string_before_a_kept_back_character_in_one_step(pair):
    """A step of kept drafts whose last token starts a character: the detokenizer keeps the
    step's text back, and a stop string an earlier token of the step completed was missed
    until the next step, which kept the tokens after it (one-token steps stop at it)."""
    ids, steps = _steps(pair[1])
    cases = list(_before_a_held_last(ids, steps))
    for k, last, _ in cases:
        for include in (False, True):
            _same(pair, {ids[k]: b"Q", last: b"\xc3"}, stop=["Q"],
                  include_stop_str_in_output=include)
    assert cases


def test_stop_string_in_a_token_that_ends_mid_character(pair):
    """A token completing a stop string and starting a character ("Q\\xc3"): one-token steps
    see the stop string once the next token releases the text, and stop after that token. A
    step of kept drafts searched each earlier token's full decode and stopped one token
    sooner."""
    ids, steps = _steps(pair[1])
    compared = 0
    for b, e in _drafted(steps):
        for k in range(b, e - 1):  # token k + 1 is in the same step
            if ids[k] in ids[:k] or ids[k + 1] == ids[k]:
                continue
            _same(pair, {ids[k]: b"Q\xc3"}, stop=["Q"])
            compared += 1
    assert compared


def test_min_tokens_text_of_a_kept_back_step_is_passed_over(pair):
    """A step of kept drafts under min_tokens whose last token starts a character: the text
    under min_tokens was taken as the kept-back text, shorter than one-token steps had it, so a
    stop string an earlier token of the step made (under min_tokens) stopped the next step."""
    ids, steps = _steps(pair[1])
    cases = list(_before_a_held_last(ids, steps))
    for k, last, e in cases:
        _same(pair, {ids[k]: b"Q", last: b"\xc3"}, stop=["Q"], min_tokens=e + 1)
    assert cases


def test_prompt_logits_with_drafts_verified_as_decode_rows(pair, monkeypatch):
    """generate(want_prompt_logits=True): a prompt whose last chunk is its last token takes
    drafts there; verified as decode rows (KVCAP_SPEC_VERIFY=rows, and the default with CUDA
    graphs) the chunk skipped the prompt-row check, so that token's row of the prompt logits
    was lost ([T - 1, V])."""
    plain, drafting = pair
    plain.engine.tokenizer = drafting.engine.tokenizer = None
    for llm in pair:  # the prompt's first chunk is 8 tokens, its second 1
        monkeypatch.setattr(llm.scheduler, "max_num_batched_tokens", 8)
    monkeypatch.setattr(drafting.runner, "verify_route", "rows")
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5]
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = plain.generate([prompt], p, use_tqdm=False, want_prompt_logits=True)[0]
    before = drafting.engine.num_draft_tokens
    got = drafting.generate([prompt], p, use_tqdm=False, want_prompt_logits=True)[0]
    assert drafting.engine.num_draft_tokens > before
    assert list(got.token_ids) == list(want.token_ids)
    assert got.prompt_logits.shape == want.prompt_logits.shape == (len(prompt), 64)
    assert (got.prompt_logits - want.prompt_logits).abs().max() < 1e-4


def test_min_tokens_text_stays_passed_over_while_the_text_is_kept_back(pair):
    """After a step of kept drafts whose text the detokenizer keeps back (its last token is a
    stray byte), a one-token step under min_tokens whose text is still kept back took that
    lagging text as the text under min_tokens, shorter than one-token steps had released: a
    stop string the drafts made under min_tokens then stopped the output once text came."""
    ids, steps = _steps(pair[1])
    compared = 0
    for b, e in _drafted(steps):
        if (e, e + 1) not in steps:  # a one-token step follows
            continue
        for k in range(b, e - 1):
            if ids[k] in ids[:k] or ids[k] in (ids[e - 1], ids[e]):
                continue
            _same(pair, {ids[k]: b"Q", ids[e - 1]: b"\xff", ids[e]: b"\xff"}, stop=["Q"],
                  min_tokens=e + 2)
            compared += 1
    assert compared
