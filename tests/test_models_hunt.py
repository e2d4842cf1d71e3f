"""Checkpoints a user may point kvcap at that used to load wrongly or silently compute wrong
logits: the same tensor twice in the checkpoint's files, integer tensors for float weights."""

from __future__ import annotations

import pytest
import torch
from test_models_tiny import COMMON, _init_without_tokenizer

from kvcap import LLM
from kvcap.errors import ModelLoadError


def _llama(tmp_path):
    """A tiny Llama saved by transformers; returns its state dict (the file's tensors)."""
    import transformers as tf
    from safetensors.torch import load_file

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)).save_pretrained(tmp_path)
    return load_file(tmp_path / "model.safetensors")


def _save(state, path):
    from safetensors.torch import save_file

    save_file(state, path, metadata={"format": "pt"})


def test_a_tensor_twice_with_its_fused_partner_missing_is_refused(tmp_path):
    """gate_proj in two files (no index and no model.safetensors: every *.safetensors is read)
    and up_proj in none: the loader counted rows per fused parameter, so the second gate
    filled the up rows' count and the up half of gate_up_proj stayed uninitialised memory --
    a model that loaded and computed garbage. Each checkpoint tensor must come once."""
    state = _llama(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    gate = "model.layers.1.mlp.gate_proj.weight"
    _save({gate: state[gate]}, tmp_path / "extra.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    _save(state, tmp_path / "weights.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.gate_proj\.weight.*twice"):
        _init_without_tokenizer(LLM.__new__(LLM), tmp_path)


def test_a_second_copy_of_the_weights_is_refused_as_a_duplicate_not_as_missing(tmp_path):
    """A stale second copy of every weight in a directory of unindexed weight files (no
    model.safetensors, which would be read alone): the error said the checkpoint was
    *missing* 15 tensors; it names the duplicate."""
    state = _llama(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.safetensors")
    _save(state, tmp_path / "model-copy.safetensors")
    with pytest.raises(ModelLoadError, match="twice") as e:
        _init_without_tokenizer(LLM.__new__(LLM), tmp_path)
    assert "missing" not in str(e.value)


def test_a_missing_tensor_is_named_as_the_checkpoint_names_it(tmp_path):
    """A missing up_proj was reported as kvcap's fused 'layers.1.mlp.gate_up_proj.weight',
    a name the user cannot find in any checkpoint."""
    state = _llama(tmp_path)
    del state["model.layers.1.mlp.up_proj.weight"]
    _save(state, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        _init_without_tokenizer(LLM.__new__(LLM), tmp_path)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.uint8])
def test_an_integer_tensor_for_a_float_weight_is_refused(tmp_path, dtype):
    """An int8/int32/bool/uint8 tensor of the right shape (quantized weights whose format the
    config does not declare) was cast to float and loaded: garbage logits, no error."""
    state = _llama(tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    state[name] = (state[name] * 100).to(dtype)
    _save(state, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=rf"{name}.*{str(dtype).split('.')[-1]}"):
        _init_without_tokenizer(LLM.__new__(LLM), tmp_path)


_BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=320, hidden_size=64,
             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.mark.parametrize("key, value", [("hidden_size", None), ("rope_theta", "abc"),
                                        ("rope_scaling", "linear"), ("num_attention_heads", 0),
                                        ("rms_norm_eps", None), ("head_dim", "x"),
                                        ("max_position_embeddings", None)])
def test_a_config_field_of_the_wrong_type_is_a_one_line_error(tmp_path, key, value):
    """A config.json value of the wrong type (null, a string for a number) escaped as a bare
    TypeError / ValueError / AttributeError / ZeroDivisionError traceback; it is a
    ModelLoadError naming config.json."""
    import json

    from kvcap.models.loader import read_spec

    (tmp_path / "config.json").write_text(json.dumps({**_BASE, key: value}))
    with pytest.raises(ModelLoadError, match="config.json"):
        read_spec(tmp_path)


def test_a_rope_scaling_value_that_is_not_a_number_is_refused_by_name(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(
        {**_BASE, "rope_scaling": {"rope_type": "linear", "factor": "x"}}))
    with pytest.raises(ModelLoadError, match="rope_scaling.*'linear'.*'x'"):
        LLM(model=f"dummy:{tmp_path}", device="cpu", num_blocks=8)


@pytest.mark.parametrize("content", ['{"weight_map": [1, 2]}', '{"weight_map": {"a": 5}}',
                                     '[1]', '{"weight_map": "x"}'])
def test_a_malformed_safetensors_index_is_a_one_line_error(tmp_path, content):
    from kvcap.models.loader import safetensors_files

    (tmp_path / "model.safetensors.index.json").write_text(content)
    with pytest.raises(ModelLoadError, match="model.safetensors.index.json"):
        safetensors_files(tmp_path)


def test_fp8_weights_without_a_quantization_config_are_refused_saying_so(tmp_path):
    """E4M3 weights with their weight_scale tensors, in a directory whose config.json lost its
    quantization_config (copied from the base model): the E4M3 bytes were cast to float
    without their scales, then the scale tensor was 'unexpected ... wrong architecture or
    config?'. The error now says what is missing."""
    import json

    state = _llama(tmp_path)
    name = "model.layers.0.self_attn.o_proj"
    w = state[f"{name}.weight"]
    scale = w.abs().max() / 448
    state[f"{name}.weight"] = (w / scale).to(torch.float8_e4m3fn)
    state[f"{name}.weight_scale"] = scale.reshape(1)
    _save(state, tmp_path / "model.safetensors")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in cfg
    with pytest.raises(ModelLoadError, match="quantization_config"):
        _init_without_tokenizer(LLM.__new__(LLM), tmp_path)


_SPEC_BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 30,
              "num_attention_heads": 4, "vocab_size": 128, "max_position_embeddings": 8192}
_RULE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("model_type, extra", [
    # keys a hand-written config leaves out: transformers' class defaults apply
    ("mistral", {}),  # 8 KV heads, a 4096-token window in every layer
    ("qwen2", {"use_sliding_window": True}),  # 32 KV heads; layers 28+ slide, 4096 tokens
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64}),
    ("qwen2", {"num_key_value_heads": None}),  # null: one KV head per query head
    ("llama", {}),
    ("mistral", {"max_position_embeddings": 4096}),  # a window it never outgrows: none
    # both a top-level and a rope-dict value: the dict's wins (theta and original length)
    ("llama", {"rope_theta": 10000.0, "rope_parameters": {**_RULE, "rope_theta": 500000.0},
               "original_max_position_embeddings": 2048}),
    ("llama", {"rope_theta": 20000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512}}),
])
def test_config_defaults_and_precedence_follow_transformers(model_type, extra):
    """kvcap read these configs otherwise than transformers: a Mistral or Qwen config without
    num_key_value_heads got one KV head per query head (transformers: 8 / 32; the weights then
    failed to load), a Mistral config without sliding_window attended to everything and a Qwen
    one with use_sliding_window and no max_window_layers slid in no layer (transformers: 4096
    tokens; from layer 28 on), a top-level rope_theta beat the rope dict's (logits off by
    ~5e-3). Each is compared with transformers' own reading of the config."""
    import transformers as tf

    from kvcap.config import ModelSpec

    cfg = {**_SPEC_BASE, "model_type": model_type, **extra}
    ref = tf.AutoConfig.for_model(**cfg)
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.num_kv_heads == ref.num_key_value_heads
    types = getattr(ref, "layer_types", None) or (
        ["sliding_attention"] * ref.num_hidden_layers if getattr(ref, "sliding_window", None)
        else ["full_attention"] * ref.num_hidden_layers)
    window = ref.sliding_window if "sliding_attention" in types else None
    if window is not None and window >= ref.max_position_embeddings:
        types = ["full_attention"] * ref.num_hidden_layers  # a window it never outgrows
    assert spec.sliding_layers == tuple(i for i, t in enumerate(types)
                                        if t == "sliding_attention")
    if spec.sliding_layers:
        assert spec.sliding_window == window
    rope = ref.rope_parameters
    assert spec.rope_theta == rope["rope_theta"]
    if rope.get("rope_type") in ("llama3", "yarn"):
        assert spec.rope_scaling["original_max_position_embeddings"] == \
            rope["original_max_position_embeddings"]


def test_architectures_as_one_string_is_read():
    """"architectures": "LlamaForCausalLM" (a string, not a list) was refused as unsupported
    while the error listed that very name as supported."""
    from kvcap.config import ModelSpec

    spec = ModelSpec.from_hf_config({**_SPEC_BASE, "architectures": "LlamaForCausalLM"})
    assert spec.architecture == "llama"


def test_model_arguments_a_user_types_are_read_or_refused_by_name(tmp_path, monkeypatch):
    """--model "" resolved to the current directory, "default/" was "'default' does not
    exist", and a file got "has no config.json" rather than being called a file."""
    from kvcap.models import loader

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loader, "_default_model_dir", lambda: tmp_path / "embedded")
    assert loader.resolve_model_dir("default/") == tmp_path / "embedded"
    with pytest.raises(ModelLoadError, match="empty"):
        loader.resolve_model_dir("")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file"):
        loader.resolve_model_dir(tmp_path / "model.safetensors")
