"""More FP8-weight bugs (kvcap.models.fp8_weights): an FP8 weight that is not a matrix, an
asymmetric compressed-tensors scheme, and compressed-tensors groups that quantize only some
linear layers -- each checked against the documented behaviour or a float32 reference built
here (E4M3 x scale, then the same model in float32)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from safetensors.torch import load_file, save_file  # noqa: E402
from test_fp8_weights import _compressed, _fp8_checkpoint, _logits  # noqa: E402
from test_fp8_weights_hunt import _spec  # noqa: E402

from kvcap.errors import ConfigError, ModelLoadError  # noqa: E402


@pytest.mark.parametrize("shape", [(96,), (2, 48, 64)])
def test_fp8_weight_that_is_not_a_matrix_is_refused_by_name(tmp_path, monkeypatch, shape):
    """An E4M3 `.weight` of 1 or 3 dimensions (a mangled or foreign checkpoint) cannot pair
    with a scale as an [out, in] matrix: the load must be a ModelLoadError naming the tensor
    and its shape -- not a bare "ValueError: not enough / too many values to unpack" from
    unpacking its shape into (out, in)."""
    _, ids = _fp8_checkpoint(tmp_path, "channel", "weight_scale", _compressed("channel"))
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = torch.randn(shape).to(torch.float8_e4m3fn)
    save_file(tensors, str(path), metadata={"format": "pt"})
    dims = ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "")
    for mode in ("dequantize", "keep"):
        with pytest.raises(ModelLoadError, match=rf"{name}: .*shape \({dims}\)"):
            _logits(tmp_path, ids, monkeypatch, fp8_weights=mode)


def test_fp8_weight_that_is_not_a_matrix_is_refused_in_the_stream():
    """The same at the stream level, whichever of weight and scale comes first."""
    from kvcap.models.fp8_weights import FP8Weights, dequantized

    w8 = torch.randn(4, 2, 8).to(torch.float8_e4m3fn)
    s = torch.ones(4, 1)
    for stream in ([("a.weight", w8), ("a.weight_scale", s)],
                   [("a.weight_scale", s), ("a.weight", w8)]):
        with pytest.raises(ModelLoadError, match=r"a\.weight: .*shape \(4, 2, 8\)"):
            list(dequantized(stream, FP8Weights("compressed-tensors")))


@pytest.mark.parametrize("symmetric", [False, "false"])
def test_asymmetric_compressed_tensors_fp8_is_refused_at_config(symmetric):
    """compressed-tensors FP8 with `symmetric: false` stores a `weight_zero_point` per scale:
    W = (w - z) * s. kvcap computes w * s only. The config must be refused by name when it is
    read (a ConfigError saying kvcap supports symmetric FP8 only) -- not accepted and then
    failed after streaming as an "unexpected tensor" on the first zero point."""
    qc = _compressed("channel")
    qc["config_groups"]["group_0"]["weights"]["symmetric"] = symmetric
    with pytest.raises(ConfigError, match=r"group_0: asymmetric .*symmetric"):
        _spec(qc)


def test_asymmetric_compressed_tensors_checkpoint_fails_before_loading(tmp_path, monkeypatch):
    """End to end: the asymmetric checkpoint (zero points beside the scales) is a ConfigError
    naming the scheme, in every fp8_weights mode."""
    qc = _compressed("channel")
    qc["config_groups"]["group_0"]["weights"]["symmetric"] = False
    _, ids = _fp8_checkpoint(tmp_path, "channel", "weight_scale", qc)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        tensors[name.replace(".weight_scale", ".weight_zero_point")] = torch.zeros_like(
            tensors[name])
    save_file(tensors, str(path), metadata={"format": "pt"})
    for mode in ("auto", "dequantize", "keep"):
        with pytest.raises(ConfigError, match="asymmetric"):
            _logits(tmp_path, ids, monkeypatch, fp8_weights=mode)


def _mlp_only(tmp_path, targets):
    """An FP8 checkpoint whose compressed-tensors group targets `targets` with no `ignore`
    list, the attention projections stored in FP32 (as llm-compressor leaves modules its
    targets do not match). Returns (float32 reference model, ids, qc)."""
    qc = _compressed("channel")
    qc["config_groups"]["group_0"]["targets"] = targets
    del qc["ignore"]
    hf, ids = _fp8_checkpoint(tmp_path, "channel", "weight_scale", qc)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    for i, layer in enumerate(hf.model.layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            prefix = f"model.layers.{i}.self_attn.{proj}"
            del tensors[f"{prefix}.weight_scale"], tensors[f"{prefix}.input_scale"]
            # the float32 reference keeps the original weight, never quantized
            tensors[f"{prefix}.weight"] = getattr(layer.self_attn, proj).weight.detach().clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return hf, ids, qc


PARTIAL_TARGETS = [["re:.*mlp.*"], ["re:.*gate_proj", "re:.*up_proj", "re:.*down_proj"],
                   ["model.layers.0.mlp.down_proj"]]


@pytest.mark.parametrize("targets", PARTIAL_TARGETS)
def test_partial_targets_dequantize_under_auto_and_refuse_keep(monkeypatch, targets):
    """compressed-tensors `targets` other than every Linear ("Linear", "re:.*") may leave
    linear layers 16-bit with no `ignore` list naming them. On a (faked) sm_90 GPU, "auto"
    must dequantize, as it does for ignored modules, and "keep" must be a ConfigError naming
    the targets up front; whole-Linear targets still keep FP8."""
    from kvcap.models.fp8_linear import resolve_keep

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = torch.device("cuda")
    qc = _compressed("channel")
    qc["config_groups"]["group_0"]["targets"] = targets
    del qc["ignore"]
    spec = _spec(qc)
    assert not resolve_keep("auto", spec, gpu, 1)
    with pytest.raises(ConfigError, match=r"fp8_weights='keep': .*targets"):
        resolve_keep("keep", spec, gpu, 1)
    for whole in (["Linear"], ["re:.*"]):
        qc["config_groups"]["group_0"]["targets"] = whole
        spec = _spec(qc)
        assert spec.fp8_weights.unquantized == (), whole
        assert resolve_keep("auto", spec, gpu, 1), whole


def test_mlp_only_checkpoint_matches_float32_reference(tmp_path, monkeypatch):
    """End to end: an MLP-only FP8 checkpoint (`targets: ["re:.*mlp.*"]`, no ignore) loads to
    the float32 reference's logits under "auto" and "dequantize", and fp8_weights='keep' is a
    ConfigError before the weights stream -- not a load error on the first 16-bit q_proj.
    (transformers 5 with compressed-tensors 0.20 loads this checkpoint on a CPU to NaN logits,
    so the reference is the same model on E4M3 x scale in float32.)"""
    hf, ids, _ = _mlp_only(tmp_path, ["re:.*mlp.*"])
    with torch.no_grad():
        ref = hf(ids).logits[0]
    for mode in ("auto", "dequantize"):
        got = _logits(tmp_path, ids, monkeypatch, fp8_weights=mode)
        assert (got - ref).abs().max().item() < 1e-4, mode
    with pytest.raises(ConfigError, match=r"targets \['re:\.\*mlp\.\*'\]"):
        _logits(tmp_path, ids, monkeypatch, fp8_weights="keep")
