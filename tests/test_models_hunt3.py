"""Third hunt in model loading (kvcap/models, kvcap/config.py): config values that escaped as
tracebacks from deep inside the engine, dummy configs read without the checks an HF
directory's config gets, and the embedded model's cache directory."""

from __future__ import annotations

import json

import pytest

from kvcap import LLM
from kvcap.errors import ModelLoadError

_BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=320, hidden_size=64,
             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
             eos_token_id=2)


def _dummy(tmp_path, **changes) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**_BASE, **changes}))
    return f"dummy:{tmp_path}"


# ---------------------------------------------------------------------------------------------
# sizes and counts: positive integers, as transformers' config classes type them


@pytest.mark.parametrize("key, value", [
    ("hidden_size", 0),  # was ZeroDivisionError building the RoPE tables
    ("hidden_size", True),  # read as 1: the same
    ("num_hidden_layers", 0),  # was IndexError building the KV pool
    ("max_position_embeddings", 0),  # was ZeroDivisionError sizing the KV cache
    ("intermediate_size", -1),  # was "negative dimension" from torch
    ("num_hidden_layers", 1.5),  # silently read as 1 layer
    ("head_dim", 7),  # odd: was a shape error from rotate_half in the first forward
    ("eos_token_id", {}),  # was TypeError (unhashable) when the engine started
    ("eos_token_id", ["2"]),  # a string id: never matched a token, generation never stopped
])
def test_a_config_size_or_id_of_the_wrong_value_is_a_one_line_error(tmp_path, key, value):
    from kvcap.models.loader import read_spec

    model = _dummy(tmp_path, **{key: value})
    with pytest.raises(ModelLoadError, match=f"config.json.*{key}"):
        read_spec(tmp_path)
    with pytest.raises(ModelLoadError, match=f"config.json.*{key}"):
        LLM(model=model, device="cpu", num_blocks=8)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": "x", "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": None},
])
def test_a_yarn_value_that_is_not_a_number_is_refused_by_name(tmp_path, rope):
    """The engine reads YaRN's factor and original length for its position limit before the
    RoPE tables (which name a bad value) are built: a bare ValueError / TypeError from
    ModelSpec.position_limit."""
    key = "factor" if rope["factor"] == "x" else "original_max_position_embeddings"
    model = _dummy(tmp_path, rope_scaling=rope)
    with pytest.raises(ModelLoadError, match=f"rope_scaling.*yarn.*{key}"):
        LLM(model=model, device="cpu", num_blocks=8)


def test_valid_configs_still_read_the_same():
    """The checks take what transformers takes: a null head_dim or num_key_value_heads is
    derived, an eos list stays a list."""
    from kvcap.config import ModelSpec

    spec = ModelSpec.from_hf_config({**_BASE, "head_dim": None, "num_key_value_heads": None,
                                     "eos_token_id": [2, 3]})
    assert (spec.head_dim, spec.num_kv_heads, spec.eos_token_ids) == (16, 4, (2, 3))


# ---------------------------------------------------------------------------------------------
# dummy:CONFIG gets the checks read_spec gives an HF directory's config.json


@pytest.mark.parametrize("content, match", [('{"hidden_size": 64', "cannot read"),
                                            ("[1, 2]", "not an object"),
                                            (json.dumps({**_BASE, "num_attention_heads": None}),
                                             "num_attention_heads")])
def test_a_dummy_config_that_cannot_be_read_is_a_one_line_error(tmp_path, content, match):
    """LLM(model="dummy:...") and `kvcap capacity --model dummy:...` parsed the file with a bare
    json.loads and built the spec without read_spec's wrapping: a JSONDecodeError,
    AttributeError or TypeError traceback."""
    from kvcap.cli import main

    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ModelLoadError, match=match):
        LLM(model=f"dummy:{tmp_path / 'config.json'}", device="cpu", num_blocks=8)
    assert main(["capacity", "--model", f"dummy:{tmp_path}", "--memory-gib", "1"]) != 0


# ---------------------------------------------------------------------------------------------
# the embedded model's cache directory


def test_kvcap_cache_expands_a_tilde_and_reads_empty_as_unset(tmp_path, monkeypatch):
    """KVCAP_CACHE="~/kc" (quoted in a shell, the tilde stays) made a directory literally named
    "~" under the current directory, and KVCAP_CACHE= (empty) made the current directory the
    cache: the embedded model was converted again wherever kvcap ran."""
    from pathlib import Path

    from kvcap.models.loader import cache_root

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KVCAP_CACHE", "~/kc")
    assert cache_root() == tmp_path / "kc"
    monkeypatch.setenv("KVCAP_CACHE", "")
    assert cache_root() == Path.home() / ".cache" / "kvcap" == tmp_path / ".cache" / "kvcap"
    monkeypatch.setenv("KVCAP_CACHE", str(tmp_path / "abs"))
    assert cache_root() == tmp_path / "abs"
