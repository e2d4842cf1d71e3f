"""On a CUDA GPU: user-facing features through the paths only CUDA takes -- decode CUDA graphs
(batch buckets, padding rows), piecewise prefill graphs (rows padded to token buckets), the
overlapped engine loop (steps launched ahead of their input tokens, pinned read-back), the fused
sampler -- against an independent reference: the same model with `enforce_eager=True` and the
serial loop (which the project keeps bit-compatible: eager steps pad to the graphs' buckets and
take the graphs' context classes), transformers on the CPU (FP32), or decoding without drafts
(FP32, where the project documents exact agreement).

tests/test_engine_gpu.py already covers: penalties / logit bias / logprobs / prompt logprobs /
JSON mode beside plain requests (graphs + look-ahead vs eager), piecewise graphs vs eager in
FP16/BF16, FP16 greedy speculative decoding (near-ties allowed), a sliding-window model. This
file adds what that leaves out: prompt logits and prompt logprobs of chunked, padded prompts;
stop strings / stop tokens / EOS / min_tokens / seeded top-k/top-p/min-p sampling with the
look-ahead; streamed outputs and aborts while a step runs ahead (and after every request was
aborted); preemption by recompute; agreement with transformers; FP32 speculative decoding with
sampling, stop strings, min_tokens, prompt logprobs and structured output on both verify routes;
prefix-cache hits (one-token tails through the decode graphs) and n > 1 style seeded choices.

Greedy token ids are compared strictly; a mismatch message gives the reference's top-2 margin
at the first divergence (a near-tie there points to rounding, anything else to a bug).

Run: pytest -m gpu tests/test_gpu_paths.py -q
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from kvcap import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# A 64-token step budget: prompts past it prefill in chunks, every prefill / mixed step pads to
# the token buckets 16, 32, 64 (piecewise graphs), and max_model_len 512 keeps one context
# class (few decode graphs to capture).
BASE = dict(model="default", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
            attention_backend="triton", kv_cache_memory_gib=1)
TEXT = ("The history of computing spans centuries, from the abacus to mechanical calculators, "
        "punched cards, vacuum tubes, transistors and integrated circuits. ") * 8
COPY = ("Repeat this list exactly, one item per line.\n- apples: 3 kg\n- pears: 2 kg\n"
        "- plums: 5 kg\n- figs: 1 kg\n\nThe list again:\n")
# logprobs of the same rows computed by the same kernels (graphs vs enforce_eager) are expected
# bit-equal; 1e-3 only absorbs a library GEMM picking another algorithm under graph capture
LP_TOL = 1e-3


def _build(**kw) -> LLM:
    llm = LLM(**{**BASE, **kw})
    r = llm.runner
    if kw.get("enforce_eager"):
        assert r.graphs is None and r.piecewise is None
        llm.engine.overlap = False  # the reference: the serial loop
    else:
        assert r.graphs is not None and r.piecewise is not None
    assert r.token_buckets == [16, 32, 64]  # (eager CUDA steps pad to them too)
    return llm


def _module_llm(**kw):
    """A module-scoped fixture of one LLM built by _build(**kw)."""
    @pytest.fixture(scope="module")
    def fixture():
        llm = _build(**kw)
        yield llm
        llm.shutdown()
    return fixture


fp16_graphs = _module_llm(dtype="float16")
fp16_eager = _module_llm(dtype="float16", enforce_eager=True)
fp32_graphs = _module_llm(dtype="float32")
fp32_spec = _module_llm(dtype="float32", num_speculative_tokens=4)


def _ids(llm: LLM, n: int) -> list[int]:
    ids = llm.tokenizer.encode(TEXT)
    assert len(ids) >= n
    return ids[:n]


def _gen(llm: LLM, prompts, params, overlap: bool = False, reset: bool = True):
    """Generate from a cold prefix cache (unless `reset=False`) with the look-ahead on or off;
    returns (outputs, steps launched ahead). Checks that nothing stays in flight or holds blocks
    once the engine is idle."""
    if reset:
        llm.block_manager.reset_prefix_cache()
    llm.engine.overlap = overlap
    before = llm.engine.num_steps_ahead
    if isinstance(prompts[0], str):
        prompts = [llm.tokenizer.encode(p) for p in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine._ahead is None, "a step launched ahead outlived the run"
    assert llm.block_manager.num_used_blocks == 0, "blocks leaked"
    return outs, llm.engine.num_steps_ahead - before


def _margin(out, k: int) -> str:
    if out.logprobs is None or k >= len(out.logprobs):
        return "no reference logprobs there"
    top = sorted(out.logprobs[k].values(), reverse=True)[:2]
    return f"reference top-2 margin {top[0] - top[1]:.4g}" if len(top) == 2 else "top-1 only"


def _same_tokens(ref, got, what: str = "") -> None:
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        if list(a.token_ids) == list(b.token_ids):
            continue
        pairs = zip(a.token_ids, b.token_ids, strict=False)  # (lengths may differ)
        k = next((j for j, (x, y) in enumerate(pairs) if x != y),
                 min(len(a.token_ids), len(b.token_ids)))
        raise AssertionError(f"{what} request {i}: tokens differ at {k} ({_margin(a, k)}):\n"
                             f"  ref {list(a.token_ids)}\n  got {list(b.token_ids)}")


def _same_outputs(ref, got, what: str = "") -> None:
    _same_tokens(ref, got, what)
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert (a.text, a.finish_reason) == (b.text, b.finish_reason), (what, i)


def _close(x, y, tol: float) -> None:
    """Two logprob lists (of dicts or None) with the same keys and values within tol."""
    assert (x is None) == (y is None)
    for dx, dy in zip(x or [], y or [], strict=True):
        assert (dx is None) == (dy is None)
        if dx is not None:
            assert dx.keys() == dy.keys()
            assert max(abs(dx[t] - dy[t]) for t in dx) <= tol, (dx, dy)


def _spy(monkeypatch, obj, name: str, record: list, what):
    orig = getattr(obj, name)

    def spied(*args, **kw):
        record.append(what(*args, **kw))
        return orig(*args, **kw)
    monkeypatch.setattr(obj, name, spied)


# --- FP16: graphs + look-ahead vs enforce_eager + the serial loop ---------------------------

def test_prompt_logprobs_and_prompt_logits_of_chunked_padded_prompts(
        fp16_graphs, fp16_eager, monkeypatch):
    """Prompts of 5-150 tokens under a 64-token budget: prompt chunks padded to 16/32/64 rows
    in the piecewise graphs, beside decode rows. prompt_logprobs, logprobs and tokens equal
    enforce_eager's; prompt_logits too; and each prompt logprob is the log-softmax of the
    prompt logits one row earlier (a padding row or a chunk boundary off by one would not be)."""
    g, e = fp16_graphs, fp16_eager
    prompts = [_ids(g, n) for n in (5, 40, 150, 33)]
    params = [SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3, logprobs=2,
                             ignore_eos=True) for _ in range(3)]
    params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))  # plain
    rows: list[int] = []
    _spy(monkeypatch, g.runner.piecewise, "run", rows, lambda ids, *a: ids.shape[0])
    ref, _ = _gen(e, prompts, params)
    got, _ = _gen(g, prompts, params, overlap=True)
    assert rows and set(rows) <= {16, 32, 64}, rows
    _same_tokens(ref, got)
    for p, a, b in zip(prompts, ref, got, strict=True):
        _close(a.logprobs, b.logprobs, LP_TOL)
        _close(a.prompt_logprobs, b.prompt_logprobs, LP_TOL)
        if b.prompt_logprobs is not None:
            assert len(b.prompt_logprobs) == len(p) and b.prompt_logprobs[0] is None
    want = e.prompt_logits(prompts[:3])
    have = g.prompt_logits(prompts[:3])
    for p, x, y, out in zip(prompts, want, have, got, strict=False):
        assert y.shape == (len(p), g.spec.vocab_size) and torch.isfinite(y).all()
        # same rows, same kernels: expected bit-equal (FP16 logits ~20: 5e-2 is a few ulps)
        assert (x - y).abs().max().item() < 5e-2
        # prompt logprob at p = log_softmax(logits at p - 1)[token p]; the generate run batched
        # the prompts differently (other buckets): FP16 hidden states may round differently;
        # a row off by one or a padding row would be off by nats
        lsm = torch.log_softmax(y.float(), dim=-1)
        for pos in range(1, len(p)):
            assert abs(out.prompt_logprobs[pos][p[pos]] - lsm[pos - 1, p[pos]].item()) < 0.1


def _stop_params(tok) -> list[SamplingParams]:
    comma = tok.encode(",")
    assert len(comma) == 1
    return [
        SamplingParams(temperature=0, max_tokens=48),  # EOS (the model ends it)
        SamplingParams(temperature=0, max_tokens=48, stop=["."]),
        SamplingParams(temperature=0, max_tokens=48, stop_token_ids=comma),
        SamplingParams(temperature=0, max_tokens=48, stop=[", 12"],
                       include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=24, min_tokens=6),  # EOS masked for 6
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=11, max_tokens=32,
                       min_tokens=3, stop=["\n"]),
        SamplingParams(temperature=1.0, min_p=0.05, seed=12, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=5),  # length, early: the batch shrinks
    ]


STOP_PROMPTS = ["The capital of France is", "Once upon a time,", "List three primary colors:",
                "Count: 1, 2, 3, 4, 5, 6,", "Write a short poem about the sea.",
                "Write a short poem about the sea.", "The capital of France is",
                "Once upon a time,"]


def test_stops_min_tokens_and_seeds_with_the_look_ahead(fp16_graphs, fp16_eager, monkeypatch):
    """EOS, stop strings (excluded and included), a stop token, min_tokens and seeded top-k /
    top-p / min-p sampling: the graphs with the look-ahead give the eager serial loop's
    tokens, texts and finish reasons (a request that stops on a token the GPU already ran ahead
    of drops that row), as do the graphs without it; decode batches shrink through the batch
    buckets (padding rows) as requests end."""
    g, e = fp16_graphs, fp16_eager
    params = _stop_params(g.tokenizer)
    buckets: list[int] = []
    _spy(monkeypatch, g.runner.graphs, "replay", buckets, lambda key, b: key[0])
    ref, _ = _gen(e, STOP_PROMPTS, params)
    serial, none_ahead = _gen(g, STOP_PROMPTS, params, overlap=False)
    got, ahead = _gen(g, STOP_PROMPTS, params, overlap=True)
    assert none_ahead == 0 and ahead > 0
    assert len(set(buckets)) > 1, buckets
    _same_outputs(ref, serial, "graphs, serial:")
    _same_outputs(ref, got, "graphs, look-ahead:")
    assert {o.finish_reason for o in ref} >= {"stop", "length"}
    for p, o in zip(params, ref, strict=True):
        if o.finish_reason == "stop":
            assert len(o.token_ids) >= p.min_tokens
            # (text made under min_tokens is not searched: it may hold a stop string)
            if p.stop and not p.include_stop_str_in_output and not p.min_tokens:
                assert not any(s in o.text for s in p.stop), o.text
            if p.include_stop_str_in_output and p.stop:
                assert o.text.endswith(tuple(p.stop)) or o.token_ids[-1] in g.runner.eos_token_ids


def test_fused_sampler_gives_the_torch_samplers_draws(fp16_graphs):
    """The same graphs and look-ahead with the fused Triton sampler off (the torch sort-based
    reference): seeded top-k / top-p / min-p requests draw the same tokens, so the ahead steps'
    step indices (seed, step) are those of the serial loop."""
    g = fp16_graphs
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=s, max_tokens=32,
                             ignore_eos=True)
              for t, k, p, m, s in ((0.8, 50, 0.9, 0.0, 1), (1.0, 0, 1.0, 0.05, 2),
                                    (0.7, 0, 0.95, 0.0, 3), (1.2, 20, 1.0, 0.0, 4))]
    prompts = STOP_PROMPTS[:4]
    fused, ahead = _gen(g, prompts, params, overlap=True)
    assert g.runner.sampler.fused and ahead > 0
    try:
        g.runner.sampler.fused = False
        torch_path, _ = _gen(g, prompts, params, overlap=False)
    finally:
        g.runner.sampler.fused = True
    _same_tokens(torch_path, fused)


def test_streaming_and_aborts_while_a_step_runs_ahead(fp16_graphs, fp16_eager):
    """Requests streamed step by step with the look-ahead on; one is aborted between steps
    while the next step, holding its row, is already on the GPU: it ends with the tokens it had
    (the ahead row is dropped), the others give the eager serial tokens, every streamed output
    is a prefix of the final one. Then every request is aborted with a step in flight, and a
    new request after that still gets the eager tokens."""
    g, e = fp16_graphs, fp16_eager
    eng = g.engine
    g.block_manager.reset_prefix_cache()
    eng.overlap = True
    p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [g.tokenizer.encode(t) for t in STOP_PROMPTS[:4]]
    ref, _ = _gen(e, prompts, p)
    alone, _ = _gen(e, prompts[2:3], p)  # (the last run's prefill is batched alone)
    for i, ids in enumerate(prompts):
        eng.add_request(f"s{i}", ids, p)  # streamed
    seen: dict[str, list] = {f"s{i}": [] for i in range(4)}
    aborted_at, steps = None, 0
    while eng.has_unfinished():
        for o in eng.step():
            seen[o.request_id].append((list(o.token_ids), o.finished, o.finish_reason))
        steps += 1
        if aborted_at is None and steps >= 6 and eng._ahead is not None:
            aborted_at = len(seen["s1"][-1][0])
            assert eng.abort_request("s1")
    assert aborted_at is not None, "no step ran ahead"
    if seen["s1"][-1][2] != "abort":  # the abort's output comes with the next step
        eng.step()
    for i, r in enumerate(ref):
        outs = seen[f"s{i}"]
        final, done, reason = outs[-1]
        assert done and all(not f for _, f, _ in outs[:-1])
        assert all(final[:len(t)] == t for t, _, _ in outs)
        if i == 1:
            assert reason == "abort" and final == list(r.token_ids)[:aborted_at]
        else:
            assert reason == "length" and final == list(r.token_ids)
    assert eng._ahead is None and g.block_manager.num_used_blocks == 0

    # every request aborted while a step runs ahead: nothing asks for another step ...
    for i, ids in enumerate(prompts[:2]):
        eng.add_request(f"t{i}", ids, p)
    while eng._ahead is None:
        assert eng.has_unfinished()
        eng.step()
    for i in range(2):
        eng.abort_request(f"t{i}")
    assert not eng.has_unfinished()
    # ... and the next run consumes the stale step first, with the same tokens
    late, _ = _gen(g, prompts[2:3], p, overlap=True)
    _same_tokens(alone, late)


@contextlib.contextmanager
def _small_pool(llm: LLM, num_blocks: int):
    """The engine's block manager swapped for one over the pool's first `num_blocks` blocks
    (the pool's null block, past them all, stays the graphs' padding block)."""
    from kvcap.engine.block_manager import BlockManager

    old = llm.block_manager
    assert num_blocks <= old.num_total_blocks
    bm = BlockManager(num_blocks, old.block_size, enable_prefix_caching=True, window=old.window)
    owners = (llm, llm.scheduler, llm.engine)
    for o in owners:
        o.block_manager = bm
    try:
        yield bm
    finally:
        for o in owners:
            o.block_manager = old


def test_preemption_by_recompute(fp16_graphs, fp16_eager, monkeypatch):
    """Six requests in a 28-block pool: requests are preempted and recomputed (piecewise prompt
    + output chunks), with the look-ahead on; tokens and the prompt logprobs of a recomputed
    request (collected again, not twice) equal the eager serial loop's."""
    prompts = [_ids(fp16_graphs, n) for n in (40, 55, 70, 45, 60, 50)]
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
              for _ in prompts]
    params[3] = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, prompt_logprobs=1)
    outs, counts = [], []
    for llm, overlap in ((fp16_eager, False), (fp16_graphs, True)):
        n: list[int] = []
        with _small_pool(llm, 28):
            _spy(monkeypatch, llm.scheduler, "_preempt", n, lambda req, out: 1)
            outs.append(_gen(llm, prompts, params, overlap=overlap)[0])
        counts.append(len(n))
    assert min(counts) > 0, counts
    _same_tokens(*outs)
    _close(outs[0][3].prompt_logprobs, outs[1][3].prompt_logprobs, LP_TOL)
    assert len(outs[1][3].prompt_logprobs) == len(prompts[3])


# --- FP32: against transformers, drafts and prefix-cache hits ------------------------------

def test_graphs_match_transformers(fp32_graphs, hf_default_model):
    """FP32 on the GPU (piecewise prompt chunks, decode graphs with padding rows, the look-ahead)
    against transformers on the CPU: prompt logits, and every generated token is transformers'
    arg-max of the teacher-forced sequence (but at a near-tie) with logprobs close to it."""
    llm = fp32_graphs
    prompts = [_ids(llm, 100), llm.tokenizer.encode("The capital of France is"),
               llm.tokenizer.encode(COPY)]
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    outs, _ = _gen(llm, prompts, p)
    plain, ahead = _gen(llm, prompts, SamplingParams(temperature=0, max_tokens=16,
                                                     ignore_eos=True), overlap=True)
    assert ahead > 0
    _same_tokens(outs, plain, "look-ahead:")
    ours = llm.prompt_logits(prompts[:1])[0]
    with torch.no_grad():
        # kvcap's kernels run FP32 dots in IEEE precision: differences are summation order
        ref = hf_default_model(torch.tensor([prompts[0]])).logits[0]
        assert (ours - ref).abs().max().item() < 1e-2
        for ids, o in zip(prompts, outs, strict=True):
            seq = torch.tensor([ids + list(o.token_ids)])
            lsm = torch.log_softmax(hf_default_model(seq).logits[0, len(ids) - 1:-1], dim=-1)
            for k, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
                top2 = lsm[k].topk(2).values
                assert tok == int(lsm[k].argmax()) or (top2[0] - top2[1]).item() < 1e-2, k
                for t, v in lp.items():
                    assert abs(v - lsm[k, t].item()) < 1e-2, (k, t)


@pytest.mark.parametrize("route", ["chunk", "rows"])
def test_speculative_decoding_in_fp32_equals_decoding_without_drafts(
        fp32_graphs, fp32_spec, route):
    """Drafts verified as one chunk (piecewise graphs) or as decode rows (decode graphs): in
    FP32 the tokens are exactly those of decoding without drafts (architecture.md) -- greedy,
    seeded top-p, a stop string inside copied text, min_tokens with prompt logprobs, JSON mode
    -- and the logprobs agree to FP32 rounding (other GEMM shapes)."""
    prompts = [COPY, "Count: 1, 2, 3, 4, 5, 6,", COPY + "- apples", COPY,
               "A JSON object describing a cat:"]
    params = [
        SamplingParams(temperature=0, max_tokens=40, logprobs=2),
        SamplingParams(temperature=0.7, top_p=0.95, seed=5, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=48, stop=["plums"]),
        SamplingParams(temperature=0, max_tokens=24, min_tokens=4, prompt_logprobs=2),
        SamplingParams(temperature=0.8, seed=9, max_tokens=40, json_object=True),
    ]
    spec = fp32_spec
    spec.runner.verify_route = route
    try:
        kept = spec.engine.num_accepted_tokens
        got, _ = _gen(spec, prompts, params, overlap=True)
        assert spec.engine.num_accepted_tokens > kept
    finally:
        spec.runner.verify_route = "auto"
    ref, _ = _gen(fp32_graphs, prompts, params, overlap=True)
    _same_outputs(ref, got, f"{route}:")
    for a, b in zip(ref, got, strict=True):
        _close(a.logprobs, b.logprobs, LP_TOL)
        _close(a.prompt_logprobs, b.prompt_logprobs, LP_TOL)
    if ref[4].finish_reason == "stop":
        json.loads(ref[4].text)


def test_prefix_cache_hits_equal_cold_runs(fp32_graphs, monkeypatch):
    """Prompts sharing a prefix, run cold and then again over the cached blocks (a 33-token
    prompt reuses 32 and computes its last token alone: a prefill token through the decode
    graph; the others compute their tail in a padded chunk), plus three seeded choices of one
    prompt as the server's n > 1 sends them (seed, seed + 1, seed + 2): in FP32 the tokens and
    logprobs are the cold run's."""
    llm = fp32_graphs
    ids = _ids(llm, 160)
    prompts = [ids[:33], ids[:70], ids[:130], ids[:17]] + [ids[:50]] * 3
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)] * 4
    params += [SamplingParams(temperature=0.9, top_p=0.9, seed=21 + j, max_tokens=12,
                              ignore_eos=True, logprobs=1) for j in range(3)]
    cold, _ = _gen(llm, prompts, params)
    hits: list[int] = []
    bm = llm.block_manager
    orig = bm.allocate_prompt

    def spy(req, use_prefix_cache=True):
        ok = orig(req, use_prefix_cache)
        if ok:
            hits.append(req.num_cached_prefix_tokens)
        return ok
    monkeypatch.setattr(bm, "allocate_prompt", spy)
    warm, _ = _gen(llm, prompts, params, reset=False)
    assert 32 in hits and max(hits) >= 128, hits
    _same_tokens(cold, warm)
    for a, b in zip(cold, warm, strict=True):
        _close(a.logprobs, b.logprobs, LP_TOL)
    assert len({tuple(o.token_ids) for o in cold[4:]}) > 1  # the choices differ
    # alone, the 33-token prompt's one-token tail is a decode-only step: the decode graph
    # computes it (then the 11 decode steps), over the cached 32 tokens' K/V
    replays: list[int] = []
    _spy(monkeypatch, llm.runner.graphs, "replay", replays, lambda key, b: b)
    hits.clear()
    tail, _ = _gen(llm, prompts[:1], params[:1], reset=False)
    assert hits == [32] and len(replays) == 12, (hits, replays)
    _same_tokens(cold[:1], tail)
    _close(cold[0].logprobs, tail[0].logprobs, LP_TOL)
