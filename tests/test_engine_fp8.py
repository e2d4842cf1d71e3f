"""E4M3 KV end to end on the embedded model: the gate refuses without scales; with explicit,
distinct non-unit scales the engine's logits equal an FP32 engine whose K/V are
quantize-dequantized by torch's own float8_e4m3fn (an independent reference)."""

from __future__ import annotations

import pytest
import torch

from kvcap import LLM, SamplingParams
from kvcap.attention.torch_ref import TorchReferenceBackend
from kvcap.errors import ScaleGateError


def make_scales(spec) -> dict[str, float]:
    # Distinct, non-unit, per layer and per tensor: a missing or swapped descale shows.
    out = {}
    for layer in range(spec.num_layers):
        out[f"model.layers.{layer}.self_attn.k_scale"] = 0.011 + 0.0031 * (layer % 7)
        out[f"model.layers.{layer}.self_attn.v_scale"] = 0.004 + 0.0017 * (layer % 5)
    return out


class QDQBackend(TorchReferenceBackend):
    """FP32 cache holding torch-float8 quantize-dequantized K/V (scales from a dict)."""

    def __init__(self, k_scales, v_scales):
        super().__init__()
        self.k_scales, self.v_scales = k_scales, v_scales

    def forward(self, q, k, v, cache, meta, softmax_scale, out):
        ks, vs = self.k_scales[cache.layer_idx], self.v_scales[cache.layer_idx]
        qdq = lambda x, s: ((x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
                            .float() * s).to(x.dtype)
        return super().forward(q, qdq(k, ks), qdq(v, vs), cache, meta, softmax_scale, out)


@pytest.fixture(scope="module")
def spec(default_model_dir):
    from kvcap.models.loader import read_spec

    return read_spec(default_model_dir)


def test_fp8_without_scales_refuses_to_start(default_model_dir, spec):
    n = 2 * spec.num_layers
    with pytest.raises(ScaleGateError, match=f"Loaded 0/{n} K/V scales. Missing: "):
        LLM(model=str(default_model_dir), kv_cache_dtype="fp8_e4m3", device="cpu", num_blocks=64)


def test_fp8_with_one_scale_missing_refuses(default_model_dir, spec):
    scales = make_scales(spec)
    scales.pop("model.layers.17.self_attn.v_scale")
    with pytest.raises(ScaleGateError, match=r"Loaded 59/60 K/V scales. Missing: "
                                              r"model\.layers\.17\.self_attn\.v_scale"):
        LLM(model=str(default_model_dir), kv_cache_dtype="fp8_e4m3", kv_scales=scales,
            device="cpu", num_blocks=64)


def test_fp8_logits_match_qdq_reference(default_model_dir, spec):
    scales = make_scales(spec)
    llm = LLM(model=str(default_model_dir), kv_cache_dtype="fp8_e4m3", kv_scales=scales,
              device="cpu", max_num_batched_tokens=48, num_blocks=128)
    assert llm.pool.k_caches[0].dtype == torch.uint8
    ids = llm.tokenizer.encode("Paris is the capital and largest city of France, with an "
                               "estimated population of two million residents. It is")
    ours = llm.prompt_logits([ids])[0]

    ref_llm = LLM(model=str(default_model_dir), device="cpu", max_num_batched_tokens=48,
                  num_blocks=128)
    ks = [scales[f"model.layers.{i}.self_attn.k_scale"] for i in range(spec.num_layers)]
    vs = [scales[f"model.layers.{i}.self_attn.v_scale"] for i in range(spec.num_layers)]
    ref_llm.runner.backend = QDQBackend(ks, vs)
    ref = ref_llm.prompt_logits([ids])[0]
    assert (ours - ref).abs().max().item() < 2e-3
    # and it is really quantized: it differs from the unquantized FP32 engine
    plain = LLM(model=str(default_model_dir), device="cpu", max_num_batched_tokens=48,
                num_blocks=128).prompt_logits([ids])[0]
    assert (ours - plain).abs().max().item() > 1e-3

    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert len(out[0].token_ids) >= 1 and out[0].finish_reason in ("stop", "length")
