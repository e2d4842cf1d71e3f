"""Engine arguments through the Python API and the CLI: bad values are one-line kvcap errors
(ConfigError), never a TypeError / KeyError / allocator error from deep inside, and never
silently accepted."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import TINY_LLAMA

from kvcap import LLM
from kvcap.config import EngineConfig
from kvcap.errors import ConfigError, ScaleGateError

TINY = TINY_LLAMA  # (tests/conftest.py, with its `tiny` fixture)


@pytest.mark.parametrize("field, bad", [
    ("block_size", 16.0), ("block_size", "16"), ("max_num_seqs", 2.5),
    ("max_num_seqs", True), ("max_num_batched_tokens", 16.5), ("max_model_len", 2.5),
    ("num_blocks", 1.5), ("num_blocks", "8"), ("num_speculative_tokens", 2.0),
    ("prompt_lookup_max", 4.0), ("gpu_memory_utilization", "0.5"),
    ("kv_cache_memory_gib", "1"),
])
def test_engine_config_refuses_wrong_types(field, bad):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: bad}).validate()


@pytest.mark.parametrize("bad", [0, -1])
def test_non_positive_num_blocks_is_named(bad):
    # (was "the KV cache budget holds no block; raise kv_cache_memory_gib", a knob not given)
    with pytest.raises(ConfigError, match="num_blocks must be"):
        EngineConfig(num_blocks=bad).validate()


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8])
def test_unsupported_torch_dtype_is_a_config_error(tiny, dtype):
    with pytest.raises(ConfigError, match="dtype"):
        LLM(model=tiny, device="cpu", num_blocks=8, dtype=dtype)


@pytest.mark.parametrize("seed", [2**70, -(2**64), 1.5, None, "1"])
def test_bad_seed_is_a_config_error(tiny, seed):
    with pytest.raises(ConfigError, match="seed"):
        LLM(model=tiny, device="cpu", num_blocks=8, seed=seed)


def test_kv_pool_too_large_for_memory_is_a_config_error(tiny):
    with pytest.raises(ConfigError, match="does not fit"):
        LLM(model=tiny, device="cpu", num_blocks=10**12)


def test_programmatic_scale_that_is_not_a_number_is_refused_by_the_gate(tiny):
    names = [f"model.layers.{i}.self_attn.{kv}_scale" for i in range(2) for kv in "kv"]
    with pytest.raises(ScaleGateError, match="is not a number"):
        LLM(model=tiny, device="cpu", num_blocks=8, kv_cache_dtype="fp8_e4m3",
            kv_scales={n: "0.01" for n in names})


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvcap.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_with_a_dummy_model_says_it_has_no_tokenizer(tiny):
    res = _cli("generate", "--model", tiny, "--device", "cpu", "--max-tokens", "2",
               "--prompt", "hi")
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "no tokenizer to encode" in res.stderr


def test_serve_huge_seed_is_one_line(tiny):
    # (the engine is built, and refuses, before any port is bound)
    res = _cli("serve", "--model", tiny, "--device", "cpu", "--port", "0", "--seed",
               str(10**24))
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "seed must be an integer" in res.stderr


@pytest.mark.parametrize("bad", [True, torch.tensor(1), torch.tensor([1], dtype=torch.int32)])
def test_programmatic_scale_that_is_a_bool_or_an_integer_tensor_is_refused(tiny, bad):
    """True and integer tensors became float32 1.0: the unit scale the gate exists to refuse."""
    names = [f"model.layers.{i}.self_attn.{kv}_scale" for i in range(2) for kv in "kv"]
    with pytest.raises(ScaleGateError, match="is not a number"):
        LLM(model=tiny, device="cpu", num_blocks=8, kv_cache_dtype="fp8_e4m3",
            kv_scales={n: bad for n in names})
    # numbers of other real types still pass: a numpy float and a 0-dim float tensor
    import numpy as np

    LLM(model=tiny, device="cpu", num_blocks=8, kv_cache_dtype="fp8_e4m3",
        kv_scales={n: (np.float32(0.01) if i % 2 else torch.tensor(0.02))
                   for i, n in enumerate(names)})
