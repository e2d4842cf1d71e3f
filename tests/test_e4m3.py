"""The E4M3 codec against two independent references: torch.float8_e4m3fn and ml_dtypes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kvcap.numerics import e4m3

ALL_CODES = torch.arange(256, dtype=torch.uint8)
NAN_CODES = {0x7F, 0xFF}


def _torch_ref_decode(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.float8_e4m3fn).float()


def _ml_ref_decode(q: torch.Tensor) -> torch.Tensor:
    arr = q.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return torch.from_numpy(arr)


def _torch_ref_encode(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8)


def _ml_ref_encode(y: torch.Tensor) -> torch.Tensor:
    arr = y.float().numpy().astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return torch.from_numpy(arr.copy())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.float().view(torch.int32), b.float().view(torch.int32)))


@pytest.mark.parametrize("method", e4m3.DECODE_METHODS)
def test_all_256_codes(method):
    got = e4m3.decode(ALL_CODES, method=method)
    assert got.dtype == torch.float32
    nan = torch.isnan(got)
    assert {int(c) for c in ALL_CODES[nan]} == NAN_CODES
    for ref in (_torch_ref_decode(ALL_CODES), _ml_ref_decode(ALL_CODES)):
        assert torch.equal(torch.isnan(ref), nan)
        assert _same_bits(got[~nan], ref[~nan]), method


def test_decoders_spot_values():
    q = torch.tensor([0x00, 0x80, 0x01, 0x07, 0x08, 0x38, 0x7E, 0xFE, 0x81], dtype=torch.uint8)
    want = [0.0, -0.0, 2.0**-9, 7 * 2.0**-9, 2.0**-6, 1.0, 448.0, -448.0, -(2.0**-9)]
    for method in e4m3.DECODE_METHODS:
        got = e4m3.decode(q, method=method)
        assert got.tolist() == want
        assert torch.signbit(got[1])


@pytest.mark.parametrize("method", e4m3.DECODE_METHODS)
def test_decode_scale_and_shape(method):
    q = torch.randint(0, 256, (3, 5, 7), dtype=torch.uint8)  # odd size: packed pads
    q[q == 0x7F] = 0x11
    q[q == 0xFF] = 0x91
    got = e4m3.decode(q, scale=0.0371, method=method)
    assert got.shape == q.shape
    ref = _torch_ref_decode(q) * torch.tensor(0.0371, dtype=torch.float32)
    assert _same_bits(got, ref)
    got_t = e4m3.decode(q, scale=torch.tensor(0.0371), method=method)
    assert _same_bits(got_t, ref)


def test_decode_rejects_bad_input():
    with pytest.raises(ValueError):
        e4m3.decode(torch.zeros(4, dtype=torch.int8))
    with pytest.raises(ValueError):
        e4m3.decode(ALL_CODES, method="nope")


def _finite_values() -> torch.Tensor:
    v = _torch_ref_decode(ALL_CODES)
    return v[~torch.isnan(v)]


def test_encode_roundtrip_all_finite_codes():
    v = _finite_values()
    got = e4m3.encode(v, 1.0)
    assert torch.equal(got, _torch_ref_encode(v, 1.0))
    assert _same_bits(e4m3.decode(got), v)


def test_encode_ties_to_even_and_neighbours():
    pos = torch.sort(_finite_values()[_finite_values() >= 0]).values.unique()
    lo, hi = pos[:-1], pos[1:]
    mid = (lo.double() + hi.double()) / 2
    mid32 = mid.float()
    assert torch.equal(mid32.double(), mid)  # midpoints are exact in FP32
    up = torch.nextafter(mid32, torch.tensor(float("inf")))
    down = torch.nextafter(mid32, torch.tensor(0.0))
    x = torch.cat([mid32, up, down])
    x = torch.cat([x, -x])
    got = e4m3.encode(x, 1.0)
    assert torch.equal(got, _torch_ref_encode(x, 1.0))
    assert torch.equal(got, _ml_ref_encode(x))
    # ties really go to the even code
    codes = e4m3.encode(mid32, 1.0).int()
    assert bool(((codes & 1) == 0).all())


def test_encode_saturates_never_nan():
    x = torch.tensor([448.0, 448.5, 463.9, 464.0, 479.9, 480.0, 500.0, 1e6, 3.4e38,
                      float("inf")])
    x = torch.cat([x, -x])
    got = e4m3.encode(x, 1.0)
    assert got[:10].tolist() == [0x7E] * 10
    assert got[10:].tolist() == [0xFE] * 10
    big = torch.tensor([1e30, -1e30], dtype=torch.float32)
    assert e4m3.encode(big, 1e-30).tolist() == [0x7E, 0xFE]


def test_encode_nan_input():
    got = e4m3.encode(torch.tensor([float("nan")]), 1.0)
    assert int(got[0]) & 0x7F == 0x7F


def test_encode_zero_tiny_subnormal():
    x = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-38, 2.0**-10, 2.0**-10 + 2.0**-30,
                      3 * 2.0**-10, 5 * 2.0**-10, 2.0**-9, 7.5 * 2.0**-9, 2.0**-6 - 2.0**-20])
    got = e4m3.encode(x, 1.0)
    assert torch.equal(got, _torch_ref_encode(x, 1.0))
    assert torch.equal(got, _ml_ref_encode(x))
    assert got[0] == 0x00 and got[1] == 0x80
    assert got[5] == 0x00  # 2^-10 is a tie between 0 and 2^-9: even (zero)
    assert got[6] == 0x01


@pytest.mark.parametrize("scale", [1.0, 0.0173, 0.0841, 3.0, 1 / 3, 2.0**-7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_encode_random_vs_references(scale, dtype):
    g = torch.Generator().manual_seed(int(scale * 1e4) + 7)
    mag = torch.exp2(torch.empty(200_000).uniform_(-16, 10, generator=g))
    sign = torch.where(torch.rand(200_000, generator=g) < 0.5, -1.0, 1.0)
    x = (mag * sign * scale).to(dtype)
    y = x.float() / scale
    inside = y.abs() <= 448
    got = e4m3.encode(x, scale)
    assert torch.equal(got[inside], _torch_ref_encode(x, scale)[inside])
    assert torch.equal(got[inside], _ml_ref_encode(y)[inside])
    assert bool((got[~inside] & 0x7F == 0x7E).all())
    # tensor scale gives the same bytes
    assert torch.equal(e4m3.encode(x, torch.tensor(scale)), got)


def test_encode_division_is_fp32():
    # 0.1 is not exact in FP32; the quotient must be computed by FP32 division.
    x = torch.randn(50_000) * 0.05
    s = 0.1
    want = (x / torch.tensor(s, dtype=torch.float32)).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(e4m3.encode(x, s), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    x = torch.randn(1_000_000) * 30
    for scale in (1.0, 0.0371):
        cpu = e4m3.encode(x, scale)
        gpu = e4m3.encode(x.cuda(), torch.tensor(scale).cuda())
        assert torch.equal(gpu.cpu(), cpu)
        for method in e4m3.DECODE_METHODS:
            d = e4m3.decode(ALL_CODES.cuda(), method=method).cpu()
            assert torch.equal(torch.isnan(d), torch.isnan(_torch_ref_decode(ALL_CODES)))
            fin = ~torch.isnan(d)
            assert _same_bits(d[fin], _torch_ref_decode(ALL_CODES)[fin])
