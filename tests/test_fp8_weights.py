"""FP8 (E4M3) weight checkpoints load dequantized: transformers' fine-grained FP8 format against
transformers' own dequantizing load, compressed-tensors and FBGEMM FP8 (per-tensor, per-row
and block scales, blocks that do not divide the weight) against transformers running the
dequantized weights; what cannot be loaded is refused by name."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvcap import LLM
from kvcap.errors import ConfigError, ModelLoadError

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False)


def _scales(w: torch.Tensor, granularity) -> torch.Tensor:
    """amax / 448 over the whole tensor ("tensor"), each row ("channel") or (b0, b1) blocks,
    one block at a time (no broadcasting trick shared with the code under test)."""
    if granularity == "tensor":
        return (w.abs().max() / 448).reshape(1)
    if granularity == "channel":
        return w.abs().amax(dim=1, keepdim=True) / 448
    b0, b1 = granularity
    rows, cols = math.ceil(w.shape[0] / b0), math.ceil(w.shape[1] / b1)
    s = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            s[i, j] = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].abs().max() / 448
    return s


def _expand(s: torch.Tensor, shape, granularity) -> torch.Tensor:
    if granularity in ("tensor", "channel"):
        return s.expand(shape) if granularity == "channel" else s.reshape(()).expand(shape)
    out = torch.empty(shape)
    b0, b1 = granularity
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = s[i, j]
    return out


def _fp8_checkpoint(tmp_path, granularity, scale_name: str, qc: dict, arch: str = "llama"):
    """A tiny random Llama whose projections are stored in E4M3 with `scale_name` scales (and
    an activation scale, which kvcap drops); lm_head, embeddings and norms stay FP32. Returns
    (transformers model with the dequantized weights, token ids)."""
    import transformers as tf

    torch.manual_seed(0)
    if arch == "phi3":  # fused qkv_proj / gate_up_proj, one scale set for each fused tensor
        hf = tf.Phi3ForCausalLM(tf.Phi3Config(**COMMON, pad_token_id=0, bos_token_id=1,
                                              eos_token_id=2))
    else:
        hf = tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON))
    hf = hf.float().eval()
    hf.save_pretrained(tmp_path)
    tensors, dequantized = {}, {}
    for name, w in load_file(tmp_path / "model.safetensors").items():
        if not name.endswith("_proj.weight"):
            tensors[name] = w
            continue
        s = _scales(w, granularity)
        w8 = (w / _expand(s, w.shape, granularity)).to(torch.float8_e4m3fn)
        prefix = name[: -len(".weight")]
        tensors[name] = w8
        tensors[f"{prefix}.{scale_name}"] = s
        tensors[f"{prefix}.input_scale"] = torch.tensor([0.02])
        dequantized[name] = w8.float() * _expand(s, w.shape, granularity)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in dequantized:
                p.copy_(dequantized[name])
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (1, 60), generator=gen)
    return hf, ids


def _logits(tmp_path, ids, monkeypatch, device: str = "cpu", **engine) -> torch.Tensor:
    from kvcap.models import loader

    monkeypatch.setattr(loader, "load_tokenizer", lambda _dir: None)
    engine.setdefault("dtype", "float32")
    llm = LLM(model=str(tmp_path), device=device, num_blocks=16, **engine)
    return llm.prompt_logits([ids[0].tolist()])[0].cpu()


def _compressed(strategy: str, block=None) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
               **({"block_structure": list(block)} if block else {})}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": {"num_bits": 8, "type": "float",
                                                                "strategy": "tensor"}}},
            "ignore": ["lm_head"]}


def test_fine_grained_fp8_matches_transformers_own_load(tmp_path, monkeypatch):
    """quant_method fp8, 32 x 32 blocks in weight_scale_inv: transformers dequantizes such a
    checkpoint itself on a machine without a GPU; kvcap's logits equal its logits. (With a GPU
    transformers would run its own FP8 kernels, from the `kernels` package, instead: the
    reference load is made to see none.)"""
    import transformers as tf

    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    _, ids = _fp8_checkpoint(tmp_path, (32, 32), "weight_scale_inv", qc)
    with monkeypatch.context() as cpu_only:
        cpu_only.setattr(torch.cuda, "is_available", lambda: False)
        ref_model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(ids).logits[0]
    assert (_logits(tmp_path, ids, monkeypatch) - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("granularity, qc, scale_name, arch", [
    ("tensor", _compressed("tensor"), "weight_scale", "llama"),
    ("channel", _compressed("channel"), "weight_scale", "llama"),
    ((48, 40), _compressed("block", (48, 40)), "weight_scale", "llama"),  # cut at the edges
    ("channel", {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, "weight_scale",
     "llama"),
    ("tensor", _compressed("tensor"), "weight_scale", "phi3"),  # dequantized, then split
])
def test_fp8_formats_match_their_dequantized_weights(tmp_path, monkeypatch, granularity, qc,
                                                     scale_name, arch):
    hf, ids = _fp8_checkpoint(tmp_path, granularity, scale_name, qc, arch)
    with torch.no_grad():
        ref = hf(ids).logits[0]
    assert (_logits(tmp_path, ids, monkeypatch) - ref).abs().max().item() < 1e-4


def test_missing_or_misshaped_scales_are_refused(tmp_path, monkeypatch):
    _, ids = _fp8_checkpoint(tmp_path, "channel", "weight_scale", _compressed("channel"))
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = torch.ones(5)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"down_proj.weight_scale: scale of shape \(5,\)"):
        _logits(tmp_path, ids, monkeypatch)
    del tensors[name]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="1 FP8 weights have no weight_scale"):
        _logits(tmp_path, ids, monkeypatch)


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     "4-bit int weights"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {}}},
     "has no `weights` scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
])
def test_other_weight_formats_are_refused_by_name(qc, message):
    from kvcap.config import ModelSpec

    cfg = {"architectures": ["LlamaForCausalLM"], **COMMON, "quantization_config": qc}
    with pytest.raises(ConfigError, match=message):
        ModelSpec.from_hf_config(cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_weights_dequantize_on_the_gpu(tmp_path, monkeypatch):
    """On a GPU the E4M3 bytes travel to the device and are multiplied out there: the same
    logits as the host's dequantization."""
    _, ids = _fp8_checkpoint(tmp_path, (48, 40), "weight_scale", _compressed("block", (48, 40)))
    cpu = _logits(tmp_path, ids, monkeypatch)
    assert (_logits(tmp_path, ids, monkeypatch, "cuda") - cpu).abs().max().item() < 1e-3


def test_a_scale_may_come_before_its_weight():
    """Across shards a scale can stream in before its weight: each E4M3 weight is paired with
    its scale whichever comes first, and what passes through keeps its place."""
    from kvcap.models.fp8_weights import FP8Weights, dequantized

    w = torch.randn(4, 8)
    s = w.abs().amax(dim=1, keepdim=True) / 448
    w8 = (w / s).to(torch.float8_e4m3fn)
    norm = torch.ones(8)
    stream = [("a.weight", w8), ("a.weight_scale", s), ("n.weight", norm),
              ("b.weight_scale", s), ("b.input_scale", torch.tensor([0.1])), ("b.weight", w8)]
    out = list(dequantized(stream, FP8Weights("compressed-tensors")))
    assert [n for n, _ in out] == ["a.weight", "n.weight", "b.weight"]
    assert torch.equal(out[0][1], w8.float() * s) and torch.equal(out[2][1], w8.float() * s)
    assert out[1][1] is norm
    with pytest.raises(ModelLoadError,
                       match="1 weight scales have no FP8 weight in the checkpoint, e.g. b$"):
        list(dequantized(stream[:4], FP8Weights("compressed-tensors")))
