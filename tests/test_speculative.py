"""Speculative decoding by prompt lookup: the proposer, the scheduler's draft chunks and their
verification, and the engine's output with drafts equal to its output without them.

The scheduler part runs against a fake model that writes every scheduled token into a fake
paged cache and reads the context back through the block table at each sampling row, with a
next-token rule that mostly repeats itself (so lookup drafts are often right, and sometimes
wrong). A draft row's context includes the drafts before it, exactly as the real forward does;
rejected drafts' cache rows must be overwritten before anyone reads them.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from scheduler_fakes import EOS, VOCAB, Cfg, next_token, reference_output, req

from kvcap.engine.block_manager import BlockManager
from kvcap.engine.model_runner import accept_draft
from kvcap.engine.ngram import NgramProposer
from kvcap.engine.request import Request, RequestStatus
from kvcap.engine.scheduler import Scheduler, SchedulerOutput
from kvcap.errors import ConfigError


def repeating(context: list[int]) -> int:
    """Mostly the token 5 back (a loop drafts can follow), sometimes a hash of everything."""
    if len(context) >= 5 and next_token(context) % 5:
        return context[-5]
    return next_token(context)


class FakeModel:
    def __init__(self, num_blocks: int, block_size: int):
        self.bs = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, int], dict[str, list[int]]]:
        sampled, accepted = {}, {}
        for c in out.chunks:
            r, bs = c.request, self.bs
            assert len(r.block_ids) * bs >= c.start + c.num_tokens
            fed = r.all_token_ids[c.start:c.start + c.num_tokens - len(c.draft)] + c.draft
            for pos, tok in zip(range(c.start, c.start + c.num_tokens), fed, strict=True):
                self.kv[r.block_ids[pos // bs]][pos % bs] = tok
            if not c.samples:
                continue
            known = r.all_token_ids[:c.start + c.num_tokens - len(c.draft)]
            rows = []
            for end in range(c.start + c.num_tokens - len(c.draft), c.start + c.num_tokens + 1):
                ctx = [self.kv[r.block_ids[p // bs]][p % bs] for p in range(end)]
                assert ctx == (known + c.draft)[:end], "cache content differs from the tokens"
                rows.append(repeating(ctx))
            if c.draft:
                accepted[r.request_id], sampled[r.request_id] = accept_draft(c.draft, rows)
            else:
                sampled[r.request_id] = rows[0]
        return sampled, accepted


def make(num_blocks: int = 64, k: int = 4, **kw) -> tuple[Scheduler, BlockManager, FakeModel]:
    cfg = Cfg(**{"max_num_batched_tokens": 64, "max_model_len": 200, **kw})
    bm = BlockManager(num_blocks, cfg.block_size)
    s = Scheduler(cfg, bm, eos_token_ids={EOS}, proposer=NgramProposer(k, 3, 1) if k else None)
    return s, bm, FakeModel(num_blocks, cfg.block_size)


def run_all(s: Scheduler, bm: BlockManager, model: FakeModel) -> list[SchedulerOutput]:
    outs = []
    while s.has_unfinished():
        assert len(outs) < 10_000
        out = s.schedule()
        assert out.num_batched_tokens <= s.max_num_batched_tokens
        for c in out.chunks:
            assert c.num_tokens == 1 + len(c.draft) if c.draft else c.samples == (
                c.start + c.num_tokens == c.request.num_tokens)
        s.update_from_output(out, *model.execute(out))
        bm.check_invariants(s.running)
        outs.append(out)
    return outs


def prefill(s: Scheduler, r: Request, first: int = 3) -> None:
    """Run `r`'s prompt through (in chunks if the budget says so) and give it token `first`."""
    s.add_request(r)
    while not r.output_token_ids:
        out = s.schedule()
        s.update_from_output(out, {r.request_id: first} if out.chunks[0].samples else {})


# --- the proposer -----------------------------------------------------------------------------
def test_proposer_copies_what_followed_the_latest_longest_match():
    p = NgramProposer(3, max_n=3, min_n=1)
    r = req("a", [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3])
    assert p.propose(r, 8) == [7, 8, 5]  # the latest "1 2 3" (not the first one, not itself)
    assert p.propose(r, 2) == [7, 8]  # the step's room
    r.output_token_ids += [7, 4]  # "7 4" never occurred; "4" neither: no match
    assert p.propose(r, 8) == []
    r.output_token_ids += [8]  # "8" was followed by 5
    assert p.propose(r, 8) == [5, 1, 2]
    p.forget("a")
    assert p.propose(r, 8) == [5, 1, 2]  # rebuilt from scratch, same answer


def test_proposer_prefers_longer_ngrams_and_respects_min_n():
    r = req("a", [1, 2, 8, 9, 2, 5, 1, 2])
    assert NgramProposer(2, 2, 1).propose(r, 4) == [8, 9]  # "1 2" beats the later "2"
    assert NgramProposer(2, 1, 1).propose(r, 4) == [5, 1]  # "2" alone: its latest occurrence
    r2 = req("b", [4, 2, 6, 8, 2])  # only the 1-gram "2" matches
    assert NgramProposer(2, 3, 2).propose(r2, 4) == []
    assert NgramProposer(2, 3, 1).propose(r2, 4) == [6, 8]


def test_prompt_keys_in_numpy_equal_the_step_keys():
    import numpy as np

    from kvcap.engine.ngram import _keys, ngram_key

    rng = random.Random(1)
    toks = [rng.randrange(2**17) for _ in range(64)]
    for n in (1, 2, 4, 16):
        count = len(toks) - n + 1
        assert _keys(np.asarray(toks, dtype=np.uint64), n, count).tolist() == \
            [ngram_key(toks[i:i + n]) for i in range(count)]


def test_proposer_incremental_equals_rebuilt():
    """Token by token (the Python keys) and from scratch (past VECTOR_FROM tokens: numpy)."""
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    inc = NgramProposer(5, 4, 1)
    r = req("a", tokens[:20])
    for t in tokens[20:]:
        got = inc.propose(r, 5)
        fresh = NgramProposer(5, 4, 1).propose(r, 5)
        assert got == fresh
        r.output_token_ids.append(t)


def _lookup_by_scan(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The proposer's rule by brute force: the latest earlier occurrence of the longest n-gram
    that ends the sequence, and up to k tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        tail = tokens[-n:]
        for e in range(len(tokens) - 1, n - 1, -1):
            if tokens[e - n:e] == tail:
                return tokens[e:e + k]
    return []


@pytest.mark.parametrize("seed", range(4))
def test_proposer_bulk_and_step_indexes_equal_a_scan(monkeypatch, seed):
    """Bursts of new tokens, some indexed in bulk (sorted arrays, merged with the dict and the
    earlier bulk), some token by token: every lookup equals the brute-force scan."""
    from kvcap.engine import ngram

    monkeypatch.setattr(ngram, "VECTOR_FROM", 8)
    rng = random.Random(seed)
    p = NgramProposer(4, 4, 1)
    r = req("a", [rng.randrange(5) for _ in range(rng.randrange(2, 30))])
    for _ in range(60):
        r.output_token_ids += [rng.randrange(5) for _ in range(rng.choice([1, 1, 2, 9, 20]))]
        assert p.propose(r, 4) == _lookup_by_scan(r.prompt_token_ids + r.output_token_ids,
                                                  4, 4, 1)
    assert p._index["a"].bulk is not None and len(p._index["a"].bulk.keys) > 0


@pytest.mark.parametrize("k, hi, lo", [(-1, 4, 2), (17, 4, 2), (4, 2, 3), (4, 17, 2), (4, 3, 0)])
def test_bad_settings_are_refused(k, hi, lo):
    with pytest.raises(ConfigError, match="num_speculative_tokens|prompt_lookup"):
        NgramProposer(k, hi, lo)


def _runner():
    from kvcap.engine.model_runner import ModelRunner

    return ModelRunner(None, None, type("P", (), {"spec": type("S", (), {"block_size": 16})})(),
                       torch.device("cpu"))


def test_verify_route_switch(monkeypatch):
    monkeypatch.setenv("KVCAP_SPEC_VERIFY", "sometimes")
    with pytest.raises(ConfigError, match="KVCAP_SPEC_VERIFY must be auto, chunk or rows"):
        _runner()
    for route in ("rows", "chunk"):
        monkeypatch.setenv("KVCAP_SPEC_VERIFY", route)
        assert _runner().verify_route == route


def test_verify_route_follows_graphs_and_rereads(monkeypatch):
    """By default drafts verify as one chunk without decode graphs (the CPU); with graphs
    (captured for 1 + K rows per request) as decode rows while the rows fit them, no prefill
    chunk shares the step and the rows' K/V re-reads stay under the bound; an explicit chunk
    keeps the graphs at max_num_seqs."""
    from kvcap.engine import cuda_graph, model_runner
    from kvcap.engine.scheduler import ScheduledChunk

    monkeypatch.delenv("KVCAP_SPEC_VERIFY", raising=False)
    captured = []

    class FakeGraphs:
        def __init__(self, model, backend, pool, device, rows, max_model_len):
            captured.append(rows)
            self.buckets = [1, 2, 4, 8, 16, rows]

        def can_run(self, num_seqs, max_seq_len):  # (the contexts below are past 2,048 on
            return num_seqs <= self.buckets[-1]      # purpose: only the rows bound here)

        def capture(self):
            pass

    monkeypatch.setattr(cuda_graph, "DecodeGraphs", FakeGraphs)
    runner = _runner()
    runner.pool.spec.values_per_token = 1024
    runner.pool.spec.num_kv_heads = 8

    def chunk(start, drafts):
        c = ScheduledChunk(req("a", [1] * start), start, 1 + len(drafts), True)
        c.draft = list(drafts)
        return c

    step = [chunk(100, [5, 6, 7]), chunk(50, [])]
    assert not runner._draft_rows(step)  # no graphs
    runner.enable_cuda_graphs(16, 2048, num_speculative_tokens=4)
    assert captured == [80] and runner._draft_rows(step)
    prefill = ScheduledChunk(req("b", [1] * 40), 0, 40, True)
    assert not runner._draft_rows(step + [prefill])
    assert not runner._draft_rows([chunk(10, [5, 6, 7, 8])] * 17)  # 85 rows > 80
    # extra reads: 3 rows x (start + 2) tokens x 1,024 K/V values against the bound
    limit = model_runner.SPEC_ROWS_MAX_EXTRA_KV_VALUES // 1024
    assert runner._draft_rows([chunk(limit // 3 - 2, [5, 6, 7])])
    assert not runner._draft_rows([chunk(limit // 3, [5, 6, 7])])
    # on a GPU: rows only while the chunk's grid (drafted requests x 8 KV heads) fills less
    # than half the SMs; requests without drafts do not count
    runner.sm_count = 132
    assert runner._draft_rows([chunk(10, [5, 6, 7, 8])] * 8 + [chunk(10, [])] * 8)
    assert not runner._draft_rows([chunk(10, [5, 6, 7, 8])] * 9)
    runner.sm_count = None
    monkeypatch.setenv("KVCAP_SPEC_VERIFY", "chunk")
    runner = _runner()
    runner.enable_cuda_graphs(16, 2048, num_speculative_tokens=4)
    assert captured == [80, 16] and not runner._draft_rows(step)


def test_graph_rows_are_bounded():
    from kvcap.engine.cuda_graph import MAX_DRAFT_GRAPH_ROWS, graph_rows

    assert graph_rows(16, 0) == 16 and graph_rows(16, 8) == 144
    assert graph_rows(64, 8) == MAX_DRAFT_GRAPH_ROWS  # not 576 rows of buckets
    assert graph_rows(512, 4) == 512  # never fewer than max_num_seqs


def test_accept_draft():
    assert accept_draft([4, 5, 6], [4, 5, 6, 9]) == ([4, 5, 6], 9)
    assert accept_draft([4, 5, 6], [4, 1, 6, 9]) == ([4], 1)
    assert accept_draft([4, 5, 6], [2, 5, 6, 9]) == ([], 2)


# --- the scheduler with drafts ----------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_outputs_equal_decoding_without_drafts(seed):
    rng = random.Random(seed)
    s, bm, model = make(num_blocks=rng.choice([24, 48, 96]), k=rng.choice([1, 3, 6]),
                        max_num_seqs=rng.choice([1, 3, 8]),
                        max_num_batched_tokens=rng.choice([8, 16, 64]), max_model_len=80)
    reqs = []
    # shared prefixes: later requests hit blocks earlier ones (with rejected drafts written
    # past their computed tokens) committed to the prefix cache
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 20))] for _ in range(2)]
    for i in range(12):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
        if rng.random() < 0.6:
            prompt = rng.choice(prefixes) + prompt[:10]
        reqs.append(req(f"r{i}", prompt, max_tokens=rng.randrange(1, 40),
                        ignore_eos=rng.random() < 0.5))
    outs = []
    for wave in (reqs[:6], reqs[6:]):  # the second wave arrives after the first finished
        for r in wave:
            s.add_request(r)
        outs += run_all(s, bm, model)
    assert bm.num_used_blocks == 0 and any(r.num_cached_prefix_tokens for r in reqs[6:])
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params, 80,
                                                      repeating)
    drafted = sum(len(c.draft) for o in outs for c in o.chunks)
    assert drafted > 0
    steps_with = sum(1 for o in outs if any(c.draft for c in o.chunks))
    assert steps_with > 0


def test_drafts_fewer_steps_and_exact_lengths():
    prompt = [3, 4, 5, 6, 7] * 4
    with_drafts, bm, model = make(k=4)
    a = req("a", prompt, max_tokens=30)
    with_drafts.add_request(a)
    n_with = len(run_all(with_drafts, bm, model))
    plain, bm2, model2 = make(k=0)
    b = req("b", prompt, max_tokens=30)
    plain.add_request(b)
    n_plain = len(run_all(plain, bm2, model2))
    assert a.output_token_ids == b.output_token_ids and len(a.output_token_ids) == 30
    assert n_with <= 0.6 * n_plain  # a loop the lookup follows: most drafts are kept


def test_draft_room_respects_max_tokens_model_len_and_budget():
    s, _, _ = make(k=8, max_num_batched_tokens=6, max_model_len=24)
    r = req("a", [3, 4, 5, 6, 7] * 4, max_tokens=3)  # 20 tokens
    prefill(s, r)  # 21 tokens, 1 output
    c = s.schedule().chunks[0]
    assert c.draft and len(c.draft) <= 1  # max_tokens 3: one draft + the sampled token
    s2, _, _ = make(k=8, max_num_batched_tokens=6, max_model_len=23)
    r2 = req("b", [3, 4, 5, 6, 7] * 4, max_tokens=50)
    prefill(s2, r2)
    assert len(s2.schedule().chunks[0].draft) == 1  # 21 tokens; max_model_len 23
    s3, _, _ = make(k=8, max_num_batched_tokens=6)
    r3 = req("c", [3, 4, 5, 6, 7] * 4, max_tokens=50)
    prefill(s3, r3)
    assert len(s3.schedule().chunks[0].draft) == 5  # the budget: 6 tokens


@pytest.mark.parametrize("params, drafts", [
    (dict(logprobs=1), True), (dict(presence_penalty=0.5), True),
    (dict(logit_bias={3: 1.0}), True), (dict(min_tokens=10), True),
    (dict(json_object=True, ignore_eos=False), True),
    (dict(json_object=True, ignore_eos=False, reasoning="qwen3"), True),
])
def test_which_requests_take_drafts(params, drafts):
    s, _, _ = make(k=4)
    prefill(s, req("a", [3, 4, 5, 6, 7] * 4, max_tokens=50, **params))
    assert bool(s.schedule().chunks[0].draft) == drafts


def test_drafts_leave_every_running_request_its_token():
    s, _, _ = make(k=8, max_num_seqs=4, max_num_batched_tokens=8)
    for i in range(4):
        s.add_request(req(f"r{i}", [3, 4, 5, 6, 7] * 2, max_tokens=50))  # 10 tokens each
    while any(not r.output_token_ids for r in s.running + list(s.waiting)):
        out = s.schedule()
        s.update_from_output(out, {c.request.request_id: 3 for c in out.chunks if c.samples})
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1", "r2", "r3"]
    assert [len(c.draft) for c in out.chunks] == [4, 0, 0, 0]  # 8 tokens: 5 + 1 + 1 + 1


def test_drafts_come_after_admissions():
    s, _, _ = make(k=8, max_num_batched_tokens=16)
    prefill(s, req("a", [3, 4, 5, 6, 7] * 2, max_tokens=50))
    s.add_request(req("b", list(range(1, 13)), max_tokens=5))  # a 12-token prompt waits
    out = s.schedule()
    a, b = out.chunks
    assert b.request.request_id == "b" and b.num_tokens == 12  # the whole prompt first
    assert len(a.draft) == 3 and out.num_batched_tokens == 16  # the drafts get the rest


def test_no_drafts_above_the_batch_size_limit():
    s, bm, model = make(k=4, max_num_seqs=4)
    s.draft_max_batch = 2
    for i in range(3):
        s.add_request(req(f"r{i}", [3, 4, 5, 6, 7] * 4, max_tokens=50))
    first = s.schedule()  # the three prompts in one step (60 of 64 tokens)
    s.update_from_output(first, {c.request.request_id: 3 for c in first.chunks})
    assert len(s.running) == 3 and not any(c.draft for c in s.schedule().chunks)
    s.finish_request(s.running[-1], RequestStatus.FINISHED_ABORTED)
    assert all(c.draft for c in s.schedule().chunks)  # two left: drafts again
    with pytest.raises(ConfigError, match="speculative_disable_by_batch_size"):
        from kvcap.config import EngineConfig

        EngineConfig(speculative_disable_by_batch_size=0).validate()


def test_drafts_never_preempt_and_stop_inside_the_kept_drafts():
    # drafts take only free blocks beyond one per running request: here none, so they fill
    # what the block opened for the next token leaves (3 slots), not the 4 found
    for num_blocks in (6, 7):
        s, bm, _ = make(num_blocks=num_blocks, k=4)
        prefill(s, req("a", [3, 4, 5, 6, 7] * 4, max_tokens=50))  # 20 tokens: 5 full blocks
        out = s.schedule()
        assert out.chunks[0].draft == [4, 5, 6] and not out.preempted
        assert bm.num_free_blocks == num_blocks - 6
    s, bm, _ = make(num_blocks=8, k=4)
    prefill(s, req("a", [3, 4, 5, 6, 7] * 4, max_tokens=50))
    assert s.schedule().chunks[0].draft == [4, 5, 6, 7]  # one spare block: all 4
    # EOS among the kept tokens ends the output there; what follows is dropped
    s2, bm2, _ = make(k=4)
    r = req("b", [3, 4, 5, 6, 7] * 4, max_tokens=50, ignore_eos=False)
    prefill(s2, r)
    c = s2.schedule()
    assert c.chunks[0].draft == [4, 5, 6, 7]
    done = s2.update_from_output(c, {"b": EOS}, {"b": [4, 5]})
    assert done == [r] and r.output_token_ids == [3, 4, 5, EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED and bm2.num_used_blocks == 0
    with pytest.raises(ValueError, match="not a prefix"):
        s3, _, _ = make(k=4)
        prefill(s3, req("c", [3, 4, 5, 6, 7] * 4, max_tokens=50))
        s3.update_from_output(s3.schedule(), {"c": 1}, {"c": [9]})


# --- the engine on the embedded model ----------------------------------------------------------
# A prompt whose continuation copies from it: the lookup finds drafts and the model keeps many.
COPY_PROMPT = ("Repeat this list exactly, one item per line.\n"
               "- apples: 3 kg\n- pears: 2 kg\n- plums: 5 kg\n- figs: 1 kg\n\nThe list again:\n")


def _scales(num_layers: int) -> dict[str, float]:
    out = {}
    for i in range(num_layers):
        out[f"model.layers.{i}.self_attn.k_scale"] = 0.011 + 0.0031 * (i % 7)
        out[f"model.layers.{i}.self_attn.v_scale"] = 0.004 + 0.0017 * (i % 5)
    return out


def _pair(model_dir, **kw):
    from kvcap import LLM

    def build(k):
        return LLM(model=str(model_dir), device="cpu", max_model_len=512, num_blocks=64,
                   num_speculative_tokens=k, prompt_lookup_max=4, prompt_lookup_min=2, **kw)

    return build(0), build(4)


@pytest.fixture(scope="module")
def llm_pair(default_model_dir):
    """Without and with drafts, in the model dtype."""
    return _pair(default_model_dir)


@pytest.fixture(scope="module")
def e4m3_pair(default_model_dir):
    return _pair(default_model_dir, kv_cache_dtype="fp8_e4m3", kv_scales=_scales(30))


def _run(llm, params):
    before = (llm.engine.num_draft_tokens, llm.engine.num_accepted_tokens)
    outs = llm.generate([COPY_PROMPT, "Count: 1, 2, 3, 4,"], params, use_tqdm=False)
    return outs, (llm.engine.num_draft_tokens - before[0],
                  llm.engine.num_accepted_tokens - before[1])


@pytest.mark.parametrize("cache, params, rows", [
    ("llm_pair", dict(temperature=0, max_tokens=40), False),
    ("llm_pair", dict(temperature=0.7, top_p=0.9, seed=11, max_tokens=40), False),
    ("e4m3_pair", dict(temperature=0.7, top_p=0.9, seed=11, max_tokens=40), False),
    ("llm_pair", dict(temperature=0.7, top_p=0.9, seed=11, max_tokens=40), True),
    ("e4m3_pair", dict(temperature=0, max_tokens=40), True),
], ids=["greedy", "seeded", "e4m3-seeded", "rows-seeded", "rows-e4m3-greedy"])
def test_engine_output_is_the_same_with_drafts(request, monkeypatch, cache, params, rows):
    """Drafts verified as one chunk (the default) or as one decode row per token
    (KVCAP_SPEC_VERIFY=rows) give the output of decoding without drafts."""
    from kvcap import SamplingParams

    plain, spec = request.getfixturevalue(cache)
    monkeypatch.setattr(spec.runner, "verify_route", "rows" if rows else "chunk")
    ref, none = _run(plain, SamplingParams(**params))
    got, (drafted, kept) = _run(spec, SamplingParams(**params))
    assert none == (0, 0)
    assert drafted > 0 and kept > 0
    for a, b in zip(ref, got, strict=True):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)


@pytest.mark.parametrize("params", [dict(temperature=0, max_tokens=48),
                                    dict(temperature=0.8, top_k=50, seed=3, max_tokens=48)],
                         ids=["greedy", "seeded"])
def test_overlap_runs_ahead_while_no_drafts_are_found(llm_pair, monkeypatch, params):
    """With the overlap forced on (CUDA's default; the same code on CPU), steps whose proposer
    found nothing launch the next ones ahead (1, 2, 4 ... in a row) and steps with drafts never
    do; the tokens are those of decoding without drafts or overlap."""
    from kvcap import SamplingParams
    from kvcap.engine import engine as engine_mod

    plain, spec = llm_pair
    prompts = [COPY_PROMPT, "Once upon a time, a fox", "Count: 1, 2, 3, 4,"]
    sp = SamplingParams(**params)
    ref = plain.generate(prompts, sp, use_tqdm=False)
    eng = spec.engine
    calls = []  # per scheduled step: (limit before it, drafted, steps run ahead so far)
    real_schedule = eng.scheduler.schedule

    def schedule():
        limit, ahead = eng._ahead_limit, eng.num_steps_ahead
        out = real_schedule()
        calls.append((limit, any(c.draft for c in out.chunks), ahead))
        return out

    monkeypatch.setattr(eng.scheduler, "schedule", schedule)
    monkeypatch.setattr(eng, "overlap", True)
    before = (eng.num_steps_ahead, eng.num_draft_tokens)
    got = spec.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(ref, got, strict=True):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert eng.num_steps_ahead > before[0] and eng.num_draft_tokens > before[1]
    assert spec.block_manager.num_used_blocks == 0
    bound = engine_mod.MAX_AHEAD_WITHOUT_DRAFTS
    for (old, drafted, ahead), (new, _, ahead_next) in zip(calls, calls[1:], strict=False):
        assert new == (0 if drafted else min(max(1, 2 * old), bound))
        assert ahead_next - ahead <= new  # steps run ahead before the proposer looked again
    assert any(drafted for _, drafted, _ in calls)


def test_engine_stop_string_inside_kept_drafts(llm_pair, monkeypatch):
    """A stop string met inside a step's kept drafts ends the output where one-token steps
    would have: the tokens after it are dropped."""
    from kvcap import SamplingParams
    from kvcap.engine.engine import Engine

    plain, spec = llm_pair
    dropped = []
    cut = Engine._drop_after_stop

    def counting(self, req, *args):
        n = len(req.output_token_ids)
        cut(self, req, *args)
        dropped.append(n - len(req.output_token_ids))

    monkeypatch.setattr(Engine, "_drop_after_stop", counting)
    full = plain.generate([COPY_PROMPT], SamplingParams(temperature=0, max_tokens=48),
                          use_tqdm=False)[0].text
    for at in range(len(full) // 4, len(full) - 4, 3):  # until one lands inside kept drafts
        if any(dropped):
            break
        stop = full[at:at + 4]
        p = SamplingParams(temperature=0, max_tokens=48, stop=[stop])
        a = plain.generate([COPY_PROMPT], p, use_tqdm=False)[0]
        b = spec.generate([COPY_PROMPT], p, use_tqdm=False)[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        p = SamplingParams(temperature=0, max_tokens=48, stop=[stop],
                           include_stop_str_in_output=True)
        assert spec.generate([COPY_PROMPT], p, use_tqdm=False)[0].text == \
            plain.generate([COPY_PROMPT], p, use_tqdm=False)[0].text
    assert any(dropped), "no stop string landed inside kept drafts: the test proves nothing"


def test_engine_penalties_bias_min_tokens_and_logprobs_with_drafts(llm_pair):
    """Rows of a draft chunk count the drafts before them as generated (penalties, min_tokens)
    and report logprobs only for the tokens kept: the same tokens, text and logprobs as
    without drafts, while the drafts are used."""
    from kvcap import SamplingParams

    plain, spec = llm_pair
    ps = [SamplingParams(temperature=0, max_tokens=24),
          SamplingParams(temperature=0, max_tokens=24, logprobs=2),
          SamplingParams(temperature=0, max_tokens=24, frequency_penalty=0.4,
                         presence_penalty=0.2, repetition_penalty=1.1),
          SamplingParams(temperature=0.8, seed=5, max_tokens=24, min_tokens=20,
                         logit_bias={13: 2.0}, logprobs=1)]
    prompts = [COPY_PROMPT] * 4
    ref = plain.generate(prompts, ps, use_tqdm=False)
    got = []
    for prompt, p in zip(prompts, ps, strict=True):  # one at a time: each must take drafts
        before = spec.engine.num_draft_tokens
        got += spec.generate([prompt], p, use_tqdm=False)
        assert spec.engine.num_draft_tokens > before, p
    for a, b in zip(ref, got, strict=True):
        assert (b.token_ids, b.text) == (a.token_ids, a.text)
        if a.logprobs is not None:
            assert len(b.logprobs) == len(b.token_ids)
            for da, db in zip(a.logprobs, b.logprobs, strict=True):
                assert da.keys() == db.keys()
                assert all(abs(da[t] - db[t]) < 1e-3 for t in da)
    assert spec.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("temperature, reasoning", [(0.0, None), (0.8, None), (0.0, "qwen3"),
                                                    (0.8, "deepseek_r1")])
def test_engine_structured_output_with_drafts(llm_pair, temperature, reasoning):
    """Each draft row's token is checked against the grammar state the drafts before it lead
    to (and replaced as one-token decoding would replace it): the same JSON as without."""
    from kvcap import SamplingParams

    plain, spec = llm_pair
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "city": {"type": "string"}, "items": {
            "type": "array", "items": {"type": "string"}}}, "required": ["name", "city", "items"]}
    prompt = ("Return this record as JSON with keys name, city and items: name Alice Smith, "
              "city Paris, items apples, pears, plums.\n"
              '{"name": "Alice Smith", "city": "Paris", "items": ["apples", "pears", "plums"]}\n'
              "Again:\n")
    # (reasoning: qwen3 answers at once when the reply does not open with <think>; with
    # deepseek_r1 the reply is thinking until </think>, which this model never writes)
    p = SamplingParams(temperature=temperature, seed=4, max_tokens=48, json_schema=schema,
                       reasoning=reasoning)
    a = plain.generate([prompt], p, use_tqdm=False)[0]
    before = spec.engine.num_accepted_tokens
    b = spec.generate([prompt], p, use_tqdm=False)[0]
    assert spec.engine.num_accepted_tokens > before
    assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    if reasoning != "deepseek_r1":
        assert json.loads(b.text).keys() == {"name", "city", "items"}


def test_server_streams_several_tokens_a_step(llm_pair):
    """Through the OpenAI server: a streamed chat with drafts (several tokens per event) and
    logprobs gives the text and logprobs of the engine without drafts; /metrics counts the
    drafts."""
    import openai
    from server_helpers import ThreadedServer, metrics

    from kvcap import SamplingParams
    from kvcap.server.app import create_app

    plain, spec = llm_pair
    msgs = [{"role": "user", "content": COPY_PROMPT}]
    ref = plain.chat(msgs, SamplingParams(temperature=0, max_tokens=40, logprobs=0),
                     use_tqdm=False)[0]
    with ThreadedServer(create_app(spec, served_model_name="spec")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        chunks = list(client.chat.completions.create(
            model="spec", messages=msgs, max_tokens=40, temperature=0, stream=True,
            logprobs=True))
        m = metrics(server.url)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    lps = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
           for t in c.choices[0].logprobs.content]
    assert len(lps) == len(ref.token_ids)
    assert all(abs(a - d[t]) < 1e-3 for a, d, t in zip(lps, ref.logprobs, ref.token_ids,
                                                        strict=True))
    assert m["kvcap_spec_decode_accepted_tokens_total"] > 0
    assert m["kvcap_spec_decode_draft_tokens_total"] >= m["kvcap_spec_decode_accepted_tokens_total"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("kv, rows", [("auto", False), ("fp8_e4m3", False), ("fp8_e4m3", True)])
def test_triton_backend_runs_draft_chunks(tmp_path, kv, rows):
    """Draft chunks take the Triton chunked-prefill route (every row sampling), or the decode
    kernels as one row per token, and the E4M3 cache write/read: the same tokens as without
    drafts, on a tiny random model."""
    from kvcap import LLM, SamplingParams

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": False, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    kw = dict(model=f"dummy:{tmp_path}", device="cpu", num_blocks=16, dtype="float32",
              attention_backend="triton", kv_cache_dtype=kv,
              kv_scales=_scales(2) if kv == "fp8_e4m3" else None, prompt_lookup_min=1)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 3]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]
    spec = LLM(**kw, num_speculative_tokens=3)
    spec.runner.verify_route = "rows" if rows else "chunk"
    assert spec.runner.backend.name == "triton"
    assert [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == ref
    assert spec.engine.num_draft_tokens > 0
