"""The fail-closed startup gate: every refusal of SYSTEM.md §4 and issue 3."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from kvcap.config import ModelSpec
from kvcap.errors import ScaleGateError
from kvcap.scales.gate import SENTINEL, is_kv_scale_name, run_gate

N_LAYERS = 4


def make_spec(num_layers: int = N_LAYERS) -> ModelSpec:
    return ModelSpec.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": num_layers, "intermediate_size": 128,
        "vocab_size": 100,
    })


def full_scales(spec: ModelSpec) -> dict[str, torch.Tensor]:
    # Distinct per tensor so a mixed-up slot is visible.
    return {name: torch.tensor(0.01 * (i + 1), dtype=torch.float32)
            for i, name in enumerate(spec.scale_names())}


def test_full_set_passes_and_orders_k_then_v(caplog: pytest.LogCaptureFixture) -> None:
    spec = make_spec()
    with caplog.at_level(logging.INFO, logger="kvcap.scales.gate"):
        k, v = run_gate(spec, full_scales(spec), "test-source sha256:abc")
    assert k == [pytest.approx(0.01 * (2 * i + 1)) for i in range(N_LAYERS)]
    assert v == [pytest.approx(0.01 * (2 * i + 2)) for i in range(N_LAYERS)]
    assert f"gate passed: loaded {2 * N_LAYERS}/{2 * N_LAYERS} K/V scales" in caplog.text
    assert "sha256:abc" in caplog.text


def test_unit_scales_are_legal_loaded_values() -> None:
    spec = make_spec()
    found = {name: torch.tensor(1.0) for name in spec.scale_names()}
    k, v = run_gate(spec, found, "unit")
    assert k == [1.0] * N_LAYERS and v == [1.0] * N_LAYERS


def test_sentinel_value_is_refused_as_invalid_not_missing() -> None:
    spec = make_spec()
    found = full_scales(spec)
    found["model.layers.2.self_attn.v_scale"] = torch.tensor(SENTINEL)
    with pytest.raises(ScaleGateError, match=r"invalid: layer 2 V = -1\.0"):
        run_gate(spec, found, "t")


def test_none_loaded() -> None:
    spec = make_spec()
    with pytest.raises(ScaleGateError) as e:
        run_gate(spec, {}, "t")
    msg = str(e.value)
    assert msg.startswith(f"Loaded 0/{2 * N_LAYERS} K/V scales. Missing: ")
    assert "model.layers.0.self_attn.k_scale" in msg and "\n" not in msg


@pytest.mark.parametrize("drop", ["model.layers.0.self_attn.k_scale",
                                  "model.layers.3.self_attn.v_scale"])
def test_one_missing(drop: str) -> None:
    spec = make_spec()
    found = full_scales(spec)
    del found[drop]
    with pytest.raises(ScaleGateError,
                       match=rf"^Loaded {2 * N_LAYERS - 1}/{2 * N_LAYERS} K/V scales\. "
                             rf"Missing: {drop}$"):
        run_gate(spec, found, "t")


def test_long_missing_list_stays_one_line() -> None:
    spec = make_spec(40)
    with pytest.raises(ScaleGateError, match=r"and 68 more\)$"):
        run_gate(spec, {}, "t")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.0, -0.0, -0.5])
@pytest.mark.parametrize("layer", range(N_LAYERS))
@pytest.mark.parametrize("kind", ["K", "V"])
def test_invalid_values_name_layer_and_tensor(bad: float, layer: int, kind: str) -> None:
    spec = make_spec()
    found = full_scales(spec)
    found[f"model.layers.{layer}.self_attn.{kind.lower()}_scale"] = torch.tensor(bad)
    with pytest.raises(ScaleGateError, match=rf"invalid: layer {layer} {kind} = "):
        run_gate(spec, found, "t")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_scalars_accepted(dtype: torch.dtype) -> None:
    spec = make_spec()
    found = {k: t.to(dtype) for k, t in full_scales(spec).items()}
    k, _ = run_gate(spec, found, "t")
    assert k[0] == float(torch.tensor(0.01).to(dtype).float())


@pytest.mark.parametrize("tensor", [
    torch.tensor(1, dtype=torch.int32),
    torch.tensor(0.5, dtype=torch.float64),
    torch.tensor(0.5).to(torch.float8_e4m3fn),
    torch.tensor([0.5, 0.5]),
    torch.tensor([[0.5]]),
    torch.zeros(0),
])
def test_wrong_dtype_or_shape(tensor: torch.Tensor) -> None:
    spec = make_spec()
    found = full_scales(spec)
    found["model.layers.1.self_attn.k_scale"] = tensor
    with pytest.raises(ScaleGateError, match=r"model\.layers\.1\.self_attn\.k_scale has "):
        run_gate(spec, found, "t")


def test_one_element_vector_accepted() -> None:
    spec = make_spec()
    found = {k: t.reshape(1) for k, t in full_scales(spec).items()}
    k, v = run_gate(spec, found, "t")
    assert len(k) == len(v) == N_LAYERS


@pytest.mark.parametrize("k_alias,v_alias", [
    ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
    ("self_attn.attn.k_scale", "self_attn.attn.v_scale"),
])
def test_mainstream_aliases(k_alias: str, v_alias: str) -> None:
    spec = make_spec()
    found = {}
    for layer in range(N_LAYERS):
        found[f"model.layers.{layer}.{k_alias}"] = torch.tensor(0.1 + layer)
        found[f"model.layers.{layer}.{v_alias}"] = torch.tensor(0.2 + layer)
    for name in found:
        assert is_kv_scale_name(name)
    k, v = run_gate(spec, found, "t")
    assert k == [pytest.approx(0.1 + i) for i in range(N_LAYERS)]
    assert v == [pytest.approx(0.2 + i) for i in range(N_LAYERS)]


def test_conflicting_aliases_refused_equal_ones_accepted() -> None:
    spec = make_spec()
    found = full_scales(spec)
    found["model.layers.0.self_attn.attn.k_scale"] = found["model.layers.0.self_attn.k_scale"]
    run_gate(spec, found, "t")
    found["model.layers.0.self_attn.attn.k_scale"] = torch.tensor(0.5)
    with pytest.raises(ScaleGateError, match="conflicting K/V scales for layer 0 K"):
        run_gate(spec, found, "t")


@pytest.mark.parametrize("extra", [
    "model.layers.4.self_attn.k_scale",  # layer out of range
    "transformer.h.0.self_attn.k_scale",  # another prefix
    "model.layers.0.self_attn.kv_scale",  # legacy combined scale
])
def test_unrecognized_scale_names_refused(extra: str) -> None:
    spec = make_spec()
    found = full_scales(spec)
    found[extra] = torch.tensor(0.5)
    with pytest.raises(ScaleGateError, match="unrecognized K/V scale tensors"):
        run_gate(spec, found, "t")


@pytest.mark.parametrize("name,expected", [
    ("model.layers.3.self_attn.k_scale", True),
    ("model.layers.3.self_attn.v_scale", True),
    ("model.layers.3.self_attn.k_proj.output_scale", True),
    ("model.layers.3.self_attn.v_proj.output_scale", True),
    ("model.layers.3.self_attn.attn.v_scale", True),
    ("model.layers.3.self_attn.kv_scale", True),
    ("model.layers.3.self_attn.k_proj.weight", False),
    ("model.layers.3.self_attn.k_proj.weight_scale", False),
    ("model.layers.3.self_attn.k_proj.input_scale", False),
    ("model.layers.3.self_attn.q_proj.output_scale", False),
    ("model.layers.3.self_attn.o_proj.output_scale", False),
    ("model.layers.3.mlp.k_scale_proj.weight", False),
    ("model.embed_tokens.weight", False),
])
def test_is_kv_scale_name(name: str, expected: bool) -> None:
    assert is_kv_scale_name(name) is expected


def test_non_kv_attention_scales_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    spec = make_spec()
    found = full_scales(spec)
    found["model.layers.0.self_attn.q_scale"] = torch.tensor(0.5)
    found["model.layers.0.self_attn.prob_scale"] = torch.tensor(0.5)
    with caplog.at_level(logging.WARNING, logger="kvcap.scales.gate"):
        k, _ = run_gate(spec, found, "t")
    assert "ignoring 2 non-K/V scale tensors" in caplog.text
    assert k[0] == pytest.approx(0.01)
    del found["model.layers.0.self_attn.k_scale"]
    with pytest.raises(ScaleGateError, match=r"Loaded 7/8 K/V scales"):
        run_gate(spec, found, "t")
