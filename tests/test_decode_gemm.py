"""The decode-size GEMM rule (kvcap.models.decode_gemm) and the fused gate/up + SiLU kernel."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcap.kernels.skinny_gemm import MAX_ROWS, skinny_swiglu  # noqa: E402
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
def test_swiglu_refuses_what_it_cannot_do():
    w = torch.randn(16, 32, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="even row count"):
        skinny_swiglu(torch.randn(2, 32, dtype=torch.float16, device=DEV), w[:15])
    with pytest.raises(ValueError, match=f"1..{MAX_ROWS} rows"):
        skinny_swiglu(torch.randn(MAX_ROWS + 1, 32, dtype=torch.float16, device=DEV), w)
    with pytest.raises(ValueError, match="x is torch.float32"):
        skinny_swiglu(torch.randn(2, 32, device=DEV), w)


def test_h100_and_h200_take_every_linear_up_to_64_rows(monkeypatch):
    """The SXM H100's and the H200's limits (measured there: every linear of a 64-row step on
    the skinny kernels, every kernel a programmatic dependent) against every other GPU's; the
    override still replaces them."""
    monkeypatch.delenv(decode_gemm.DISABLE_ENV, raising=False)
    monkeypatch.delenv(decode_gemm.MAX_ROWS_ENV, raising=False)
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        assert all(decode_gemm.wants_skinny(kind, 64, name) for kind in decode_gemm.ROW_LIMITS)
        assert not decode_gemm.wants_skinny("down_proj", 65, name)
    for name in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "", "NVIDIA A100-SXM4-80GB"):
        assert decode_gemm.row_limits(name) is decode_gemm.ROW_LIMITS
        assert not decode_gemm.wants_skinny("down_proj", 17, name)
    monkeypatch.setenv(decode_gemm.MAX_ROWS_ENV, "16")
    assert not decode_gemm.wants_skinny("swiglu", 17, "NVIDIA H100 80GB HBM3")


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
    limit = decode_gemm.row_limits(torch.cuda.get_device_name())["swiglu"]
    assert routed == (hopper and rows <= limit)
    got = decode_gemm.swiglu(x, w)
    if routed:
        torch.testing.assert_close(got.float(), _unfused(x, w).float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(decode_gemm.linear(x, w, "lm_head").float(),
                               F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    monkeypatch.setenv(decode_gemm.DISABLE_ENV, "1")
    assert decode_gemm.skinny_for(x, w, "swiglu") is None
