"""KV pool sizing at its edges: budgets that hold no block, max_model_len against the pool,
the CPU default, and `kvcap capacity` on budgets and contexts the model cannot serve. Each
figure is checked against a hand computation from the model config."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
import torch

from kvcap import LLM
from kvcap.commands import capacity
from kvcap.config import EngineConfig, ModelSpec
from kvcap.errors import ConfigError

# 2 layers x 2 KV heads x head_dim 16: 2 x 2 x 2 x 16 = 128 K/V values a token (FP32 on CPU:
# 512 B/token, 8 KiB a 16-token block)
TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=320, hidden_size=64,
            intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            eos_token_id=2)
# every layer slides over 32 tokens: blocks behind the window go back to the pool
SLIDING = dict(TINY, architectures=["MistralForCausalLM"], model_type="mistral",
               sliding_window=32)
# Llama-3.1-8B's cache shape: 2 x 32 layers x 8 KV heads x 128 = 65,536 values a token
LLAMA8B = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
               intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5)
# SmolLM2-135M's: 2 x 30 layers x 3 KV heads x 64 = 11,520 values (23,040 B FP16)
SMOL = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
            intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5)


def _dummy(tmp_path, cfg: dict, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return f"dummy:{path}"


def _sizing_only(cfg: dict, device: str, max_model_len: int, **config) -> LLM:
    """An LLM with just what pool sizing reads (no weights, no allocation)."""
    llm = object.__new__(LLM)
    llm.spec = ModelSpec.from_hf_config(cfg)
    llm.config = EngineConfig(**config)
    llm.device = torch.device(device)
    llm.qsa = llm.tp = None
    llm.max_model_len = max_model_len
    llm.kv_dtype = "fp16"
    llm._activation_bytes = 0
    llm._graphs_planned = device == "cuda"
    return llm


def _capacity(model: str, *argv: str) -> int:
    p = argparse.ArgumentParser()
    capacity.add_arguments(p)
    return capacity.run(p.parse_args(["--model", model, *argv]))


def test_capacity_refuses_a_budget_without_an_fp16_block(tmp_path):
    """0.0002 GiB (214,748 B) holds one E4M3 block (16 x 11,520 = 184,320 B) but no FP16 one
    (368,640 B): the ratio line said "16.000x" (16 tokens over a floor of 1)."""
    with pytest.raises(ConfigError, match=r"holds no FP16 block .*raise --memory-gib"):
        _capacity(_dummy(tmp_path, SMOL), "--memory-gib", "0.0002", "--context", "16")


def test_capacity_marks_contexts_past_the_position_limit(tmp_path, capsys, monkeypatch):
    """The default contexts run to 131,072 tokens; a model limited to 8,192 positions got a
    sequence count there (2 at 8 GiB) that it can never serve."""
    monkeypatch.setenv("COLUMNS", "200")
    assert _capacity(_dummy(tmp_path, SMOL), "--memory-gib", "8",
                     "--context", "8192", "131072") == 0
    out = capsys.readouterr().out
    fp16 = next(line for line in out.splitlines() if line.startswith("│ fp16"))
    # 8 GiB / (16 x 23,040 B) = 23,301 blocks; 8,192 tokens take 512 of them
    assert [c.strip() for c in fp16.split("│")[1:-1]] == ["fp16", "23040", "372,816",
                                                          str(23301 // 512), "-"]
    assert "position limit (8,192 tokens)" in out


@pytest.mark.parametrize("contexts, counts", [
    # as the scheduler admits them: 46,603 blocks keep a 467-block watermark and one free
    # block per running sequence (plain division said 728 / 364 / 182 / 91)
    ([], ["716", "180", "-", "-", "-"]),  # the defaults: 1K, 4K, 16K, 32K, 128K
    (["--context", *(str(2**k) for k in range(10, 18))],
     ["716", "360", "180", "90", "-", "-", "-", "-"]),
])
def test_capacity_prints_every_cell_whole_at_80_columns(tmp_path, capsys, monkeypatch, contexts,
                                                        counts):
    """At 80 columns (a pipe's width, a common terminal's) rich cut the cells that did not fit
    to a prefix and an ellipsis: the README's `kvcap capacity --model default --memory-gib 8`
    printed "fp8_e4..." and "bytes/...", and with eight contexts the counts themselves."""
    monkeypatch.setenv("COLUMNS", "80")
    assert _capacity(_dummy(tmp_path, SMOL), "--memory-gib", "8", *contexts) == 0
    out = capsys.readouterr().out
    assert "\u2026" not in out
    e4m3 = next(line for line in out.splitlines() if line.startswith("│ fp8_e4m3 "))
    # 8 GiB / (16 x 11,520 B) = 46,603 blocks; 1,024 tokens take 64 of them
    assert [c.strip() for c in e4m3.split("│")[1:-1]] == ["fp8_e4m3", "11520", "745,648",
                                                          *counts]


def test_sliding_window_pool_shorter_than_max_model_len_does_not_warn(tmp_path, caplog):
    """Every layer slides over 32 tokens, so a 256-token sequence prefilled in 32-token chunks
    holds at most ceil(63 / 16) + 1 = 5 blocks: 8 blocks serve it (the startup line says
    max concurrency 1), yet the pool warned it held less than max_model_len."""
    caplog.set_level(logging.INFO, logger="kvcap.llm")
    LLM(model=_dummy(tmp_path, SLIDING), device="cpu", num_blocks=8,
        max_num_batched_tokens=32)
    assert "max concurrency at 256 tokens: 1" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    # A full-attention model needs all 16 blocks: that warning stays, and says what to change.
    LLM(model=_dummy(tmp_path, TINY, "full.json"), device="cpu", num_blocks=8,
        max_num_batched_tokens=32)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "fewer than the 16 blocks" in warned[0]
    assert "lower max_model_len" in warned[0]


def test_gpu_budget_without_a_block_names_gpu_memory_utilization(monkeypatch):
    """A GPU budget left after weights and activations that holds no block was reported as
    "raise kv_cache_memory_gib", a knob the user never set; 1 MiB free for 2 MiB blocks
    (16 tokens x 131,072 B FP16)."""
    total = 80 * 2**30
    free = int(total * 0.1) + 512 * 2**20 + 2**20  # (the 512 MiB kept for CUDA graphs)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    llm = _sizing_only(LLAMA8B, "cuda", 8192)
    with pytest.raises(ConfigError, match=r"\(1\.00 MiB\) holds no block .*2\.00 MiB.*raise "
                                          r"gpu_memory_utilization"):
        llm._make_pool()


def test_eager_gpu_budget_keeps_nothing_back_for_graphs(monkeypatch):
    """enforce_eager (or KVCAP_ENFORCE_EAGER, or the QSA torch path) captures no decode graph,
    yet the GPU KV budget kept 512 MiB back for graphs all the same: 256 blocks of 2 MiB lost."""
    total = 80 * 2**30
    free = int(total * 0.1) + 2 * 2**30  # 2 GiB of KV budget beyond the 10% held back
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    llm = _sizing_only(LLAMA8B, "cuda", 8192)
    cspec = llm._kv_spec("fp16")
    graphed = llm._pool_blocks(cspec)
    llm._graphs_planned = False
    eager = llm._pool_blocks(cspec)
    assert eager - graphed == 512 * 2**20 // cspec.bytes_per_block
    assert eager == 2 * 2**30 // cspec.bytes_per_block


@pytest.mark.parametrize("block_size", [16, 256])
def test_cpu_default_pool_holds_max_model_len(block_size):
    """The CPU default budget was max_model_len x bytes/token; floored to whole blocks it
    held 4,992 of 5,000 tokens (16-token blocks; 4,864 with 256), so a request at
    max_model_len was refused. 5,000 x 262,144 B (FP32, CPU's dtype) is past the 1 GiB floor."""
    llm = _sizing_only(LLAMA8B, "cpu", 5000, block_size=block_size)
    cspec = llm._kv_spec("fp32")
    blocks = cspec.num_blocks_for(int(llm._default_kv_gib(cspec) * 2**30))
    assert blocks * block_size >= 5000
    assert blocks == -(-5000 // block_size)  # and not more than that
