"""FP8 weights kept in FP8: the weight-only FP8 GEMM and dequantization kernels against their
torch twin (CPU interpreter; compiled on a GPU), FP8Linear's scale layouts, and whole models
loaded with fp8_weights='keep' against the dequantized load and transformers."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_fp8_weights import _compressed, _fp8_checkpoint, _logits  # noqa: E402

from kvcap.errors import ConfigError, ModelLoadError  # noqa: E402
from kvcap.models.fp8_linear import FP8Linear, dequantize_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
kernels = pytest.mark.skipif(DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                             reason="needs CUDA or the Triton interpreter")


def _weights(n: int, k: int, row_block: int, k_group: int, seed: int):
    """Random E4M3 bytes spread over the whole format (subnormals to 448, both signs, no NaN)
    and FP32 group scales of different sizes."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // row_block), -(-k // k_group), generator=g) * 1e-2 + 1e-4
    return w.view(torch.uint8).to(DEV), s.to(DEV)


@kernels
@pytest.mark.parametrize("m,n,k,row_block,k_group", [
    (1, 48, 64, 1, 64),      # one scale a row
    (16, 40, 96, 16, 32),    # 16 x 32 blocks, N not a whole tile
    (5, 33, 80, 1, 16),      # groups of 16 along K, odd N
    (17, 64, 128, 32, 128),  # 17 rows: two 16-row tiles on the CPU
    (70, 64, 80, 1, 80),     # K not a multiple of the K step
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["native", "software"])
def test_gemm_matches_its_twin(m, n, k, row_block, k_group, dtype, mode):
    from kvcap.kernels.fp8_gemm import fp8_linear

    w, s = _weights(n, k, row_block, k_group, m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEV, dtype)
    bias = torch.randn(n).to(DEV, dtype)
    want = x.float() @ dequantize_reference(w, s, row_block, k_group).t() + bias.float()
    got = fp8_linear(x, w, s, row_block, k_group, bias, fp8_mode=mode)
    assert got.shape == (m, n) and got.dtype == dtype
    # the twin's FP32 sum against FP32 accumulation, one rounding to the output dtype
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


@kernels
@pytest.mark.parametrize("m,n,k,row_block,k_group,split,swap", [
    (3, 40, 96, 1, 96, 2, False),     # one scale a row: the partials carry it
    (16, 48, 160, 16, 32, 3, False),  # K groups: each split a whole number of groups
    (17, 33, 80, 1, 16, 4, False),    # K not a multiple of the split: the last split is short
    (5, 32, 64, 1, 64, 8, False),     # more splits than K steps: empty ones are dropped
    (20, 48, 96, 16, 32, 2, True),    # operands swapped: partials of transposed tiles
    (20, 48, 96, 16, 32, 2, "tiles"),  # ... whose K groups scale the decoded tiles
])
def test_split_k_is_exact_deterministic_and_reusable(m, n, k, row_block, k_group, split, swap,
                                                     monkeypatch):
    """K split over programs and reduced in the kernel (the skinny GEMM's scheme): the twin's
    result, the same bytes on every call (partials added in split order whatever order the
    programs finish in), the bias added once, and the arrival counters back at 0."""
    from kvcap.kernels import skinny_gemm
    from kvcap.kernels.fp8_gemm import fp8_linear, gemm_config

    monkeypatch.setattr(skinny_gemm, "_SPLIT_STATE", {})

    dtype = torch.float16
    w, s = _weights(n, k, row_block, k_group, m + n + k + split)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(split)).to(DEV, dtype)
    bias = torch.randn(n).to(DEV, dtype)
    want = x.float() @ dequantize_reference(w, s, row_block, k_group).t() + bias.float()
    # 16 x 16 tiles, 16- or 32-wide K steps: several K steps to split on the GPU as on the CPU
    bk = 32 if k_group % 32 == 0 else 16
    cfg = (16, 16, bk, *gemm_config(m, n, k_group, k, x.device)[3:5], bool(swap),
           swap == "tiles")
    first = fp8_linear(x, w, s, row_block, k_group, bias, split_k=split, config=cfg)
    torch.testing.assert_close(first.float(), want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    unsplit = fp8_linear(x, w, s, row_block, k_group, bias, config=cfg)
    torch.testing.assert_close(first, unsplit, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    for _ in range(2):
        assert torch.equal(fp8_linear(x, w, s, row_block, k_group, bias, split_k=split,
                                      config=cfg), first)
    (key, (_, cnt)), = skinny_gemm._SPLIT_STATE.items()  # one split launch shape, reused
    assert key[2] > 1 and int(cnt.abs().sum()) == 0
    with pytest.raises(ValueError, match="1 with swiglu"):
        fp8_linear(x, torch.cat([w, w]), torch.cat([s, s]), row_block, k_group, split_k=2,
                   swiglu=True)


@kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["native", "software"])
def test_dequantize_gives_the_bytes_of_the_torch_dequantization(dtype, mode):
    from kvcap.kernels.fp8_gemm import dequantize_into

    w, s = _weights(70, 200, 16, 48, 3)
    out = torch.full((70, 200), 7.0, dtype=dtype, device=DEV)
    got = dequantize_into(w, s, 16, 48, out, fp8_mode=mode)
    want = dequantize_reference(w, s, 16, 48).to(dtype)
    if dtype == torch.bfloat16 and DEV == "cpu":
        # the CPU interpreter rounds FP32 -> BF16 toward zero; the GPU rounds to nearest
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, want)


@kernels
def test_kernels_refuse_what_they_cannot_do():
    from kvcap.kernels.fp8_gemm import fp8_linear

    w, s = _weights(32, 64, 1, 64, 0)
    x = torch.randn(4, 64, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="1..256 rows"):
        fp8_linear(torch.randn(257, 64, dtype=torch.float16, device=DEV), w, s, 1, 64)
    with pytest.raises(ValueError, match=r"must be FP32 \(32, 1\)"):
        fp8_linear(x, w, s[:16], 1, 64)
    with pytest.raises(ValueError, match="E4M3 bytes"):
        fp8_linear(x, w.to(torch.float16), s, 1, 64)
    with pytest.raises(ValueError, match="FP16/BF16"):
        fp8_linear(x.float(), w, s, 1, 64)
    w8, s8 = _weights(32, 64, 1, 8, 0)
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_linear(x, w8, s8, 1, 8)
    with pytest.raises(ValueError, match=r"config must be .*swap_ab, tile_scales"):
        fp8_linear(x, w, s, 1, 64, config=(16, 16, 32, 1, 1, True))  # before tile_scales
    with pytest.raises(ValueError, match="tile_scales=True .* needs swap_ab=True and scales"):
        fp8_linear(x, w, s, 1, 64, config=(16, 16, 32, 1, 1, True, True))  # one scale a row
    wk, sk = _weights(32, 64, 1, 32, 0)
    with pytest.raises(ValueError, match="tile_scales=True .* needs swap_ab=True"):
        fp8_linear(x, wk, sk, 1, 32, config=(16, 16, 32, 1, 1, False, True))


@kernels
@pytest.mark.parametrize("m,n,k,row_block,k_group,block", [
    (40, 48, 64, 1, 64, (32, 16, 32)),     # one scale a row, two row tiles
    (17, 40, 96, 16, 32, (32, 32, 32)),    # K groups, N not a whole tile
    (70, 33, 80, 1, 16, (64, 16, 16)),     # odd N, K groups of 16
    (33, 64, 80, 1, 80, (16, 32, 32)),     # K not a multiple of the step, three row tiles
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["native", "software"])
def test_swapped_operands_match_the_twin(m, n, k, row_block, k_group, block, dtype, mode):
    """SWAP_AB (weight rows as the MMA's M, Hopper's launch above 32 rows): the twin's result
    for plain, biased and SwiGLU calls, and the unswapped kernel's within FP32 summation order."""
    from kvcap.kernels.fp8_gemm import fp8_linear

    w, s = _weights(n, k, row_block, k_group, m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEV, dtype)
    bias = torch.randn(n).to(DEV, dtype)
    dense = dequantize_reference(w, s, row_block, k_group)
    want = x.float() @ dense.t() + bias.float()
    cfg = (*block, 4, 2, True, False)
    got = fp8_linear(x, w, s, row_block, k_group, bias, fp8_mode=mode, config=cfg)
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    plain = fp8_linear(x, w, s, row_block, k_group, bias, fp8_mode=mode,
                       config=(*block, 4, 2, False, False))
    torch.testing.assert_close(got, plain, rtol=tol, atol=tol * want.abs().max().item())
    if n % (2 * row_block) == 0:  # [gate; up] halves on scale-block boundaries
        fused = fp8_linear(x, w, s, row_block, k_group, fp8_mode=mode, config=cfg, swiglu=True)
        gate_up = (x.float() @ dense.t()).to(dtype).float()
        gate, up = gate_up.chunk(2, dim=-1)
        ref = (torch.nn.functional.silu(gate).to(dtype).float() * up)
        torch.testing.assert_close(fused.float(), ref, rtol=2 * tol,
                                   atol=2 * tol * ref.abs().max().item())


@kernels
@pytest.mark.parametrize("mode", ["native", "software"])
def test_swapped_block_scales_use_the_dequantized_weights(mode):
    """With scales along K and tile_scales the swapped route scales each decoded tile and rounds
    it to the activation dtype before its MMA: the product of dequantize_into's weights
    (prefill's), rounded to FP16, up to FP32 summation order (a last-bit difference in a few
    outputs) -- where the product of the unrounded weights differs in ~40% of them; the
    launch that scales each step's partial lands nearer that product (its FP32 sums are
    ordered otherwise on the GPU's MMAs than in the twin, so not bit for bit)."""
    from kvcap.kernels.fp8_gemm import dequantize_into, fp8_linear

    m, n, k, row_block, k_group = 24, 64, 128, 16, 32  # [gate; up] halves on scale blocks
    w, s = _weights(n, k, row_block, k_group, 11)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).to(DEV, torch.float16)
    got = fp8_linear(x, w, s, row_block, k_group, fp8_mode=mode,
                     config=(16, 16, 32, 4, 2, True, True))
    partials = fp8_linear(x, w, s, row_block, k_group, fp8_mode=mode,
                          config=(16, 16, 32, 4, 2, True, False))
    w16 = dequantize_into(w, s, row_block, k_group,
                          torch.empty(n, k, dtype=torch.float16, device=DEV), fp8_mode=mode)
    rounded = (x.float() @ w16.float().t()).half()
    exact = (x.float() @ dequantize_reference(w, s, row_block, k_group).t()).half()
    torch.testing.assert_close(got, rounded, rtol=2**-10, atol=0)
    assert (got == rounded).float().mean() > 0.98
    assert (got == exact).float().mean() < 0.8
    # (an absolute bound too: an output that cancels to near 0 differs relatively)
    torch.testing.assert_close(partials, exact, rtol=2**-10,
                               atol=2**-10 * exact.abs().max().item())
    # tile_scales picks the rounding: the partials land nearer the unrounded weights' product
    fp32 = x.float() @ dequantize_reference(w, s, row_block, k_group).t()
    assert (partials.float() - fp32).abs().mean() < 0.9 * (got.float() - fp32).abs().mean()
    # the fused SwiGLU on scaled tiles (Hopper's launch above 64 rows): SiLU(gate) * up of
    # the dequantized weights' products
    fused = fp8_linear(x, w, s, row_block, k_group, fp8_mode=mode, swiglu=True,
                       config=(16, 16, 32, 4, 2, True, True))
    gate, up = (x.float() @ w16.float().t()).chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate.half().float()).half().float() * up.half().float()
    torch.testing.assert_close(fused.float(), ref, rtol=2**-9, atol=2**-9 * ref.abs().max().item())


def test_launches_follow_the_h100_measurements():
    """launch_config and gemm_split on an H100 (sm_90, 132 SMs) for the 8B linears give the
    launches measured best on 2026-12-06 (fp8-gemm-2026-12-06-h100-8b.json, the 64-row
    gate/up sweep, the swapped-operand sweeps): decode rows as before, K split in two where the
    tiles leave SMs without a second program, the unswapped 64-row winners where 128 weight
    rows a program fill the SMs, swapped operands elsewhere above 32 rows, scales along K on
    the decoded tiles where the swapped tiles fill the SMs, and a SwiGLU stage counting both
    weight tiles."""
    from kvcap.kernels.common import target_properties
    from kvcap.kernels.fp8_gemm import gemm_split, launch_config

    h100 = target_properties(90)

    def launch(m, n, k, swiglu=False, k_group=None):
        return launch_config(m, n, k_group or k, k, h100, 132, swiglu)

    assert launch(16, 4096, 14336) == (16, 32, 256, 4, 4, False, False)   # down_proj
    assert launch(16, 14336, 4096, swiglu=True) == (16, 32, 256, 4, 4, False, False)
    assert launch(16, 4096, 14336, k_group=128) == (16, 32, 128, 4, 8, False, False)
    a100 = launch_config(64, 28672, 4096, 4096, target_properties(80), 108)
    assert a100 == (64, 128, 128, 4, 3, False, False)  # the gate/up sweep's winner
    assert launch(64, 28672, 4096) == (64, 128, 128, 4, 3, False, False)  # gate/up fills the SMs
    assert launch(64, 14336, 4096, swiglu=True) == (64, 64, 128, 4, 3, False, False)
    assert launch(64, 6144, 4096) == (64, 128, 128, 8, 3, True, False)  # swapped where it does not
    # swapped: 128 weight rows a program, the widest activation tile that keeps 2/3 of the SMs
    assert launch(256, 6144, 4096) == (256, 128, 64, 8, 4, True, False)   # 48 tiles, split in two
    assert launch(256, 28672, 4096) == (256, 128, 64, 8, 4, True, False)  # gate/up: 224 tiles
    # 256-row tiles: 64 programs
    assert launch(256, 4096, 14336) == (128, 128, 128, 8, 3, True, False)
    assert launch(128, 4096, 14336) == (64, 128, 128, 8, 3, True, False)
    # scales along K: one warpgroup a program, 64 weight rows, each step's partial scaled,
    # where those tiles need a K split to fill the SMs (measured faster there) ...
    assert launch(64, 4096, 14336, k_group=128) == (64, 64, 128, 4, 4, True, False)
    assert launch(128, 6144, 4096, k_group=128) == (128, 64, 128, 4, 3, True, False)  # 96 tiles
    assert launch(256, 4096, 4096, k_group=128) == (128, 64, 128, 4, 3, True, False)  # 128 tiles
    assert launch(256, 4096, 14336, k_group=128) == (128, 64, 128, 4, 3, True, False)
    # ... and scaled decoded tiles where they fill it: 128 weight rows where those do too
    assert launch(256, 6144, 4096, k_group=128) == (256, 64, 64, 4, 3, True, True)  # 192 tiles
    assert launch(128, 28672, 4096, k_group=128) == (128, 128, 64, 8, 4, True, True)
    assert launch(256, 28672, 4096, k_group=128) == (256, 128, 64, 8, 4, True, True)
    assert launch(64, 28672, 4096, k_group=128)[5:] == (False, False)  # unswapped at 64 rows
    # K steps still divide smaller K groups
    assert launch(256, 28672, 4096, k_group=32) == (256, 128, 32, 8, 4, True, True)
    assert launch(256, 6144, 4096, k_group=16)[2] == 16
    # the fused SwiGLU above 64 rows: 128 x 128 tiles of gate and up, scaled as decoded
    assert launch(128, 14336, 4096, swiglu=True, k_group=128) == (128, 128, 128, 8, 3, True, True)
    assert launch(256, 14336, 4096, swiglu=True, k_group=128) == (128, 128, 128, 8, 3, True, True)
    assert launch(96, 14336, 4096, swiglu=True, k_group=32) == (128, 128, 32, 8, 3, True, True)
    assert launch(256, 14336, 4096, swiglu=True) == (128, 128, 128, 8, 3, True, False)
    assert launch(32, 6144, 4096)[5] is False                      # decode rows stream
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)):       # QKV, o_proj, down
        assert gemm_split(16, n, launch(16, n, k), 132) == 2
        assert gemm_split(32, n, launch(32, n, k), 132) == 2
        assert gemm_split(64, n, launch(64, n, k), 132) == 2       # 64-96 swapped programs
    assert gemm_split(256, 6144, launch(256, 6144, 4096), 132) == 2    # 48 tiles
    assert gemm_split(256, 28672, launch(256, 28672, 4096), 132) == 1  # 224 tiles
    assert gemm_split(256, 6144, launch(256, 6144, 4096, k_group=128), 132) == 2  # 96 tiles
    assert gemm_split(256, 28672, launch(256, 28672, 4096, k_group=128), 132) == 1
    assert gemm_split(16, 14336, launch(16, 14336, 4096, True), 132, swiglu=True) == 1
    assert gemm_split(16, 28672, launch(16, 28672, 4096), 132) == 1  # 448 tiles: enough
    assert gemm_split(16, 4096, launch(16, 4096, 4096), 0) == 1      # the CPU


def test_the_swap_sweep_covers_the_default_launches():
    """`kvcap.bench.fp8_gemm --sweep swap` times launches the defaults can be judged against:
    on Hopper above 32 rows every swapped default of the 8B linears is among them (with one
    scale a row and with 128 x 128 blocks), their K steps divide a 128-column scale block, the
    block sweep times each swapped launch both ways (partials scaled, tiles scaled), and no
    swapped launch is offered elsewhere."""
    from kvcap.bench.fp8_gemm import sweep_configs
    from kvcap.kernels.common import target_properties
    from kvcap.kernels.fp8_gemm import launch_config

    h100 = target_properties(90)
    for rows, (n, k, swiglu) in itertools.product(
            (64, 128, 256), ((6144, 4096, False), (4096, 4096, False), (4096, 14336, False),
                             (28672, 4096, False), (14336, 4096, True))):
        configs = sweep_configs(rows, grouped=False, hopper=True)
        default = launch_config(rows, n, k, k, h100, 132, swiglu)
        assert all(len(c) == 7 and 128 % c[2] == 0 for c in configs if c[5])
        assert not default[5] or default in configs, (rows, n, swiglu, default)
        assert not any(c[6] for c in configs)  # tile scales only with scales along K
        blocks = sweep_configs(rows, grouped=True, hopper=True)
        block_default = launch_config(rows, n, 128, k, h100, 132, swiglu)
        assert not block_default[5] or block_default in blocks, (rows, n, swiglu, block_default)
        assert {c[:6] for c in blocks if c[6]} == {c[:6] for c in blocks if c[5] and not c[6]}
    assert not any(c[5] for c in sweep_configs(32, False, True) + sweep_configs(256, False, False))


def test_auto_says_what_kept_weights_cost_large_batches():
    """An engine that keeps FP8 weights by default and batches more than 64 sequences is told
    the measured cost and the switch; explicit choices and smaller batches are not."""
    from kvcap.models.fp8_linear import large_batch_note

    note = large_batch_note(True, "auto", 256)
    assert "max_num_seqs=256" in note and "fp8_weights='dequantize'" in note
    assert large_batch_note(True, "auto", 64) is None
    assert large_batch_note(True, "keep", 256) is None
    assert large_batch_note(False, "auto", 256) is None


def test_swiglu_is_fused_where_it_was_measured_faster(monkeypatch):
    """The fused SiLU-and-multiply at decode rows and, on Hopper, at 65-128 rows where its
    128-column programs cover two thirds of the SMs (the 8B's 112 of 132), where it was
    measured faster than the unfused GEMM plus the activation kernel; below Hopper wherever it
    was not measured slower (swiglu_pays). KVCAP_FP8_SWIGLU forces either on the GPU and
    names its values when it holds anything else."""
    from types import SimpleNamespace

    from kvcap.kernels import fp8_gemm

    gpu = torch.device("cuda", 0)
    monkeypatch.delenv(fp8_gemm.ENV_FP8_SWIGLU, raising=False)
    monkeypatch.setattr(fp8_gemm, "sm_count", lambda d: 132)
    for cc, m, n, want in [((9, 0), 16, 14336, True), ((9, 0), 17, 14336, False),
                           ((9, 0), 64, 14336, False), ((9, 0), 65, 14336, True),
                           ((9, 0), 128, 14336, True), ((9, 0), 129, 14336, False),
                           ((9, 0), 256, 14336, False), ((9, 0), 128, 11264, True),
                           ((9, 0), 128, 8192, False),  # 64 programs: half the SMs idle
                           ((8, 0), 256, 8192, True), ((8, 9), 48, 14336, True)]:
        monkeypatch.setattr(fp8_gemm, "device_properties",
                            lambda d, cc=cc: SimpleNamespace(major=cc[0], minor=cc[1]))
        assert fp8_gemm.swiglu_pays(m, n, gpu) is want, (cc, m, n)
    assert fp8_gemm.swiglu_pays(256, 14336, torch.device("cpu"))
    monkeypatch.setenv(fp8_gemm.ENV_FP8_SWIGLU, "unfused")
    assert not fp8_gemm.swiglu_pays(16, 14336, gpu)
    assert fp8_gemm.swiglu_pays(16, 14336, torch.device("cpu"))
    monkeypatch.setenv(fp8_gemm.ENV_FP8_SWIGLU, "fused")
    assert fp8_gemm.swiglu_pays(256, 14336, gpu)
    monkeypatch.setenv(fp8_gemm.ENV_FP8_SWIGLU, "yes")
    with pytest.raises(ValueError, match="KVCAP_FP8_SWIGLU='yes': use 'fused' or 'unfused'"):
        fp8_gemm.swiglu_pays(128, 14336, gpu)


def test_layout_keeps_checkpoint_blocks_where_every_part_starts_on_one():
    from kvcap.models.fp8_linear import layout
    from kvcap.models.fp8_weights import FP8Weights

    block = FP8Weights("fp8", (128, 128))
    assert layout(block, 4096, [4096, 1024, 1024]) == (128, 128)
    assert layout(block, 576, [576, 192, 192]) == (1, 128)  # k/v of 192 rows: one per row
    assert layout(block, 64, [64]) == (128, 64)  # K within one block: one group along K
    assert layout(FP8Weights("compressed-tensors"), 4096, [4096]) == (1, 4096)
    with pytest.raises(ConfigError, match="multiple of 16"):
        layout(FP8Weights("fp8", (128, 40)), 4096, [4096])


def test_unquantized_modules_are_read_from_the_config():
    from kvcap.models.fp8_weights import read_weight_quant

    qc = _compressed("channel")
    assert read_weight_quant(qc).unquantized == ()  # ignore: ["lm_head"]
    qc["ignore"] = ["lm_head", "model.layers.0.mlp.down_proj"]
    assert read_weight_quant(qc).unquantized == ("model.layers.0.mlp.down_proj",)
    fine = {"quant_method": "fp8", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["model.layers.3.self_attn.o_proj"]}
    assert read_weight_quant(fine).unquantized == ("model.layers.3.self_attn.o_proj",)


def _spec(qc: dict | None, **over):
    from kvcap.config import ModelSpec

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
           **over}
    if qc is not None:
        cfg["quantization_config"] = qc
    return ModelSpec.from_hf_config(cfg)


def _fine(b0: int, b1: int) -> dict:
    return {"quant_method": "fp8", "weight_block_size": [b0, b1]}


def test_modes_resolve_and_refuse_by_name(monkeypatch):
    from kvcap.models.fp8_linear import resolve_keep

    capability = [(9, 0)]  # what the "GPU" below reports
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    spec, cpu, gpu = _spec(_fine(16, 16)), torch.device("cpu"), torch.device("cuda")
    assert resolve_keep("auto", spec, gpu, 1) and not resolve_keep("auto", spec, cpu, 1)
    capability[0] = (7, 5)  # FMA dots only: auto dequantizes, keep still keeps
    assert not resolve_keep("auto", spec, gpu, 1) and resolve_keep("keep", spec, gpu, 1)
    capability[0] = (8, 0)
    assert resolve_keep("auto", spec, gpu, 2)  # rank 1: o_proj from column 32, down from 48
    assert resolve_keep("keep", spec, cpu, 1) and not resolve_keep("dequantize", spec, gpu, 1)
    assert not resolve_keep("keep", _spec(None), gpu, 1)  # nothing to keep: 16-bit weights
    misaligned = _spec(_fine(32, 32))  # down_proj's second half starts at column 48
    assert not resolve_keep("auto", misaligned, gpu, 2)
    with pytest.raises(ConfigError, match="rank 1's down_proj inputs start at column 48"):
        resolve_keep("keep", misaligned, gpu, 2)
    with pytest.raises(ConfigError, match="K blocks of 40"):
        resolve_keep("keep", _spec(_fine(48, 40)), gpu, 1)
    partial = _spec({**_compressed("channel"), "ignore": ["re:.*down_proj"]})
    assert not resolve_keep("auto", partial, gpu, 1)
    with pytest.raises(ConfigError, match="leaves 1 module patterns unquantized"):
        resolve_keep("keep", partial, gpu, 1)
    with pytest.raises(ConfigError, match="fp8_weights must be one of"):
        resolve_keep("fp8", spec, gpu, 1)


@pytest.mark.parametrize("qc, arch", [(_fine(16, 16), "LlamaForCausalLM"),
                                      (_compressed("channel"), "LlamaForCausalLM"),
                                      (_fine(16, 16), "Qwen2ForCausalLM")])  # qkv bias
def test_dummy_fp8_checkpoint_is_the_tp1_dummy_model_and_shards_slice_it(qc, arch):
    """The random FP8 model a tensor-parallel rank slices is the TP1 one: bytes and scales."""
    from kvcap.distributed.comm import Communicator
    from kvcap.distributed.layers import ModelParallel, RowParallelFP8Linear
    from kvcap.distributed.partition import plan_shard
    from kvcap.models.registry import build_model
    from kvcap.models.weights import dummy_checkpoint, init_dummy_weights, load_weights

    spec, cpu = _spec(qc, architectures=[arch]), torch.device("cpu")
    a = build_model(spec, cpu, torch.float32, keep_fp8=True)
    init_dummy_weights(a, seed=5)
    b = build_model(spec, cpu, torch.float32, keep_fp8=True)
    load_weights(b, dummy_checkpoint(spec, cpu, torch.float32, seed=5, keep_fp8=True))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    shard = plan_shard(spec, 2, 1)  # query heads 2-3, KV head 1, MLP columns 48-95
    part = build_model(spec, cpu, torch.float32, ModelParallel(shard, Communicator(1, 2, cpu)),
                       keep_fp8=True)
    load_weights(part, dummy_checkpoint(spec, cpu, torch.float32, seed=5, keep_fp8=True))
    fa, pa_ = a.layers[1].self_attn, part.layers[1].self_attn
    assert isinstance(pa_.o_proj, RowParallelFP8Linear)
    want = dequantize_reference(fa.o_proj.weight, fa.o_proj.scale, fa.o_proj.row_block,
                                fa.o_proj.k_group)[:, 32:64]
    got = dequantize_reference(pa_.o_proj.weight, pa_.o_proj.scale, pa_.o_proj.row_block,
                               pa_.o_proj.k_group)
    assert torch.equal(got, want)
    d = spec.head_dim
    full_qkv = dequantize_reference(fa.qkv_proj.weight, fa.qkv_proj.scale,
                                    fa.qkv_proj.row_block, fa.qkv_proj.k_group)
    part_qkv = dequantize_reference(pa_.qkv_proj.weight, pa_.qkv_proj.scale,
                                    pa_.qkv_proj.row_block, pa_.qkv_proj.k_group)
    assert torch.equal(part_qkv[:2 * d], full_qkv[2 * d:4 * d])  # q heads 2-3
    assert torch.equal(part_qkv[2 * d:3 * d], full_qkv[5 * d:6 * d])  # k head 1
    fm, pm = a.layers[0].mlp, part.layers[0].mlp
    full_down = dequantize_reference(fm.down_proj.weight, fm.down_proj.scale,
                                     fm.down_proj.row_block, fm.down_proj.k_group)
    assert torch.equal(dequantize_reference(pm.down_proj.weight, pm.down_proj.scale,
                                            pm.down_proj.row_block, pm.down_proj.k_group),
                       full_down[:, 48:96])


def test_kept_fp8_weights_under_tensor_parallelism(tmp_path, monkeypatch):
    """A 16 x 16-block FP8 checkpoint kept in FP8 on two CPU ranks: the TP1 kept model's
    logits and greedy tokens."""
    from kvcap import LLM, SamplingParams
    from kvcap.models import loader

    _, ids = _fp8_checkpoint(tmp_path, (16, 16), "weight_scale_inv", _fine(16, 16))
    monkeypatch.setattr(loader, "load_tokenizer", lambda _dir: None)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    out = {}
    for world in (1, 2):
        with LLM(model=str(tmp_path), device="cpu", dtype="float32", num_blocks=16,
                 fp8_weights="keep", tensor_parallel_size=world) as llm:
            out[world] = (llm.prompt_logits([ids[0].tolist()])[0],
                          llm.generate([ids[0, :20].tolist()], params)[0].token_ids)
    assert (out[2][0] - out[1][0]).abs().max().item() < 1e-4
    assert out[2][1] == out[1][1]


@pytest.mark.parametrize("granularity, qc, scale_name, arch", [
    ("tensor", _compressed("tensor"), "weight_scale", "llama"),
    ("channel", {"quant_method": "fbgemm_fp8"}, "weight_scale", "llama"),
    ((32, 32), {"quant_method": "fp8", "weight_block_size": [32, 32]}, "weight_scale_inv",
     "llama"),
    # 48-row blocks: q/k/v (64/32/32 rows) do not start on one, gate/up (96 + 96) do; 32 x 64
    # K groups; blocks cut at the weights' edges
    ((48, 32), _compressed("block", (48, 32)), "weight_scale", "llama"),
    ("tensor", _compressed("tensor"), "weight_scale", "phi3"),  # fused tensors split in FP8
])
def test_kept_weights_give_the_logits_of_the_dequantized_load(tmp_path, monkeypatch,
                                                              granularity, qc, scale_name, arch):
    hf, ids = _fp8_checkpoint(tmp_path, granularity, scale_name, qc, arch)
    with torch.no_grad():
        ref = hf(ids).logits[0]
    kept = _logits(tmp_path, ids, monkeypatch, fp8_weights="keep")
    assert (kept - ref).abs().max().item() < 1e-4
    assert (kept - _logits(tmp_path, ids, monkeypatch)).abs().max().item() < 1e-4


def test_kept_model_holds_one_byte_a_weight(tmp_path, monkeypatch):
    from kvcap import LLM
    from kvcap.models import loader

    _fp8_checkpoint(tmp_path, (48, 32), "weight_scale", _compressed("block", (48, 32)))
    monkeypatch.setattr(loader, "load_tokenizer", lambda _dir: None)
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", num_blocks=16,
              fp8_weights="keep")
    layers = [m for m in llm.model.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    assert all(m.weight.dtype == torch.uint8 and m.scale.dtype == torch.float32
               for m in layers)
    mlp, attn = llm.model.layers[0].mlp, llm.model.layers[0].self_attn
    assert (mlp.gate_up_proj.row_block, mlp.gate_up_proj.k_group) == (48, 32)
    assert (attn.qkv_proj.row_block, attn.qkv_proj.k_group) == (1, 32)
    assert llm.model.lm_head.weight.dtype == torch.float32  # not FP8 in the checkpoint


def test_a_16_bit_tensor_for_a_kept_layer_is_refused(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    _, ids = _fp8_checkpoint(tmp_path, "channel", "weight_scale", _compressed("channel"))
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.down_proj"
    tensors[f"{name}.weight"] = tensors[f"{name}.weight"].float() * tensors.pop(
        f"{name}.weight_scale")
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"{name}.weight is torch.float32, not FP8"):
        _logits(tmp_path, ids, monkeypatch, fp8_weights="keep")
    _logits(tmp_path, ids, monkeypatch, fp8_weights="dequantize")  # loads


def test_dummy_fp8_model_runs(tmp_path):
    """Random FP8 weights for performance runs: a dummy config with an FP8 quantization_config
    builds FP8 layers, and the model generates."""
    from kvcap import LLM, SamplingParams

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=f"dummy:{tmp_path}", device="cpu", num_blocks=16, fp8_weights="keep")
    assert any(isinstance(m, FP8Linear) for m in llm.model.modules())
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_dummy_fp8_saturates_samples_past_448(monkeypatch):
    """A sample past 7 sigma (448 * scale; rare, but an 8B model draws billions) becomes
    +-448, never a NaN byte: torch's float8 cast turned |x| >= 480 into 0x7F/0xFF before it
    saturated by itself (torch>=2.4 spans both). That cast is emulated here, the outliers
    planted."""
    from kvcap.models.fp8_linear import dummy_fp8

    normal_, to = torch.Tensor.normal_, torch.Tensor.to

    def planted(self, mean=0.0, std=1.0, generator=None):
        normal_(self, mean, std, generator=generator)
        self.view(-1)[:3] = torch.tensor([8.0, -9.0, 1e6]) * std
        return self

    def nan_past_480(self, *args, **kwargs):
        if torch.float8_e4m3fn in args or kwargs.get("dtype") is torch.float8_e4m3fn:
            self = self.masked_fill(self.abs() >= 480, float("nan"))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "normal_", planted)
    monkeypatch.setattr(torch.Tensor, "to", nan_past_480)
    w, _ = dummy_fp8((64, 64), 32, 32, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert w[0, :3].tolist() == [0x7E, 0xFE, 0x7E]  # +448, -448, +448
    assert not ((w & 0x7F) == 0x7F).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 16, 64, 256])
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_gemm_at_8b_shapes_on_the_gpu(rows, block):
    """The Llama-3.1-8B linears (QKV 6144 x 4096, down 4096 x 14336) against the twin in BF16,
    both decoders, K whole and split in 2 and 4 (compiled, the split-K reduction's atomics and
    barriers run on real concurrent programs)."""
    from kvcap.kernels.fp8_gemm import fp8_linear

    for n, k in ((6144, 4096), (4096, 14336)):
        rb, kg = block or (1, k)
        w, s = _weights(n, k, rb, kg, rows)
        w, s = w.cuda(), s.cuda()
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ dequantize_reference(w, s, rb, kg).t()
        for mode, split in itertools.product(("native", "software"), (1, 2, 4)):
            got = fp8_linear(x, w, s, rb, kg, fp8_mode=mode, split_k=split).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < 8e-3, (n, k, mode, split, err)
            if split > 1:  # deterministic across calls
                again = fp8_linear(x, w, s, rb, kg, fp8_mode=mode, split_k=split).float()
                assert torch.equal(got, again), (n, k, mode, split)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kept_model_on_the_gpu_matches_the_dequantized_one(tmp_path, monkeypatch):
    """BF16 on the GPU: the kept model's prompt logits through the streaming kernel and through
    the large-step path (dequantized into the scratch, cuBLAS: KVCAP_FP8_GEMM_MAX_ROWS=0)
    against the dequantized model's; its greedy decode the same with CUDA graphs and eager."""
    from kvcap import LLM, SamplingParams
    from kvcap.models import loader

    _, ids = _fp8_checkpoint(tmp_path, (32, 32), "weight_scale_inv",
                             {"quant_method": "fp8", "weight_block_size": [32, 32]})
    monkeypatch.setattr(loader, "load_tokenizer", lambda _dir: None)
    prompts = [ids[0, :20].tolist(), ids[0, 20:45].tolist()]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    logits, tokens = {}, {}
    for arm, mode, max_rows, eager in (("dequantize", "dequantize", None, False),
                                       ("keep", "keep", None, False),
                                       ("keep-eager", "keep", None, True),
                                       ("keep-cublas", "keep", "0", True)):
        if max_rows is None:
            monkeypatch.delenv("KVCAP_FP8_GEMM_MAX_ROWS", raising=False)
        else:
            monkeypatch.setenv("KVCAP_FP8_GEMM_MAX_ROWS", max_rows)
        llm = LLM(model=str(tmp_path), device="cuda", dtype="bfloat16", num_blocks=32,
                  fp8_weights=mode, enforce_eager=eager)
        assert any(isinstance(m, FP8Linear) for m in llm.model.modules()) == (mode == "keep")
        logits[arm] = llm.prompt_logits([ids[0].tolist()])[0].float().cpu()
        tokens[arm] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
    for arm in ("keep", "keep-cublas"):
        assert (logits[arm] - logits["dequantize"]).abs().max().item() < 5e-2, arm
    assert tokens["keep"] == tokens["keep-eager"]


@kernels
@pytest.mark.parametrize("m,inter,k,row_block,k_group", [(3, 40, 64, 1, 64),
                                                         (17, 48, 96, 16, 32)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_swiglu_equals_the_gemm_then_the_activation(m, inter, k, row_block, k_group, dtype):
    """The fused [gate; up] kernel gives the bytes of the plain kernel followed by SiLU(gate) *
    up rounded as torch rounds it (the unfused path: GEMM, then fused_ops.silu_mul)."""
    from kvcap.kernels.fp8_gemm import fp8_linear

    w, s = _weights(2 * inter, k, row_block, k_group, m + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEV, dtype)
    gate, up = fp8_linear(x, w, s, row_block, k_group).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)
    got = fp8_linear(x, w, s, row_block, k_group, swiglu=True)
    assert got.shape == (m, inter)
    if dtype == torch.bfloat16 and DEV == "cpu":  # the interpreter truncates FP32 -> BF16
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=1e-6)
    else:
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="swiglu needs a bias-free"):
        # odd rows, or up rows starting inside a scale block
        fp8_linear(x, w[:-row_block], s[:-1], row_block, k_group, swiglu=True)


def test_cli_flag_reaches_the_engine():
    import argparse

    from kvcap.commands.common import add_engine_arguments, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_kwargs(p.parse_args([]))["fp8_weights"] == "auto"
    assert engine_kwargs(p.parse_args(["--fp8-weights", "keep"]))["fp8_weights"] == "keep"
    with pytest.raises(SystemExit):
        p.parse_args(["--fp8-weights", "fp8"])


def test_fp8_tensor_slices_carry_their_scales():
    """Rows and K-block-aligned columns slice with their scales (dequantized slices equal the
    slices of the dequantized weight); a column slice inside a K block is refused by name."""
    from kvcap.models.fp8_weights import FP8Tensor

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) * 50).to(torch.float8_e4m3fn)
    block = FP8Tensor(w, torch.rand(3, 4, generator=g) + 0.1, "b.weight_scale", (32, 16))
    row = FP8Tensor(w, torch.rand(96, 1, generator=g) + 0.1, "r.weight_scale", None)
    tensor = FP8Tensor(w, torch.tensor([0.3]), "t.weight_scale", None)
    for t in (block, row, tensor):
        full = t.dequantize()
        for dim, start, length in ((0, 32, 64), (0, 40, 24), (1, 16, 32), (1, 48, 16)):
            got = t.narrow(dim, start, length).dequantize()
            assert torch.equal(got, full.narrow(dim, start, length)), (t.name, dim, start)
    with pytest.raises(ModelLoadError, match=r"b.weight_scale: columns 8:40 start inside a "
                                             r"16-column scale block"):
        block.narrow(1, 8, 32)
    assert row.narrow(1, 8, 32).scale is row.scale  # one scale along K: any columns
