"""Fused decoder-layer kernels (residual add + RMSNorm, RoPE + q/k/v split, SiLU-mul) against
their torch twins in kvcap.models.llama (interpreter on CPU, compiled on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from kvcap.kernels import fused_ops  # noqa: E402
from kvcap.models.llama import RMSNorm, rotate_half  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The CPU interpreter converts to bf16 by truncation, not round-to-nearest (a known
# interpreter limitation, as for its bf16 tl.dot): bf16 is checked on GPUs only.
DTYPES = [torch.float16, torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEV == "cpu", reason="Triton interpreter rounds bf16 by truncation"))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 576])
def test_add_rms_norm_matches_torch(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=g) * 3).to(DEV, dtype)
    r = (torch.randn(7, hidden, generator=g) * 3).to(DEV, dtype)
    norm = RMSNorm(hidden, 1e-5).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
        s = x + r
        want = norm._norm(s)
        out, res = fused_ops.add_rms_norm(x, norm.weight, 1e-5, r)
        alone = fused_ops.add_rms_norm(x, norm.weight, 1e-5)
    assert torch.equal(res, s)  # the residual sum rounds exactly where torch rounds it
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    torch.testing.assert_close(alone, norm._norm(x), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 1, 16), (2, 2, 128)])
def test_rope_split_matches_torch(dtype, hq, hkv, d):
    g = torch.Generator().manual_seed(d + hq)
    t = 5
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(DEV, dtype)
    ang = torch.rand(t, 1, d, generator=g) * 6
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    q, k, v = fused_ops.rope_split_qkv(qkv, cos, sin, hq, hkv, d)
    q0, k0, v0 = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q0, k0, v0 = q0.view(t, hq, d), k0.view(t, hkv, d), v0.view(t, hkv, d)
    assert torch.equal(q, q0 * cos + rotate_half(q0) * sin)  # same roundings, bit for bit
    assert torch.equal(k, k0 * cos + rotate_half(k0) * sin)
    assert torch.equal(v, v0) and q.is_contiguous() and k.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 2 * 1536, generator=g) * 4).to(DEV, dtype)
    gate, up = x.split(1536, dim=-1)
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(fused_ops.silu_mul(x), F.silu(gate) * up, rtol=tol, atol=tol)


def test_empty_batches_and_switch(monkeypatch):
    from kvcap.models.llama import FUSED_OPS_ENV, fused_ops_for

    w = torch.ones(64, device=DEV)
    assert fused_ops.add_rms_norm(torch.empty(0, 64, device=DEV), w, 1e-6).shape == (0, 64)
    assert fused_ops.silu_mul(torch.empty(0, 32, device=DEV)).shape == (0, 16)
    monkeypatch.setenv(FUSED_OPS_ENV, "1")
    assert fused_ops_for(torch.empty(1, device=DEV)) is None
    monkeypatch.delenv(FUSED_OPS_ENV)
    assert (fused_ops_for(torch.empty(1, device=DEV)) is fused_ops) == (DEV == "cuda")
