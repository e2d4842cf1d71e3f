"""Differential tests of the engine's scheduling and cache management on a tiny random model
(CPU, the torch attention backend): a request's greedy (or seeded) tokens must not depend on
what else runs beside it, on the pool size, the token budget, the prefix cache, speculative
decoding or the overlapped loop; and every block must go back to the pool at the end.

`engine.overlap = True` on a CPU engine runs the overlapped loop of a CUDA engine (steps
scheduled and launched before the previous step's tokens are read): on CPU the launch is
synchronous, so only the bookkeeping differs, which is what these tests check.
"""

from __future__ import annotations

import json
import random

import pytest
from test_speculative import _scales

from kvcap import LLM, SamplingParams

CFG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
       "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
       "tie_word_embeddings": False, "rope_theta": 10000.0, "eos_token_id": 1}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hunt") / "config.json"
    path.write_text(json.dumps(CFG))
    return f"dummy:{path}"


def _llm(model: str, kv: str = "auto", **kw) -> LLM:
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    return LLM(model=model, device="cpu", kv_cache_dtype=kv,
               kv_scales=_scales(2) if kv == "fp8_e4m3" else None, **kw)


def _first_new(tokens: list[int]) -> int:
    """The first index m >= 1 whose token did not occur before it."""
    return next(m for m in range(1, len(tokens)) if tokens[m] not in tokens[:m])


# --- min_tokens under the overlapped loop -------------------------------------------------------
def test_overlap_does_not_mask_a_stop_token_allowed_by_min_tokens(model):
    """min_tokens = m masks the stop tokens for the first m tokens only: the token at index m
    may stop. The step that samples it was launched ahead of the token before it, with one
    output fewer known, and masked the stop token once more: the request ran on past its
    stop."""
    llm = _llm(model)
    prompt = [5, 9, 13, 2, 7]
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = list(llm.generate([prompt], free, use_tqdm=False)[0].token_ids)
    m = _first_new(ref)
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                       stop_token_ids=[ref[m]], min_tokens=m)
    serial = llm.generate([prompt], p, use_tqdm=False)[0]
    assert list(serial.token_ids) == ref[:m + 1] and serial.finish_reason == "stop"
    llm.engine.overlap = True
    got = llm.generate([prompt], p, use_tqdm=False)[0]
    assert list(got.token_ids) == ref[:m + 1] and got.finish_reason == "stop"
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_total_blocks


# --- stop strings among kept drafts -------------------------------------------------------------
def _greedy(llm, prompt, **kw):
    p = SamplingParams(temperature=0, ignore_eos=True, **kw)
    return llm.generate([prompt], p, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def smol_pair(default_model_dir):
    kw = dict(model=str(default_model_dir), device="cpu", max_model_len=256, num_blocks=96)
    return LLM(**kw), LLM(**kw, num_speculative_tokens=4)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_before_a_stop_token_in_one_step_of_kept_drafts(smol_pair, include):
    """One step of kept drafts may complete a stop string with one token and reach a stop
    token (or EOS) with a later one: the output ends at the stop string, as one-token steps
    end it, not at the stop token with the text after the stop string."""
    plain, drafting = smol_pair
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"
    ref = _greedy(plain, prompt, max_tokens=12)
    texts = [plain.tokenizer.decode(ref.token_ids[:j]) for j in range(13)]
    compared = 0
    for j in range(2, 9):
        stop = texts[j][-3:]
        if stop in texts[j - 1]:
            continue
        for m in range(j + 1, j + 4):
            kw = dict(max_tokens=12, stop=[stop], stop_token_ids=[ref.token_ids[m - 1]],
                      include_stop_str_in_output=include)
            want = _greedy(plain, prompt, **kw)
            got = _greedy(drafting, prompt, **kw)
            assert (got.finish_reason, got.text, list(got.token_ids)) == (
                want.finish_reason, want.text, list(want.token_ids)), (j, m, stop)
            compared += 1
    assert compared and drafting.engine.num_accepted_tokens > 0


# --- seeded random scenarios: batched == solo ---------------------------------------------------
class _Tok:
    """Token id -> 1 to 3 characters of "ab c\\n": stop strings then occur often."""

    eos_token_id = None

    def __init__(self):
        r = random.Random(7)
        self.tab = ["".join(r.choice("ab c\n") for _ in range(r.randint(1, 3)))
                    for _ in range(CFG["vocab_size"])]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(self.tab[i] for i in ids)


WINDOW = 12  # the sliding-window variant's (every layer slides: blocks are released)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[bool, str]:
    out = {}
    for window in (False, True):
        cfg = dict(CFG, architectures=["MistralForCausalLM"], model_type="mistral",
                   sliding_window=WINDOW) if window else CFG
        path = tmp_path_factory.mktemp("hunt") / "config.json"
        path.write_text(json.dumps(cfg))
        out[window] = f"dummy:{path}"
    return out


_solo: dict = {}


def _reference(model: str, prompt: list[int], p: dict, mml: int):
    """(tokens, finish reason, text) of the request run alone: no prefix cache, no drafts, a
    pool that holds it whole, one-token steps."""
    key = (model, tuple(prompt), repr(sorted(p.items())), mml)
    if key not in _solo:
        llm = _solo.get((model, mml))
        if llm is None:
            llm = _solo[(model, mml)] = LLM(model=model, device="cpu", num_blocks=256,
                                            block_size=16, max_model_len=mml,
                                            enable_prefix_caching=False)
            llm.engine.tokenizer = _Tok()
        o = llm.generate([prompt], SamplingParams(**p), use_tqdm=False)[0]
        _solo[key] = (list(o.token_ids), o.finish_reason, o.text)
    return _solo[key]


def _scenario(seed: int, models: dict[bool, str]) -> list:
    """Requests with shared prefixes, random arrival steps and aborts through one engine of a
    random configuration (pool down to one sequence's worth, budget down to one block,
    speculative decoding, the overlapped loop); returns what differs from running each alone."""
    from kvcap.kv_cache.spec import peak_blocks

    rng = random.Random(seed)
    window = rng.random() < 0.25
    bs = rng.choice([4, 8, 16])
    mml = rng.choice([64, 128, 200])
    budget = max(rng.choice([bs, 2 * bs, 32, 64]), bs)
    nb = (peak_blocks(mml, bs, WINDOW, budget) + rng.choice([0, 1, 2, 4]) if window
          else -(-mml // bs) + rng.choice([0, 0, 1, 2, 5, 100]))
    cfg = dict(block_size=bs, num_blocks=nb, max_num_batched_tokens=budget, max_model_len=mml,
               max_num_seqs=rng.choice([1, 2, 4, 8]), enable_prefix_caching=rng.random() < 0.8,
               num_speculative_tokens=rng.choice([0, 0, 2, 4]), prompt_lookup_min=1)
    llm = LLM(model=models[window], device="cpu", **cfg)
    eng, bm = llm.engine, llm.block_manager
    eng.overlap = rng.random() < 0.5
    eng.tokenizer = _Tok()
    base = [rng.randrange(2, 64) for _ in range(80)]
    loop = [rng.randrange(2, 64) for _ in range(5)]
    reqs = {}
    for i in range(rng.randint(1, 14)):
        kind = rng.random()
        if kind < 0.4:
            prompt = base[:rng.randint(1, 60)]
        elif kind < 0.6:
            prompt = (loop * 20)[:rng.randint(3, 50)]
        elif kind < 0.8:
            prompt = base[:rng.choice([bs, 2 * bs, 3 * bs])] + [
                rng.randrange(2, 64) for _ in range(rng.randint(0, 10))]
        else:
            prompt = [rng.randrange(2, 64) for _ in range(rng.randint(1, 40))]
        p = dict(temperature=0.0, max_tokens=rng.choice([1, 2, 5, 20, 60, 150]),
                 ignore_eos=rng.random() < 0.5)
        if rng.random() < 0.3:
            p["stop_token_ids"] = [rng.randrange(2, 64) for _ in range(2)]
        if rng.random() < 0.3:
            p["stop"] = ["".join(rng.choice("ab c\n") for _ in range(rng.randint(2, 4)))]
            p["include_stop_str_in_output"] = rng.random() < 0.5
        if rng.random() < 0.2:
            p["min_tokens"] = min(p["max_tokens"], rng.randint(0, 5))
        if rng.random() < 0.3:
            p.update(temperature=0.8, seed=rng.randrange(1000))
        if rng.random() < 0.15:
            p["logprobs"] = 2
        if rng.random() < 0.1:
            p["prompt_logprobs"] = 1
        reqs[f"r{i}"] = dict(prompt=prompt[:mml - 1], p=p, arrive=rng.randint(0, 15),
                             abort=rng.randint(1, 30) if rng.random() < 0.15 else None)
    done, streamed, step = {}, {}, 0
    while step <= 15 or eng.has_unfinished():
        for rid, r in reqs.items():
            if r["arrive"] == step:
                eng.add_request(rid, r["prompt"], SamplingParams(**r["p"]))
            if r["abort"] is not None and r["arrive"] + r["abort"] == step:
                eng.abort_request(rid)
        for o in eng.step():
            streamed.setdefault(o.request_id, []).append(list(o.token_ids))
            assert o.request_id not in done
            if o.finished:
                done[o.request_id] = o
        bm.check_invariants(llm.scheduler.running)
        step += 1
        assert step < 5000, "a request starved"
    assert bm.num_free_blocks == bm.num_total_blocks  # nothing leaked
    assert not eng.requests and not eng.extras
    assert llm.scheduler.proposer is None or not llm.scheduler.proposer._index
    bad = []
    for rid, r in reqs.items():
        o = done[rid]
        want, why, text = _reference(models[window], r["prompt"], r["p"], mml)
        got = list(o.token_ids)
        if o.finish_reason == "abort":  # what it made before the abort
            if r["abort"] is None or got != want[:len(got)]:
                bad.append((rid, "abort", got, want, o.error))
            continue
        if all(s == got[:len(s)] for s in streamed[rid]) is False:
            bad.append((rid, "streamed tokens are not a prefix of the final ones"))
        if (got, o.finish_reason, o.text) != (want, why, text):
            bad.append((rid, r["prompt"], r["p"], (got, o.finish_reason, o.text),
                        (want, why, text)))
        if r["p"].get("logprobs") is not None and len(o.logprobs) != len(got):
            bad.append((rid, "logprobs", len(o.logprobs), len(got)))
    return bad


@pytest.mark.parametrize("seed", range(40))
def test_batched_requests_equal_solo_requests(models, seed):
    assert _scenario(seed, models) == []


class _Chars:
    """A character per token."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(0x100 + i) for i in ids)


def test_stop_string_under_min_tokens_is_passed_over_with_or_without_drafts(model):
    """Text made under min_tokens is passed over, as vLLM does: a stop string must end past
    it. The search's look-back (a few characters, for strings that straddle the last search's
    end) found a string that lay wholly in that text on the first search at min_tokens, so
    the output stopped there (one-token steps) or after the token that completed it, shorter
    than min_tokens (a step of drafts). A string straddling into the min_tokens-th token
    still stops it."""
    plain = _llm(model)
    drafting = _llm(model, num_speculative_tokens=3, prompt_lookup_min=1)
    plain.engine.tokenizer = drafting.engine.tokenizer = _Chars()
    prompt = list(range(2, 64, 3))
    n = 16
    ref = list(plain.generate([prompt], SamplingParams(temperature=0, max_tokens=n,
                                                       ignore_eos=True),
                              use_tqdm=False)[0].token_ids)
    chars = _Chars().decode
    compared = passed_over = 0
    for j in range(1, 12):
        if ref[j] in ref[:j]:
            continue
        cases = [([chars(ref[j:j + 1])], j + 2),       # wholly under min_tokens = j + 2
                 ([chars(ref[j - 1:j + 1])], j + 1)]   # ends in the (j + 1)-th token
        for stop, least in cases:
            p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop=stop,
                               min_tokens=least)
            # one-token steps: the first match that ends in a token at index >= least - 1
            ends = [k for k in range(least - 1, n) if chars(ref[:k + 1]).endswith(stop[0])]
            size = ends[0] + 1 if ends else n
            want = plain.generate([prompt], p, use_tqdm=False)[0]
            got = drafting.generate([prompt], p, use_tqdm=False)[0]
            assert (len(want.token_ids), want.finish_reason) == (
                size, "stop" if ends else "length"), (j, stop)
            assert (list(got.token_ids), got.text, got.finish_reason) == (
                list(want.token_ids), want.text, want.finish_reason), (j, stop)
            passed_over += least == j + 2 and size != j + 2
            compared += 1
    assert compared >= 6 and passed_over >= 2 and drafting.engine.num_draft_tokens > 0


def test_first_stop_string_completed_in_a_step_of_kept_drafts_wins(model):
    """Stop strings "B" and "ABC" over the output "...ABC...": one-token steps stop at "B"
    (completed first). A step of kept drafts completing both searched its whole text at once
    and took the string that starts first, "ABC": one token more, less text."""
    plain = _llm(model)
    drafting = _llm(model, num_speculative_tokens=4, prompt_lookup_min=1)
    plain.engine.tokenizer = drafting.engine.tokenizer = _Chars()
    prompt = [41, 9, 33, 39, 42, 23, 56, 14, 17, 3, 48, 19, 9]
    ref = list(plain.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                       ignore_eos=True),
                              use_tqdm=False)[0].token_ids)
    for j in range(18):
        p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                           stop=[_Chars().decode(ref[j + 1:j + 2]),
                                 _Chars().decode(ref[j:j + 3])])
        want = plain.generate([prompt], p, use_tqdm=False)[0]
        got = drafting.generate([prompt], p, use_tqdm=False)[0]
        assert (list(got.token_ids), got.text, got.finish_reason) == (
            list(want.token_ids), want.text, want.finish_reason), j
    assert drafting.engine.num_accepted_tokens > 0


# --- aborts while a step runs ahead ------------------------------------------------------------
def test_abort_of_every_request_drops_the_step_run_ahead(model):
    """Aborting every request while a step runs ahead left that step pending with the engine
    idle (architecture.md: nothing stays in flight when the engine idles): the next request's
    first step was the stale one."""
    llm = _llm(model)
    eng = llm.engine
    eng.overlap = True
    ref = list(llm.generate([[4, 8, 15]], SamplingParams(temperature=0, max_tokens=6,
                                                         ignore_eos=True),
                            use_tqdm=False)[0].token_ids)
    eng.add_request("a", [5, 9, 13, 2, 7], SamplingParams(temperature=0, max_tokens=50,
                                                          ignore_eos=True))
    while eng._ahead is None:
        eng.step()
    assert eng.abort_request("a")
    assert eng._ahead is None and not eng.has_unfinished()
    eng.step()  # reports the abort
    got = llm.generate([[4, 8, 15]], SamplingParams(temperature=0, max_tokens=6,
                                                    ignore_eos=True), use_tqdm=False)
    assert list(got[0].token_ids) == ref
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_total_blocks
