"""QSA through the public API: `LLM(qsa=...)` (config or preset) gives the tokens of the
enable_qsa path that tests/test_qsa_engine.py validates, counts the indexer's side caches in
the pool sizing, refuses tensor parallelism and bad presets; the CLI options reach LLM."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from test_qsa_engine import TINY

from kvcap import LLM, SamplingParams
from kvcap.errors import ConfigError
from kvcap.qsa.backend import QSABackend
from kvcap.qsa.config import QSAConfig
from kvcap.qsa.enable import enable_qsa, graph_refusal, parse_preset, resolve_qsa

# a 16-token budget (4 groups): prompts of 70-150 tokens are really sparse
SMALL = QSAConfig(layer_rule="all_but_first", first_dense=1, topk_groups=4, summary="minmax")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qsa_llm") / "config.json"
    path.write_text(json.dumps(TINY))
    return f"dummy:{path}"


def _prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (n,), generator=g).tolist() for n in lengths]


def test_presets():
    assert parse_preset("every4") == QSAConfig(layer_rule="every_nth", every_n=4,
                                               topk_groups=512, summary="minmax")
    assert parse_preset("all-but-2").qsa_layers(6) == (2, 3, 4, 5)
    assert parse_preset("every4").token_budget == 2048
    assert parse_preset("All-But-1:16") == SMALL
    assert resolve_qsa(None) is None and resolve_qsa(SMALL) is SMALL
    for bad in ("sometimes", "every0", "every4:1001", "every4:0", "all-but-", "every4:"):
        with pytest.raises(ConfigError, match="bad QSA preset"):
            parse_preset(bad)
    with pytest.raises(ConfigError, match="qsa must be None, a QSAConfig or a preset"):
        resolve_qsa(4)
    with pytest.raises(ConfigError, match="trained"):
        resolve_qsa(QSAConfig(indexer="trained"))


def test_llm_qsa_equals_enable_qsa(tiny_model):
    """LLM(qsa=...) and a preset give the enable_qsa path's greedy tokens; dense differs."""
    prompts = _prompts(0, [150, 70, 9])
    kw = dict(model=tiny_model, num_blocks=64, max_num_batched_tokens=48)
    ref = LLM(**kw)
    enable_qsa(ref, SMALL)
    want = [o.token_ids for o in ref.generate(prompts, GREEDY, use_tqdm=False)]
    for qsa in (SMALL, "all-but-1:16"):
        llm = LLM(qsa=qsa, **kw)
        assert isinstance(llm.runner.backend, QSABackend) and llm.qsa == SMALL
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    dense = LLM(**kw).prompt_logits(prompts[:1])[0]
    assert float((llm.prompt_logits(prompts[:1])[0] - dense).abs().max()) > 1e-3


def test_speculative_decoding_is_refused_with_qsa(tiny_model):
    with pytest.raises(ConfigError, match="cannot run with QSA"):
        LLM(model=tiny_model, num_blocks=8, qsa="every2", num_speculative_tokens=2)


def test_pool_sizing_counts_side_bytes(tiny_model):
    kw = dict(model=tiny_model, dtype="float32", kv_cache_memory_gib=1 / 1024)  # 1 MiB
    dense = LLM(**kw)
    qsa = LLM(qsa=SMALL, **kw)
    kv = 2 * 4 * 2 * 16 * 4  # layers x KV heads x head_dim x FP32, K and V
    side = 3 * 8 * 2 * 16 * 2 // 16  # 3 QSA layers x 8 bound rows per block of 16 x FP16
    assert dense.pool.spec.bytes_per_token == kv == 1024
    assert qsa.pool.spec.side_bytes_per_token == side == 96
    assert qsa.runner.backend.side.bytes_per_token == side  # what was allocated
    assert dense.pool.num_blocks == 2**20 // (kv * 16) == 64
    assert qsa.pool.num_blocks == 2**20 // ((kv + side) * 16) == 58
    assert qsa.block_manager.num_total_blocks == 58
    # explicit num_blocks: the pool keeps the count; the side bytes are still in its spec
    fixed = LLM(model=tiny_model, dtype="float32", num_blocks=20, qsa="every2")
    assert fixed.pool.num_blocks == 20
    assert fixed.pool.spec.side_bytes_per_token == 2 * 8 * 2 * 16 * 2 // 16


def test_refusals(tiny_model):
    with pytest.raises(ConfigError) as e:
        LLM(model=tiny_model, num_blocks=8, qsa="every4", tensor_parallel_size=2)
    assert "tensor_parallel_size=1" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="bad QSA preset 'dense'"):
        LLM(model=tiny_model, num_blocks=8, qsa="dense")
    with pytest.raises(ConfigError, match="selects no layer"):
        LLM(model=tiny_model, num_blocks=8, qsa="all-but-4")
    # on CPU the QSA path is torch's (a GPU picks triton, which graphs can record)
    be = LLM(model=tiny_model, num_blocks=8, qsa="every2", device="cpu").runner.backend
    assert be.path == "torch" and "host-side" in graph_refusal(be)
    assert graph_refusal(be.inner) is None


def test_a_budget_past_the_context_is_refused(tiny_model, tmp_path):
    """A budget past max_model_len selects nothing more, while its selection rows and the
    activation reserve grow with it: every2:4000000 passed and reserved terabytes. Budgets up
    to the default 2,048 pass at any context (the presets run on short models)."""
    huge = QSAConfig(layer_rule="every_nth", every_n=2, topk_groups=10**6, summary="minmax")
    for qsa in ("every2:4000000", huge):
        with pytest.raises(ConfigError) as e:
            LLM(model=tiny_model, num_blocks=8, qsa=qsa)
        msg = str(e.value)
        assert "exceeds the context (max_model_len 1024)" in msg and "\n" not in msg
        assert "at most 2048 tokens (topk_groups <= 512)" in msg
    LLM(model=tiny_model, num_blocks=8, max_model_len=512, qsa="every2:2048")
    dense = LLM(model=tiny_model, num_blocks=8)
    with pytest.raises(ConfigError, match="exceeds the context"):
        enable_qsa(dense, huge)
    assert not isinstance(dense.runner.backend, QSABackend)
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "max_position_embeddings": 8192}))
    long = f"dummy:{tmp_path / 'config.json'}"
    LLM(model=long, num_blocks=8, qsa="every2:8192")
    with pytest.raises(ConfigError, match=r"max_model_len 8192\).*at most 8192 tokens"):
        LLM(model=long, num_blocks=8, qsa="every2:8196")


def test_throughput_bench_help_lists_qsa_without_error(capsys):
    """(generate and serve passing --qsa to the LLM: tests/test_cli_numbers.py)"""
    from kvcap.bench import throughput

    with pytest.raises(SystemExit) as e:
        throughput.main(["--help"])
    assert e.value.code == 0 and "--qsa PRESET" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphs_and_profiled_budget(tmp_path):
    """On the GPU: the profiled budget path counts the side bytes, decode CUDA graphs are
    captured with the QSA backend, and graph replays give the eager tokens."""
    cfg = dict(TINY, hidden_size=256, intermediate_size=512, num_attention_heads=12,
               head_dim=64, max_position_embeddings=4096)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prompts = _prompts(1, [900, 333, 64])
    params = SamplingParams(max_tokens=24, temperature=0.0)
    qsa = QSAConfig(layer_rule="all_but_first", first_dense=1, topk_groups=16,
                    summary="minmax")
    outs = []
    for eager in (True, False):  # the graph arm sizes its pool from the profiled budget
        budget = dict(kv_cache_memory_gib=1) if eager else dict(gpu_memory_utilization=0.3)
        llm = LLM(model=f"dummy:{tmp_path}", dtype="float16", max_num_seqs=4,
                  max_model_len=2048, enforce_eager=eager, qsa=qsa, **budget)
        assert llm.pool.spec.side_bytes_per_token == 3 * 8 * 2 * 64 * 2 // 16
        assert (llm.runner.graphs is None) == eager
        if not eager:
            assert isinstance(llm.runner.graphs.backend, QSABackend)
        outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]
