"""The weight-streaming decode GEMM against torch (CPU interpreter; compiled on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcap.kernels.skinny_gemm import RowNorm, norm_operands, skinny_linear  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or the Triton interpreter")


@pytest.mark.parametrize("m,n,k,bn,bk", [(1, 48, 64, 16, 32), (16, 40, 96, 16, 32),
                                         (5, 70, 80, 32, 32), (33, 16, 64, 16, 64)])
def test_matches_torch(m, n, k, bn, bk):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(DEV, torch.float16)
    w = (torch.randn(n, k, generator=g) * 0.1).to(DEV, torch.float16)
    got = skinny_linear(x, w, block_n=bn, block_k=bk)
    want = x.float() @ w.float().t()
    assert got.shape == (m, n) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)


def test_strided_rows_and_out_buffer():
    x = torch.randn(8, 128).to(DEV, torch.float16)[::2]  # row stride 256
    w = torch.randn(32, 64).to(DEV, torch.float16)
    x = x[:, :64]
    out = torch.full((4, 32), 7.0, dtype=torch.float16, device=DEV)
    skinny_linear(x, w, out=out, block_n=16, block_k=32)
    torch.testing.assert_close(out.float(), x.float() @ w.float().t(), rtol=2e-3, atol=2e-3)


def test_refuses_what_it_cannot_do():
    w = torch.randn(16, 32, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="1..64 rows"):
        skinny_linear(torch.randn(65, 32, dtype=torch.float16, device=DEV), w)
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        skinny_linear(torch.randn(4, 16, dtype=torch.float16, device=DEV), w)
    with pytest.raises(ValueError, match="contiguous along K"):
        skinny_linear(torch.randn(32, 4, dtype=torch.float16, device=DEV).t(), w)


@pytest.mark.parametrize("m,n,k,bk,split", [(3, 40, 96, 32, 2), (16, 48, 160, 32, 3),
                                            (1, 16, 64, 32, 4), (7, 33, 100, 32, 2)])
def test_split_k_is_exact_deterministic_and_reusable(m, n, k, bk, split):
    """The in-kernel split-K reduction: matches torch, repeats bit for bit (the partials are
    added in split order whatever order the programs finish in), and leaves its arrival
    counters at 0 so the next call (or graph replay) reduces again."""
    g = torch.Generator().manual_seed(m + n + k + split)
    x = torch.randn(m, k, generator=g).to(DEV, torch.float16)
    w = (torch.randn(n, k, generator=g) * 0.1).to(DEV, torch.float16)
    first = skinny_linear(x, w, block_n=16, block_k=bk, split_k=split)
    torch.testing.assert_close(first.float(), x.float() @ w.float().t(), rtol=2e-3, atol=2e-3)
    for _ in range(2):
        assert torch.equal(skinny_linear(x, w, block_n=16, block_k=bk, split_k=split), first)
    from kvcap.kernels.skinny_gemm import _SPLIT_STATE

    assert _SPLIT_STATE and all(int(cnt.abs().sum()) == 0 for _, cnt in _SPLIT_STATE.values())


def _rms_normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm (kvcap.models.llama.RMSNorm._norm, HF's roundings)."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("m,n,k,bk,split", [(1, 48, 64, 32, 1), (16, 40, 96, 32, 1),
                                            (5, 33, 100, 32, 1), (3, 40, 96, 32, 2),
                                            (16, 48, 160, 32, 3), (7, 33, 100, 32, 2)])
def test_row_norm_residual_and_next_norm_fusions(m, n, k, bk, split):
    """row_norm: the GEMM of RMS-normalised rows from norm_operands' (x * weight, sums of
    squares); residual: the output plus the residual, rounded as the unfused add rounds it --
    bit for bit where the GEMM itself is; next_norm_weight: the next norm's operands from the
    epilogue, which a second GEMM consumes as the unfused norm + GEMM would."""
    g = torch.Generator().manual_seed(m * n + k + split)
    x = (torch.randn(m, k, generator=g) * 3).to(DEV, torch.float16)
    x[0, :4] = 40.0  # an outlier feature: the row scale must come from the whole row
    w = (torch.randn(n, k, generator=g) * 0.1).to(DEV, torch.float16)
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(DEV, torch.float16)
    eps = 1e-5
    xn, sums = norm_operands(x, nw)
    assert torch.equal(xn, (x.float() * nw.float()).to(torch.float16))
    torch.testing.assert_close(sums[0, :m], x.float().pow(2).sum(-1), rtol=1e-5, atol=0)
    got = skinny_linear(xn, w, block_n=16, block_k=bk, split_k=split,
                        row_norm=RowNorm(sums, eps))
    want = _rms_normed(x, nw, eps).double() @ w.double().t()
    torch.testing.assert_close(got.double(), want, rtol=4e-3, atol=4e-3)
    assert torch.equal(skinny_linear(xn, w, block_n=16, block_k=bk, split_k=split,
                                     row_norm=RowNorm(sums, eps)), got)

    res = torch.randn(m, n, generator=g).to(DEV, torch.float16)
    plain = skinny_linear(x, w, block_n=16, block_k=bk, split_k=split)
    summed = skinny_linear(x, w, block_n=16, block_k=bk, split_k=split, residual=res)
    assert torch.equal(summed, (plain.float() + res.float()).to(torch.float16))

    nw2 = (1 + 0.3 * torch.randn(n, generator=g)).to(DEV, torch.float16)
    out, xn2, sums2 = skinny_linear(x, w, block_n=16, block_k=bk, split_k=split, residual=res,
                                    next_norm_weight=nw2)
    assert torch.equal(out, summed) and sums2.shape == (-(-n // 16), sums.shape[1])
    assert torch.equal(xn2, (summed.float() * nw2.float()).to(torch.float16))
    torch.testing.assert_close(sums2.sum(0)[:m], summed.float().pow(2).sum(-1), rtol=1e-5,
                               atol=0)
    w2 = (torch.randn(24, n, generator=g) * 0.1).to(DEV, torch.float16)
    chained = skinny_linear(xn2, w2, block_n=16, block_k=16, row_norm=RowNorm(sums2, eps))
    torch.testing.assert_close(chained.double(),
                               _rms_normed(summed, nw2, eps).double() @ w2.double().t(),
                               rtol=4e-3, atol=4e-3)


def test_fusion_operands_are_checked():
    x = torch.randn(4, 32, dtype=torch.float16, device=DEV)
    w = torch.randn(16, 32, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match=r"norm weight must be a contiguous \[32\] vector"):
        norm_operands(x, torch.ones(16, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match=r"residual must be \[4, 16\]"):
        skinny_linear(x, w, residual=torch.zeros(4, 32, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match=r"next_norm_weight must be a contiguous \[16\]"):
        skinny_linear(x, w, next_norm_weight=torch.ones(32, dtype=torch.float16, device=DEV))
    bad = RowNorm(torch.zeros(3, 8, device=DEV), 1e-5)  # 8 != BLOCK_M 16
    with pytest.raises(ValueError, match=r"sums must be contiguous FP32 \[tiles, 16\]"):
        skinny_linear(x, w, row_norm=bad)
