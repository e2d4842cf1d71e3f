"""Piecewise CUDA graphs (kvcap.engine.piecewise_graph): the forward cut at its attentions, with
the cross-piece tensors in static buffers and the rows padded to a token bucket, computes what
the model's own forward computes -- here with the pieces as plain calls (the graphs need a GPU:
tests/test_engine_gpu.py replays them)."""

from __future__ import annotations

import pytest
import torch

from kvcap import LLM, SamplingParams
from kvcap.attention.metadata import AttentionMetadata
from kvcap.engine.input_batch import EagerInputs
from kvcap.engine.model_runner import StepPlan
from kvcap.engine.piecewise_graph import (
    PIECEWISE_MAX_TOKENS,
    PiecewiseGraphs,
    bucket_for,
    has_pieces,
    piecewise_max_tokens,
    token_buckets,
)
from kvcap.models.llama import ForwardContext

CPU = torch.device("cpu")


def test_token_buckets():
    assert token_buckets(8192) == [16, 32, 64, 128, 256, PIECEWISE_MAX_TOKENS]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(16) == [16] and token_buckets(10) == [10]
    assert token_buckets(8192, 2048)[-3:] == [512, 1024, 2048]
    # the largest bucket follows the model's size: 512 at 8B, further for smaller models
    assert [piecewise_max_tokens(n) for n in (80e9, 8.03e9, 3e9, 1.2e9, 135e6)] == \
        [512, 512, 1024, 2048, 2048]
    b = token_buckets(100)
    assert [bucket_for(b, n) for n in (1, 16, 17, 64, 65, 100, 101)] == \
        [16, 16, 32, 64, 100, 100, None]


def test_eager_inputs_pad_to_a_bucket():
    plan = StepPlan()
    plan.ids, plan.positions = [5, 6, 7, 9], [0, 1, 2, 16]
    plan.query_lens, plan.seq_lens, plan.tables = [3, 1], [3, 17], [[4], [2, 8]]
    inputs = EagerInputs(CPU, 16)
    ids, pos, meta = inputs.build(plan)
    pids, ppos, pmeta = inputs.build(plan, pad_to=16)
    assert ids.tolist() == [5, 6, 7, 9] and pos.tolist() == [0, 1, 2, 16]
    assert meta.slot_mapping.tolist() == [64, 65, 66, 8 * 16]
    assert pids.tolist() == ids.tolist() + [0] * 12 and ppos.tolist() == pos.tolist() + [0] * 12
    assert pmeta.slot_mapping.tolist() == meta.slot_mapping.tolist() + [-1] * 12
    assert pmeta.query_start_loc_cpu == [0, 3, 4] and pmeta.num_tokens == 4
    assert torch.equal(pmeta.block_tables, meta.block_tables)
    with pytest.raises(ValueError, match="less than the step's 4 rows"):
        inputs.build(plan, pad_to=3)


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(model=str(default_model_dir), device="cpu", dtype="float32", max_model_len=256,
               num_blocks=64, max_num_batched_tokens=24, enable_prefix_caching=False)


def _caches(pool):
    return [t.clone() for t in (*pool.k_caches, *pool.v_caches)]


def _restore(pool, saved):
    for dst, src in zip((*pool.k_caches, *pool.v_caches), saved, strict=True):
        dst.copy_(src)


@torch.inference_mode()
def test_pieces_compute_the_forward_of_a_mixed_padded_step(llm):
    """A prefill chunk after cached context beside a fresh prompt and a decode row, padded
    from 12 to 16 rows: same hidden states and the same cache bytes as LlamaModel.forward on
    the same padded rows; the unpadded forward agrees on the real rows."""
    assert has_pieces(llm.model)
    runner, pool = llm.runner, llm.pool
    bs = pool.spec.block_size
    pw = PiecewiseGraphs(llm.model, runner.backend, pool, CPU, [16, 32], graphs=False)
    pw.capture()
    g = torch.Generator().manual_seed(0)
    saved = _caches(pool)
    # Context for sequence 0 (20 tokens) and sequence 2 (9 tokens) first, through the model.
    ctx_ids = torch.randint(10, 1000, (29,), generator=g)
    tables = [[1, 2, 3], [5], [7, 8]]
    warm = AttentionMetadata.build([20, 9], [20, 9], [tables[0], tables[2]], bs, CPU)
    llm.model(ctx_ids, torch.cat([torch.arange(20), torch.arange(9)]),
              ForwardContext(runner.backend, pool, warm))
    ready = _caches(pool)
    qlens, seqs = [6, 5, 1], [26, 5, 10]
    ids = torch.randint(10, 1000, (12,), generator=g)
    pos = torch.cat([torch.arange(20, 26), torch.arange(5), torch.tensor([9])])
    padded = (torch.cat([ids, torch.zeros(4, dtype=torch.long)]),
              torch.cat([pos, torch.zeros(4, dtype=torch.long)]))

    def meta(pad):
        return AttentionMetadata.build(qlens, seqs, tables, bs, CPU, num_padded_tokens=pad)

    want = llm.model(*padded, ForwardContext(runner.backend, pool, meta(16)))
    want_caches = _caches(pool)
    _restore(pool, ready)
    got = pw.run(*padded, meta(16), 12)
    assert got.shape[0] == 12 and torch.equal(got, want[:12])
    assert all(torch.equal(a, b) for a, b in zip(_caches(pool), want_caches, strict=True))
    _restore(pool, ready)
    plain = llm.model(ids, pos, ForwardContext(runner.backend, pool, meta(None)))
    torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="not a captured bucket"):
        pw.run(ids, pos, meta(None), 12)
    _restore(pool, saved)


def _generate(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@torch.inference_mode()
def test_engine_steps_through_the_pieces_give_the_same_tokens(llm):
    """Chunked prompts (24-token budget) mixed with decode rows: the engine padding its eager
    steps to the buckets, then also running them through the pieces, gives the greedy tokens
    and logprobs of the unpadded eager engine."""
    runner = llm.runner
    prompts = ["The capital of France is", "def fibonacci(n):\n    " * 3,
               "One, two, three, four, five, six, seven, eight, nine, ten, eleven"]
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=2),
              SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1),
              SamplingParams(temperature=0.8, seed=4, max_tokens=6)]
    ref = _generate(llm, prompts, params)
    calls = []
    try:
        runner.token_buckets = token_buckets(llm.config.max_num_batched_tokens)
        assert runner.token_buckets == [16, 24]
        padded = _generate(llm, prompts, params)
        pw = PiecewiseGraphs(llm.model, runner.backend, llm.pool, CPU, runner.token_buckets,
                             graphs=False)
        pw.capture()
        run = pw.run
        pw.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)
        runner.piecewise = pw
        pieces = _generate(llm, prompts, params)
    finally:
        runner.token_buckets, runner.piecewise = [], None
    assert calls and set(calls) <= {16, 24}  # the prefill and mixed steps ran in pieces
    for a, b, c in zip(ref, padded, pieces, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert b.logprobs == c.logprobs and b.prompt_logprobs == c.prompt_logprobs
    assert pieces[1].prompt_logprobs is not None


@torch.inference_mode()
def test_draft_chunks_through_the_pieces_give_the_tokens_of_no_drafts(default_model_dir):
    """Speculative decoding's verify chunks (1 + K rows per request, the chunk route: the CPU
    has no decode graphs) padded to a bucket and run in pieces: the greedy tokens of decoding
    without drafts (float32), and drafts were verified."""
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"
    params = SamplingParams(temperature=0, max_tokens=12)
    outs = []
    for k in (0, 3):
        llm = LLM(model=str(default_model_dir), device="cpu", dtype="float32",
                  max_model_len=256, num_blocks=32, num_speculative_tokens=k)
        runner = llm.runner
        runner.token_buckets = token_buckets(llm.config.max_num_batched_tokens)
        pw = PiecewiseGraphs(llm.model, runner.backend, llm.pool, CPU, runner.token_buckets,
                             graphs=False)
        pw.capture()
        rows = []
        run = pw.run
        pw.run = lambda *a, _run=run, _rows=rows: _rows.append(a[3]) or _run(*a)
        runner.piecewise = pw
        outs.append(llm.generate([prompt], params, use_tqdm=False)[0].token_ids)
        if k:
            assert llm.engine.num_draft_tokens > 0 and any(n > 1 for n in rows[1:])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
@torch.inference_mode()
def test_pieces_of_qk_norm_and_qkv_bias_models(kind, tmp_path):
    """Qwen3 (q/k norms: the unfused RoPE path, whose q/k/v are copied into the static
    buffers) and Qwen2 (QKV bias): the pieces' prompt logits equal the model's own forward on
    the same padded rows, chunked into mixed steps."""
    from test_models_tiny import COMMON, _build, _init_without_tokenizer

    torch.manual_seed(0)
    _build(kind).float().save_pretrained(tmp_path)
    llm = LLM.__new__(LLM)
    _init_without_tokenizer(llm, tmp_path)
    assert has_pieces(llm.model)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, COMMON["vocab_size"], (n,), generator=gen).tolist()
               for n in (40, 7)]
    runner = llm.runner
    try:
        runner.token_buckets = token_buckets(llm.config.max_num_batched_tokens)
        padded = llm.prompt_logits(prompts)
        pw = PiecewiseGraphs(llm.model, runner.backend, llm.pool, CPU, runner.token_buckets,
                             graphs=False)
        pw.capture()
        rows = []
        run = pw.run
        pw.run = lambda *a: rows.append(a[0].shape[0]) or run(*a)
        runner.piecewise = pw
        pieces = llm.prompt_logits(prompts)
    finally:
        runner.token_buckets, runner.piecewise = [], None
    assert rows and set(rows) <= {16, 32, 64}
    assert not any(pw.stored)  # the CPU writes K/V in the backend, after the pieces
    for a, b in zip(padded, pieces, strict=True):
        assert torch.equal(a, b)
