"""Bugs found hunting the FP8-weight path (kvcap.models.fp8_weights / fp8_linear,
kvcap.kernels.fp8_gemm), each checked against an independent reference or the documented
behaviour."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from safetensors.torch import load_file, save_file  # noqa: E402
from test_fp8_weights import _compressed, _fp8_checkpoint, _logits  # noqa: E402

from kvcap.errors import ConfigError  # noqa: E402


def _spec(qc: dict):
    from kvcap.config import ModelSpec

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
           "quantization_config": qc}
    return ModelSpec.from_hf_config(cfg)


def test_ignored_layers_count_as_unquantized_modules(monkeypatch):
    """AutoFP8 / vLLM-style `quant_method: fp8` configs name their unquantized modules
    `ignored_layers` (transformers' FineGrainedFP8Config reads it as an alias of
    modules_to_not_convert). Those modules hold 16-bit weights that an FP8Linear cannot take:
    "auto" must dequantize on a GPU (as it does for modules_to_not_convert) instead of keeping
    FP8 and failing at load, and "keep" must be refused by name up front."""
    from kvcap.models.fp8_linear import resolve_keep

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = torch.device("cuda")
    skip = "model.layers.1.mlp.down_proj"
    for key in ("modules_to_not_convert", "ignored_layers"):
        spec = _spec({"quant_method": "fp8", "activation_scheme": "static",
                      "weight_block_size": [32, 32], key: ["lm_head", skip]})
        assert spec.fp8_weights.unquantized == (skip,), key
        assert not resolve_keep("auto", spec, gpu, 1), key
        with pytest.raises(ConfigError, match="leaves 1 module patterns unquantized"):
            resolve_keep("keep", spec, gpu, 1)


def test_ignored_layers_checkpoint_loads_and_keep_is_refused_by_name(tmp_path, monkeypatch):
    """End to end: an `ignored_layers` checkpoint with a 16-bit down_proj gives transformers'
    logits dequantized, and fp8_weights='keep' is a ConfigError naming the module (not a load
    error after the weights have streamed in)."""
    skip = "model.layers.1.mlp.down_proj"
    qc = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [32, 32],
          "ignored_layers": ["lm_head", skip]}
    hf, ids = _fp8_checkpoint(tmp_path, (32, 32), "weight_scale_inv", qc)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors[f"{skip}.weight"] = hf.model.layers[1].mlp.down_proj.weight.detach().clone()
    del tensors[f"{skip}.weight_scale_inv"], tensors[f"{skip}.input_scale"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with torch.no_grad():
        ref = hf(ids).logits[0]
    assert (_logits(tmp_path, ids, monkeypatch) - ref).abs().max().item() < 1e-4
    with pytest.raises(ConfigError, match=f"unquantized .*{skip}"):
        _logits(tmp_path, ids, monkeypatch, fp8_weights="keep")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz])
def test_fnuz_fp8_weights_are_refused_by_name(tmp_path, monkeypatch, dtype):
    """safetensors stores F8_E4M3FNUZ / F8_E5M2FNUZ (ROCm's FP8) too. Such a weight is not
    E4M3FN: it must be refused naming the weight and its dtype, as an E5M2 weight is -- not
    cast to float without its scale, the whole checkpoint streamed, and then the misleading
    "weight scales have no FP8 weight" about a weight that is FP8."""
    from kvcap.errors import ModelLoadError

    _, ids = _fp8_checkpoint(tmp_path, "channel", "weight_scale", _compressed("channel"))
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].float().to(dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"{name}: an FP8 .*fnuz.* kvcap cannot"):
        _logits(tmp_path, ids, monkeypatch)



def test_transformers_static_activation_scales_are_dropped(tmp_path, monkeypatch):
    """transformers' fine-grained FP8 (quant_method fp8) with activation_scheme "static"
    serializes each layer's activation scale as `activation_scale` (FP8Linear's parameter,
    FineGrainedFP8HfQuantizer.serialized_names), where AutoFP8 / compressed-tensors write
    `input_scale`. kvcap keeps activations 16-bit and drops activation scales: both names must
    load to transformers' logits on the dequantized weights, in both modes -- not fail as an
    "unexpected tensor ... (wrong architecture or config?)"."""
    qc = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [32, 32]}
    hf, ids = _fp8_checkpoint(tmp_path, (32, 32), "weight_scale_inv", qc)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(".input_scale")]:
        tensors[name.replace(".input_scale", ".activation_scale")] = tensors.pop(name)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with torch.no_grad():
        ref = hf(ids).logits[0]
    for mode in ("dequantize", "keep"):
        got = _logits(tmp_path, ids, monkeypatch, fp8_weights=mode)
        assert (got - ref).abs().max().item() < 1e-4, mode
