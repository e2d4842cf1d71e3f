"""The decode-size GEMM rule (kvcap.models.decode_gemm) and the fused gate/up + SiLU kernel."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcap.kernels.skinny_gemm import MAX_ROWS, skinny_swiglu  # noqa: E402
from kvcap.kernels.skinny_gemm import norm_operands as _orig_norm_operands  # noqa: E402
from kvcap.models import decode_gemm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
needs_triton = pytest.mark.skipif(DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="needs CUDA or the Triton interpreter")
# The interpreter's bf16 tl.dot and conversions are not the GPU's (see test_fused_ops): GPU only.
DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEV == "cpu", reason="Triton interpreter's bf16 dot"))]


def _unfused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The model's path without the kernel: gate_up rounded to the dtype, F.silu, product."""
    gate, up = F.linear(x.float(), w.float()).to(x.dtype).chunk(2, dim=-1)
    return (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,inter,k,bn,bk", [(1, 48, 64, 16, 32), (16, 40, 96, 16, 32),
                                             (5, 70, 80, 32, 32), (33, 16, 64, 16, 64)])
def test_swiglu_matches_the_unfused_path(m, inter, k, bn, bk, dtype):
    g = torch.Generator().manual_seed(m * inter + k)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    w = (torch.randn(2 * inter, k, generator=g) * 0.2).to(DEV, dtype)
    got = skinny_swiglu(x, w, block_n=bn, block_k=bk)
    assert got.shape == (m, inter) and got.dtype == dtype
    want = _unfused(x, w)
    gate, up = (x.double() @ w.double().t()).chunk(2, dim=-1)
    exact = F.silu(gate) * up
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got.double(), exact, rtol=2 * tol, atol=2 * tol)
    # Output rows past M are never written; an explicit buffer is filled in place.
    out = torch.full((m, inter), 7.0, dtype=dtype, device=DEV)
    assert skinny_swiglu(x, w, out=out, block_n=bn, block_k=bk) is out
    torch.testing.assert_close(out, got, rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,inter,k,bn,bk", [(1, 48, 64, 16, 32), (16, 40, 96, 16, 32),
                                             (5, 70, 80, 32, 32)])
def test_swiglu_with_a_row_norm(m, inter, k, bn, bk, dtype):
    """row_norm folds the post-attention RMSNorm in (its weighted rows in, the row scale on the
    dots): the unfused path's result on the normalised rows, within the dtype's rounding."""
    from kvcap.kernels.skinny_gemm import RowNorm, norm_operands

    g = torch.Generator().manual_seed(m + inter + k)
    x = (torch.randn(m, k, generator=g) * 4).to(DEV, dtype)
    w = (torch.randn(2 * inter, k, generator=g) * 0.2).to(DEV, dtype)
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(DEV, dtype)
    xn, sums = norm_operands(x, nw)
    got = skinny_swiglu(xn, w, block_n=bn, block_k=bk, row_norm=RowNorm(sums, 1e-5))
    h = x.float()
    normed = nw * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    gate, up = (normed.double() @ w.double().t()).chunk(2, dim=-1)
    # The two paths round the normalised operand differently (x * w, then the row scale on
    # the dots, against x * scale, then w): outputs of a few units differ by an ulp or two,
    # 0.03-0.08 in BF16 (H200), so BF16 is held to an error relative to the outputs' size.
    tol, atol = (2e-2, 0.1) if dtype == torch.bfloat16 else (4e-3, 4e-3)
    want = _unfused(normed, w).float()
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=atol)
    assert float((got.float() - want).norm() / want.norm()) < tol / 2
    torch.testing.assert_close(got.double(), F.silu(gate) * up, rtol=2 * tol, atol=2 * atol)


@needs_triton
def test_swiglu_refuses_what_it_cannot_do():
    w = torch.randn(16, 32, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="even row count"):
        skinny_swiglu(torch.randn(2, 32, dtype=torch.float16, device=DEV), w[:15])
    with pytest.raises(ValueError, match=f"1..{MAX_ROWS} rows"):
        skinny_swiglu(torch.randn(MAX_ROWS + 1, 32, dtype=torch.float16, device=DEV), w)
    with pytest.raises(ValueError, match="x is torch.float32"):
        skinny_swiglu(torch.randn(2, 32, device=DEV), w)


def test_rule_rows_switch_and_override(monkeypatch):
    monkeypatch.delenv(decode_gemm.DISABLE_ENV, raising=False)
    monkeypatch.delenv(decode_gemm.MAX_ROWS_ENV, raising=False)
    assert decode_gemm.SKINNY_MAX_ROWS == MAX_ROWS
    for kind, limit in decode_gemm.ROW_LIMITS.items():
        assert decode_gemm.wants_skinny(kind, 1) == (limit >= 1)
        assert decode_gemm.wants_skinny(kind, limit) and not decode_gemm.wants_skinny(kind, 0)
        assert not decode_gemm.wants_skinny(kind, limit + 1)
    monkeypatch.setenv(decode_gemm.MAX_ROWS_ENV, "4")
    assert decode_gemm.wants_skinny("o_proj", 4) and not decode_gemm.wants_skinny("o_proj", 5)
    monkeypatch.setenv(decode_gemm.MAX_ROWS_ENV, "0")
    assert not decode_gemm.wants_skinny("lm_head", 1)
    monkeypatch.setenv(decode_gemm.MAX_ROWS_ENV, "many")
    with pytest.raises(ValueError, match="not an integer row count"):
        decode_gemm.wants_skinny("lm_head", 1)
    monkeypatch.delenv(decode_gemm.MAX_ROWS_ENV)
    monkeypatch.setenv(decode_gemm.DISABLE_ENV, "1")
    assert not any(decode_gemm.wants_skinny(kind, 1) for kind in decode_gemm.ROW_LIMITS)


def test_cpu_tensors_stay_on_torch():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    w = torch.randn(6, 8, dtype=torch.bfloat16)
    assert decode_gemm.skinny_for(x, w, "o_proj") is None
    assert decode_gemm.swiglu(x, w) is None
    torch.testing.assert_close(decode_gemm.linear(x, w, "lm_head"), F.linear(x, w))
    layer = decode_gemm.DecodeLinear(8, 6, "o_proj")
    assert layer.bias is None and layer.kind == "o_proj"
    torch.testing.assert_close(layer(x.float()), F.linear(x.float(), layer.weight))


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs a compiled GPU run")
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_model_linears_route_on_hopper(rows, monkeypatch):
    """On SM 9.x the rule sends decode rows to the skinny kernels, and they agree with cuBLAS."""
    monkeypatch.delenv(decode_gemm.DISABLE_ENV, raising=False)
    monkeypatch.delenv(decode_gemm.MAX_ROWS_ENV, raising=False)
    hopper = torch.cuda.get_device_capability()[0] == 9
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * 384, 512, device="cuda", dtype=torch.bfloat16) * 0.05
    routed = decode_gemm.skinny_for(x, w, "swiglu") is not None
    assert routed == (hopper and rows <= decode_gemm.ROW_LIMITS["swiglu"])
    got = decode_gemm.swiglu(x, w)
    if routed:
        torch.testing.assert_close(got.float(), _unfused(x, w).float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(decode_gemm.linear(x, w, "lm_head").float(),
                               F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    monkeypatch.setenv(decode_gemm.DISABLE_ENV, "1")
    assert decode_gemm.skinny_for(x, w, "swiglu") is None


def _tiny_model(seed: int, dtype: torch.dtype, qkv_bias: bool = False):
    from kvcap.config import ModelSpec
    from kvcap.models.llama import LlamaModel

    spec = ModelSpec.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 3, "intermediate_size": 96,
        "vocab_size": 32, "max_position_embeddings": 128, "rms_norm_eps": 1e-5})
    if qkv_bias:
        spec = dataclasses.replace(spec, qkv_bias=True)
    model = LlamaModel(spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.1)
                    + (1.0 if p.dim() == 1 else 0.0))
    model = model.to(DEV, dtype)
    # The attention itself is not what the fold changes: a fixed function of q|k|v stands in.
    for layer in model.layers:
        layer.self_attn.attend = lambda qkv, cos, sin, ctx: (qkv[:, :64] * 0.5).contiguous()
    return model


@needs_triton
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_folded_decode_step_matches_the_unfolded_model(rows, monkeypatch):
    """A decode step whose layers run folded (norms inside the QKV and gate/up GEMMs, residual
    adds and the next norm's operands in the o_proj / down_proj epilogues) gives the unfolded
    model's final hidden states within FP16 rounding; it folds only decode steps of small
    batches, not when hooks watch a layer's interface, not with a QKV bias, not when off."""
    import types

    from kvcap.kernels import skinny_gemm

    monkeypatch.delenv(decode_gemm.NORM_FOLD_ENV, raising=False)
    monkeypatch.delenv(decode_gemm.MAX_ROWS_ENV, raising=False)
    monkeypatch.delenv(decode_gemm.DISABLE_ENV, raising=False)
    # The rule admits Hopper GPUs only: here the kernels run wherever the test does.
    monkeypatch.setattr(decode_gemm, "_kernels_for", lambda x, *w: skinny_gemm)
    folds = []
    monkeypatch.setattr(skinny_gemm, "norm_operands",
                        lambda *a: folds.append(1) or _orig_norm_operands(*a))
    model = _tiny_model(rows, torch.float16)
    decode = types.SimpleNamespace(meta=types.SimpleNamespace(is_decode_only=True))
    prefill = types.SimpleNamespace(meta=types.SimpleNamespace(is_decode_only=False))
    g = torch.Generator().manual_seed(100 + rows)
    ids = torch.randint(0, 32, (rows,), generator=g).to(DEV)
    pos = torch.arange(rows, device=DEV)

    got = model(ids, pos, decode)
    assert len(folds) == 1 and got.shape == (rows, 64)
    want = model(ids, pos, prefill)  # the unfolded layers
    assert len(folds) == 1
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(model(ids, pos, decode), got) and len(folds) == 2

    monkeypatch.setenv(decode_gemm.NORM_FOLD_ENV, "1")
    model(ids, pos, decode)
    monkeypatch.delenv(decode_gemm.NORM_FOLD_ENV)
    handle = model.layers[1].register_forward_pre_hook(lambda mod, args: None)
    model(ids, pos, decode)
    handle.remove()
    model(torch.zeros(17, dtype=torch.long, device=DEV), torch.arange(17, device=DEV),
          decode)  # past down_proj's 16 rows
    _tiny_model(rows, torch.float16, qkv_bias=True)(ids, pos, decode)
    assert len(folds) == 2
