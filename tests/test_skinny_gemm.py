"""The weight-streaming decode GEMM against torch (CPU interpreter; compiled on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcap.kernels.skinny_gemm import skinny_linear  # noqa: E402

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


def test_split_state_is_never_created_during_graph_capture(monkeypatch):
    """The split-K partials and counters of a new launch shape are allocated by an eager call;
    a first call inside CUDA graph capture is refused with what to do (checked before any
    allocation, so the CPU can test it)."""
    from kvcap.kernels import skinny_gemm

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="make one call of this shape before capturing"):
        skinny_gemm.split_state(torch.device("cuda", 0), 7, 3, 16, 32)
    assert (torch.device("cuda", 0), 7, 3, 16, 32) not in skinny_gemm._SPLIT_STATE


@pytest.mark.parametrize("bn,split", [(128, 1), (128, 4), (256, 2)])
def test_wide_tiles_at_64_rows(bn, split):
    """The wide column tiles `python -m kvcap.bench.gemm --block-ns 128 256` sweeps at 64 rows,
    split and unsplit, match torch (a partial last tile, K not a multiple of the split)."""
    g = torch.Generator().manual_seed(bn + split)
    x = torch.randn(64, 200, generator=g).to(DEV, torch.float16)
    w = (torch.randn(bn + 24, 200, generator=g) * 0.1).to(DEV, torch.float16)
    got = skinny_linear(x, w, block_n=bn, block_k=32, split_k=split)
    torch.testing.assert_close(got.float(), x.float() @ w.float().t(), rtol=2e-3, atol=2e-3)


def test_gemm_sweep_block_ns():
    from kvcap.bench.gemm import sweep_configs

    default = sweep_configs(stages=(3,), splits=(1, 2), warps=(4, 8))
    assert {c["block_n"] for c in default} == {16, 32, 64}
    assert {c["num_warps"] for c in default if "split_k" in c} == {4}
    wide = sweep_configs(stages=(3,), splits=(1, 2), warps=(4, 8), block_ns=(128, 256))
    assert {c["block_n"] for c in wide} == {128, 256}
    assert {(c["block_n"], c["num_warps"]) for c in wide if c.get("split_k") == 2} == \
        {(128, 4), (128, 8), (256, 4), (256, 8)}


HOPPER_SHARED_BYTES = 232448  # an SM's opt-in shared memory on sm_90 (H100 / H200)
# (n, k) of the Llama-3.1-8B and -70B decode linears: QKV, o_proj, down_proj, LM head
LINEARS = [(6144, 4096), (4096, 4096), (4096, 14336), (128256, 4096),
           (10240, 8192), (8192, 8192), (8192, 28672), (128256, 8192)]


@pytest.mark.parametrize("rows", [1, 16, 17, 32, 33, 48, 64])
def test_default_launches_fit_an_sms_shared_memory(rows):
    """Every default launch of skinny_linear / skinny_swiglu, at every decode row count it
    takes, holds its pipeline in an SM's shared memory. Above 32 rows the activation tile is 64
    rows: down_proj's 16-row launch (256-wide K steps, 5 stages) would need 245,760 bytes there
    -- what an H100 refused with OutOfResources under KVCAP_SKINNY_GEMM_MAX_ROWS=64."""
    from kvcap.kernels.skinny_gemm import default_config, pipeline_bytes, swiglu_config

    cuda = torch.device("cuda", 0)
    assert pipeline_bytes(64, 32, 256, 5) == 245760 > HOPPER_SHARED_BYTES
    for n, k in LINEARS:
        bn, bk, _, stages, _ = default_config(n, k, rows, cuda)
        assert pipeline_bytes(rows, bn, bk, stages) <= HOPPER_SHARED_BYTES, (n, k, rows)
    bn, bk, _, stages = swiglu_config(rows, cuda)
    assert pipeline_bytes(rows, bn, bk, stages, weight_tiles=2) <= HOPPER_SHARED_BYTES


def test_default_launch_at_64_rows_matches_torch():
    """The 64-row default launch of a down_proj-shaped linear (K twice N or more: 64-column
    tiles, K split in two) -- the interpreter runs it on the CPU configuration's tiles, a GPU
    on the real ones."""
    g = torch.Generator().manual_seed(64)
    x = torch.randn(64, 512, generator=g).to(DEV, torch.float16)
    w = (torch.randn(96, 512, generator=g) * 0.1).to(DEV, torch.float16)
    got = skinny_linear(x, w)
    torch.testing.assert_close(got.float(), x.float() @ w.float().t(), rtol=2e-3, atol=2e-3)
