"""On a CUDA GPU: requests with penalties, logit bias, logprobs, prompt logprobs and JSON mode
beside plain ones, through decode CUDA graphs with the engine's look-ahead on, give the tokens
and logprobs of the eager serial loop (those rows skip the look-ahead; the plain ones keep it)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvcap import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# the first two share a prompt (the second with penalties: its greedy text must differ)
DEVICE = "cuda"
PROMPTS = ["The capital of France is", "The capital of France is", "Once upon a time,",
           "List three primary colors:", "The history of computing spans centuries. " * 12,
           "A JSON object describing a cat:", "A date and a phone number:"]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=0.6,
                       presence_penalty=0.3, repetition_penalty=1.15, logit_bias={13: 3.0}),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, max_tokens=40,
                       ignore_eos=True, repetition_penalty=1.3, logprobs=3),
        SamplingParams(temperature=0.7, seed=3, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2, logprobs=0),
        SamplingParams(temperature=0.9, seed=5, max_tokens=40, json_object=True),
        SamplingParams(temperature=0.8, seed=6, max_tokens=40, json_schema={
            "type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                             "phone": {"type": "string",
                                                       "pattern": "^[0-9]{3}-[0-9]{4}$"}},
            "required": ["day", "phone"]}),
    ]


def _run(graphs: bool, overlap: bool):
    llm = LLM(model="default", dtype="float16", kv_cache_memory_gib=2, max_num_seqs=8,
              attention_backend="triton", enforce_eager=not graphs)
    llm.engine.overlap = overlap
    outs = llm.generate([llm.tokenizer.encode(p) for p in PROMPTS], _params(), use_tqdm=False)
    return outs, llm.engine.num_steps_ahead


def test_adjusted_and_logprob_requests_graphs_and_look_ahead_match_eager():
    ref, none_ahead = _run(graphs=False, overlap=False)
    got, ahead = _run(graphs=True, overlap=True)
    assert none_ahead == 0 and ahead > 0  # the plain requests' last 24 tokens ran ahead
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in ((a.logprobs, b.logprobs), (a.prompt_logprobs, b.prompt_logprobs)):
            assert (x is None) == (y is None)
            for dx, dy in zip(x or [], y or [], strict=True):
                assert (dx is None) == (dy is None)
                if dx is not None:
                    assert dx.keys() == dy.keys()
                    assert max(abs(dx[k] - dy[k]) for k in dx) < 1e-3
    assert ref[1].token_ids != ref[0].token_ids[:40]  # the penalties changed the text
    assert len(ref[4].prompt_logprobs) == len(ref[4].prompt_token_ids)
    if ref[6].finish_reason == "stop":  # the schema's output, complete: it validates
        doc = json.loads(ref[6].text)
        assert re.fullmatch("[0-9]{3}-[0-9]{4}", doc["phone"]), doc


def _counting(run, rows: list[int]):
    def counted(*args):
        rows.append(args[0].shape[0])
        return run(*args)
    return counted


def test_piecewise_graphs_give_the_eager_tokens():
    """Prompts of 6-100 tokens under a 48-token step budget: the long ones prefill in chunks
    beside the short ones' decode rows, and those prefill and mixed steps replay the piecewise
    graphs with the greedy tokens and logprobs of enforce_eager, in FP16 and BF16."""
    prompts = [p * n for p, n in (("Once upon a time, ", 1), ("Numbers: 1 2 3 4 5 6 ", 9),
                                  ("The history of computing spans centuries. ", 5))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    for dtype in ("float16", "bfloat16"):
        outs, used = [], []
        for eager in (True, False):
            llm = LLM(model="default", dtype=dtype, kv_cache_memory_gib=1, max_num_seqs=4,
                      max_num_batched_tokens=48, attention_backend="triton",
                      enforce_eager=eager)
            pw = llm.runner.piecewise
            assert (pw is None) == eager and llm.runner.token_buckets == [16, 32, 48]
            if pw is not None:
                pw.run = _counting(pw.run, used)
            outs.append(llm.generate([llm.tokenizer.encode(p) for p in prompts], params,
                                     use_tqdm=False))
            llm.shutdown()
        assert used and set(used) <= {16, 32, 48}, used
        for a, b in zip(*outs, strict=True):
            assert a.token_ids == b.token_ids
            for dx, dy in zip(a.logprobs, b.logprobs, strict=True):
                assert dx.keys() == dy.keys() and max(abs(dx[k] - dy[k]) for k in dx) < 1e-3


@pytest.mark.parametrize("route", ["chunk", "rows"])
def test_speculative_decoding_on_gpu(monkeypatch, route):
    """Drafts on the GPU (CUDA graphs on for the plain steps; `rows` verifies through the decode
    kernels, graphed where the rows fit a bucket): the greedy tokens of decoding without them,
    except at a near-tie of the reference (FP16 sums of a chunk and of single rows differ)."""
    monkeypatch.setenv("KVCAP_SPEC_VERIFY", route)
    copy = ("Repeat this list exactly, one item per line.\n- apples: 3 kg\n- pears: 2 kg\n"
            "- plums: 5 kg\n- figs: 1 kg\n\nThe list again:\n")
    prompts = [copy, "Count: 1, 2, 3, 4, 5, 6,", copy + "- apples"]
    p = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    kw = dict(model="default", dtype="float16", kv_cache_memory_gib=2, max_num_seqs=8,
              attention_backend="triton")
    ref = LLM(**kw).generate(prompts, p, use_tqdm=False)
    spec = LLM(**kw, num_speculative_tokens=4)
    got = spec.generate(prompts, p, use_tqdm=False)
    assert spec.engine.num_accepted_tokens > 0
    for a, b in zip(ref, got, strict=True):
        pairs = zip(a.token_ids, b.token_ids, strict=False)  # (lengths differ past a flip)
        k = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
        if k is None:
            assert a.token_ids == b.token_ids
            continue
        top2 = sorted(a.logprobs[k].values(), reverse=True)[:2]
        assert top2[0] - top2[1] < 0.05, (k, a.token_ids, b.token_ids)


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_sliding_window_model_on_gpu(tmp_path, monkeypatch, kv):
    """A Mistral with a 40-token window (transformers-built, random weights, FP32) served past
    its window on the GPU: prompt logits within 2e-3 of transformers' on CPU (FP16 cache:
    the unquantized one), greedy tokens equal to transformers' generate, and the decode CUDA
    graphs' tokens equal to eager steps' (E4M3 too: graphs and eager share the kernels)."""
    tf = pytest.importorskip("transformers")
    from kvcap.models import loader

    torch.manual_seed(0)
    cfg = tf.MistralConfig(vocab_size=320, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, sliding_window=40,
                           tie_word_embeddings=False)
    hf = tf.MistralForCausalLM(cfg).float().eval()
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 320, (1, 200), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(loader, "load_tokenizer", lambda _dir: None)
    kw = dict(model=str(tmp_path), device=DEVICE, dtype="float32", num_blocks=96,
              max_num_batched_tokens=64, attention_backend="triton", kv_cache_dtype=kv,
              kv_scales=_uniform_scales(2, 0.05) if kv == "fp8_e4m3" else None)
    prompts = [ids[0, :50].tolist(), ids[0, :7].tolist(), ids[0, :130].tolist()]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    graphs = LLM(**kw)
    got = [o.token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    eager = LLM(**kw, enforce_eager=True)
    assert got == [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    if kv == "auto":
        with torch.no_grad():
            ref = hf(ids).logits[0]
            hf_out = hf.generate(ids[:, :50], max_new_tokens=60, do_sample=False)[0, 50:]
        ours = graphs.prompt_logits([ids[0].tolist()])[0].cpu()
        assert (ours - ref).abs().max().item() < 2e-3
        assert got[0] == hf_out.tolist()


def _uniform_scales(num_layers: int, scale: float) -> dict[str, float]:
    return {f"model.layers.{i}.self_attn.{kv}_scale": scale for i in range(num_layers)
            for kv in ("k", "v")}
