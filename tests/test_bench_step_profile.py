"""The step profiler's kernel categories and linear shapes, and the roofline's weight bytes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from torch import nn

from kvcap.bench.gemm import linear_shapes
from kvcap.bench.step_profile import category
from kvcap.bench.throughput import CONFIGS, weight_bytes
from kvcap.config import ModelSpec


def test_kernel_categories():
    assert category("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize64x64x64") == "gemm"
    assert category("nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNT") == "gemm"
    assert category("_decode_kernel") == "attention"
    assert category("_merge_kernel") == "attention"
    assert category("_store_kv_kernel") == "kv_write"
    assert category("_add_rms_norm_kernel") == "norm"
    assert category("_rope_split_qkv_kernel") == "rope"
    assert category("_silu_mul_kernel") == "activation"
    assert category("void at::native::reduce_kernel<argmax>") == "sampling"
    assert category("void at::native::vectorized_elementwise_kernel<4, copy>") == "other"


def test_linear_shapes_of_the_8b_config():
    spec = ModelSpec.from_hf_config(json.loads((CONFIGS / "llama-3.1-8b.json").read_text()))
    assert linear_shapes(spec) == {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096),
                                   "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336),
                                   "lm_head": (128256, 4096)}


def _fake_llm(tied: bool):
    model = nn.Module()
    model.embed_tokens = nn.Embedding(100, 8, dtype=torch.float16)
    model.lm_head = nn.Linear(8, 100, bias=False, dtype=torch.float16)
    model.body = nn.Linear(8, 8, bias=False, dtype=torch.float16)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    return SimpleNamespace(model=model)


def test_roofline_weight_bytes_skip_an_untied_input_embedding():
    # untied: LM head (800) + body (64) halves; the 800-element embedding table is gathered
    assert weight_bytes(_fake_llm(tied=False)) == 2 * (800 + 64)
    # tied: the shared table is read in full by the LM head, once
    assert weight_bytes(_fake_llm(tied=True)) == 2 * (800 + 64)
    untied = _fake_llm(tied=False)
    assert sum(p.numel() for p in untied.model.parameters()) == 800 + 800 + 64


def test_bad_cells_are_refused_before_any_gpu_work(capsys):
    import pytest

    from kvcap.bench.step_profile import main

    for bad in ("fp9:16:1024", "fp8:16", "fp8:x:1024", "fp8:0:1024", "fp16:4:0"):
        with pytest.raises(SystemExit) as exc:
            main(["--cells", bad])
        assert exc.value.code == 2
        assert f"--cells {bad!r}: want KV:CONCURRENCY:CONTEXT" in capsys.readouterr().err


def test_eager_steps_report_wall_launches_and_host_operators():
    """The step profile's eager mode on the CPU (no kernels to count there): the steps run,
    the wall time comes from unprofiled steps and the host operators are listed."""
    from kvcap.bench.step_overhead import build_llm, tiny_config_path
    from kvcap.bench.step_profile import _profile_steps

    llm = build_llm(tiny_config_path(), "cpu", max_num_seqs=2, max_model_len=64,
                    block_size=16, dtype="float32", enforce_eager=True)
    cell = _profile_steps(llm, concurrency=2, context=16, steps=3, eager=True)
    assert cell["wall_ms_per_step"] > 0 and cell["kernels_per_step"] == 0
    names = [h["name"] for h in cell["host_top_ms"]]
    assert "aten::mm" in names or "aten::addmm" in names or "aten::linear" in names, names
    assert all(h["self_ms"] > 0 and h["calls"] > 0 for h in cell["host_top_ms"])
    assert not llm.engine.has_unfinished()
    plain = _profile_steps(llm, concurrency=2, context=16, steps=3)
    assert "host_top_ms" not in plain and plain["wall_ms_per_step"] > 0
