"""store_kv kernel: bytes identical to the torch codec / plain copy; -1 slots skipped."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcap.kernels import store_kv as sk  # noqa: E402
from kvcap.numerics import e4m3  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
pytestmark = pytest.mark.skipif(
    DEV == "cpu" and type(sk._store_kv_kernel).__name__ != "InterpretedFunction",
    reason="no CUDA: run with TRITON_INTERPRET=1 set before triton is imported")


def _fused_kv(t: int, hq: int, hkv: int, d: int, dtype, g) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v as non-contiguous views of one fused qkv projection, like a model produces."""
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 4).to(dtype).to(DEV)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    return k, v


@pytest.mark.parametrize("cache_dtype,dtype", [
    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32), (torch.float16, torch.float32),
    (torch.uint8, torch.float16), (torch.uint8, torch.bfloat16), (torch.uint8, torch.float32)])
@pytest.mark.parametrize("hkv,d,bs", [(3, 64, 16), (2, 128, 32)])
@pytest.mark.parametrize("rows", ["many", "few"])
def test_store_matches_reference(cache_dtype, dtype, hkv, d, bs, rows):
    """Many rows (SMs + 7: 11 on the interpreter's 4 \"SMs\"): one program per token, all
    heads; few (3, a decode step): one program per head. Both on a GPU too."""
    dev = torch.device(DEV)
    t = sk.sm_count(dev) + 7 if rows == "many" else 3
    g = torch.Generator().manual_seed(hkv * d + bs + t)
    nb = max(9, t // bs + 2)
    assert (sk.store_heads_per_program(t, hkv, dev) == 1) == (rows == "few")
    k, v = _fused_kv(t, 5, hkv, d, dtype, g)
    assert not k.is_contiguous()
    kc = torch.full((nb, hkv, bs, d), 0x7F if cache_dtype == torch.uint8 else 3.0,
                    dtype=cache_dtype, device=DEV)
    vc = kc.clone()
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[[2, t - 1]] = -1  # padding / skipped rows
    slots = slots.to(DEV)
    ks = torch.tensor(0.0371, device=DEV)
    vs = torch.tensor(0.0129, device=DEV)
    k_before, v_before = kc.clone(), vc.clone()
    sk.store_kv(k, v, kc, vc, slots, ks, vs)
    valid = slots >= 0
    sl = slots[valid]
    blk, off = sl // bs, sl % bs
    if cache_dtype == torch.uint8:
        want_k = e4m3.encode(k[valid], ks)
        want_v = e4m3.encode(v[valid], vs)
        # and the independent torch reference, inside its valid range
        ref_k = (k[valid].float() / ks).to(torch.float8_e4m3fn).view(torch.uint8)
        inside = (k[valid].float() / ks).abs() <= 448
        assert torch.equal(want_k[inside], ref_k[inside])
    else:
        want_k, want_v = k[valid].to(cache_dtype), v[valid].to(cache_dtype)
    assert torch.equal(kc[blk, :, off], want_k)
    assert torch.equal(vc[blk, :, off], want_v)
    # nothing else changed
    kc[blk, :, off] = k_before[blk, :, off]
    vc[blk, :, off] = v_before[blk, :, off]
    assert torch.equal(kc, k_before) and torch.equal(vc, v_before)


def test_store_fp8_edge_values():
    specials = [0.0, -0.0, 1e-30, -1e-30, 2.0**-10, 3 * 2.0**-10, 448.0, 464.0, 480.0, 1e6,
                -1e6, float("inf"), float("-inf"), 2.0**-6, 2.0**-6 * 1.0625, 17.0, 18.0, 0.3]
    g = torch.Generator().manual_seed(1)
    rand = torch.exp2(torch.empty(64 * 8 - len(specials)).uniform_(-14, 10, generator=g))
    rand = rand * torch.where(torch.rand(rand.shape, generator=g) < 0.5, -1.0, 1.0)
    x = torch.cat([torch.tensor(specials), rand]).view(8, 1, 64)
    for scale in (1.0, 0.0371, 3.0):
        kc = torch.zeros((8, 1, 16, 64), dtype=torch.uint8, device=DEV)
        vc = kc.clone()
        xs = (x * scale).to(DEV)
        slots = (torch.arange(8) * 16 + 5).to(DEV)
        s = torch.tensor(scale, device=DEV)
        sk.store_kv(xs, xs, kc, vc, slots, s, s)
        assert torch.equal(kc[:, 0, 5].cpu(), e4m3.encode(xs[:, 0], s).cpu())
        assert torch.equal(vc[:, 0, 5].cpu(), kc[:, 0, 5].cpu())


def test_store_large_block_index():
    """Element offsets past 2^31 (int32 would wrap)."""
    hkv, bs, d = 1, 16, 64
    nb = 2**31 // (hkv * bs * d) + 16
    kc = torch.empty((nb, hkv, bs, d), dtype=torch.uint8, device=DEV)
    vc = torch.empty_like(kc)
    k = torch.randn(2, hkv, d, device=DEV)
    slots = torch.tensor([(nb - 1) * bs + 15, 2 * bs + 1], device=DEV)
    s = torch.tensor(0.05, device=DEV)
    sk.store_kv(k, k, kc, vc, slots, s, s)
    assert torch.equal(kc[nb - 1, 0, 15], e4m3.encode(k[0, 0], s))
    assert torch.equal(vc[2, 0, 1], e4m3.encode(k[1, 0], s))


def test_store_rejects_bad_args():
    kc = torch.zeros((2, 1, 16, 16), dtype=torch.uint8, device=DEV)
    k = torch.zeros(1, 1, 16, device=DEV)
    with pytest.raises(ValueError):
        sk.store_kv(k, k, kc, kc.clone(), torch.zeros(1, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError):
        sk.store_kv(k, k, kc, kc.clone(), torch.zeros(2, dtype=torch.long, device=DEV),
                    torch.tensor(1.0), torch.tensor(1.0))


def _encode_through_store(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel bytes, torch codec bytes) of 65,536 FP32 values x at one scale."""
    s = torch.tensor(scale, dtype=torch.float32, device=DEV)
    x = x.view(512, 1, 128).to(DEV)
    kc = torch.zeros((32, 1, 16, 128), dtype=torch.uint8, device=DEV)
    sk.store_kv(x, x, kc, kc.clone(), torch.arange(512, device=DEV), s, s)
    return kc.view(512, 128).cpu(), e4m3.encode(x.view(512, 128), s).cpu()


@pytest.mark.parametrize("scale", [0.0371, 1e-39, 2.0**-70, 1e20])
def test_encode_equals_torch_on_every_bf16_value(scale):
    """The kernel's bytes equal the torch codec's (IEEE x / scale) for every BF16 bit pattern,
    NaN and infinities included, at an ordinary scale, a subnormal one, a tiny one and a huge
    one."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    got, want = _encode_through_store(every.float(), scale)
    assert torch.equal(got, want), int((got != want).sum())


@pytest.mark.parametrize("scale", [0.0371, 3.0, 1 / 448, 0.7, 1e-39, 7.5e-20])
def test_encode_rounds_quotients_next_to_ties_like_ieee_division(scale):
    """Values whose quotient lies within a few FP32 ulps of a midpoint between two E4M3
    codes, where a quotient one ulp off flips the code (a kernel that multiplied by the
    reciprocal instead of dividing failed at five of these six scales, 2026-12-02): the
    kernel's bytes equal IEEE division's."""
    codes = torch.arange(1, 0x7E, dtype=torch.int32).to(torch.uint8)
    vals = e4m3.decode(codes, torch.tensor(1.0)).double()
    mids = torch.cat([(vals[:-1] + vals[1:]) / 2, vals])  # ties, and exact codes too
    x = (mids * scale).float()
    steps = torch.arange(-128, 128, dtype=torch.int32)  # ulps around each tie, as FP32 bits
    near = (x.view(torch.int32)[:, None] + steps[None, :]).view(torch.float32).flatten()
    near = torch.cat([near, -near])[:65536]  # 63,744 positive, the rest negative
    got, want = _encode_through_store(near, scale)
    assert torch.equal(got, want), int((got != want).sum())


def test_hardware_encoder_choice(monkeypatch):
    """The cache write converts in hardware only on an SM89+ CUDA GPU whose cache is read
    natively; the software decoder (fp8_mode or KVCAP_FORCE_SOFTWARE_FP8) and
    KVCAP_SOFTWARE_E4M3_ENCODE keep the integer encoder, as does every CPU run."""
    from kvcap.kernels import common

    for name in ("KVCAP_FORCE_SOFTWARE_FP8", "KVCAP_SOFTWARE_E4M3_ENCODE"):
        monkeypatch.delenv(name, raising=False)
    assert not common.hardware_e4m3_encode(torch.device("cpu"))
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(common, "capability", lambda device: (9, 0))
    assert common.hardware_e4m3_encode(cuda)
    assert common.hardware_e4m3_encode(cuda, "native-k")
    assert not common.hardware_e4m3_encode(cuda, "software")
    for name in ("KVCAP_FORCE_SOFTWARE_FP8", "KVCAP_SOFTWARE_E4M3_ENCODE"):
        monkeypatch.setenv(name, "1")
        assert not common.hardware_e4m3_encode(cuda)
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVCAP_FORCE_SOFTWARE_FP8", "1")  # an explicit "native" reader wins,
    assert common.hardware_e4m3_encode(cuda, "native")   # as in use_software_fp8
    monkeypatch.delenv("KVCAP_FORCE_SOFTWARE_FP8")
    monkeypatch.setattr(common, "capability", lambda device: (8, 0))
    assert not common.hardware_e4m3_encode(cuda)


@triton.jit
def _encode_bit_patterns(out_ptr, scale_ptr, start, BLOCK: tl.constexpr):
    """out[i] = hardware encode of the FP32 value whose bits are start + i (mod 2^32)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = (start + i).to(tl.int32).to(tl.float32, bitcast=True)
    tl.store(out_ptr + i, sk.encode_e4m3(x, tl.load(scale_ptr), True))


@pytest.mark.skipif(DEV != "cuda" or not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (8, 9),
                    reason="the hardware conversion needs an SM89+ GPU")
@pytest.mark.gpu
def test_hardware_encoder_equals_the_codec_on_every_fp32_value():
    """Every one of the 2^32 FP32 bit patterns (scale 1: each possible quotient) gets the same
    byte from the hardware encoder as from the torch codec (kvcap.numerics.e4m3.encode)."""
    chunk, one = 1 << 27, torch.tensor(1.0, device=DEV)
    out = torch.empty(chunk, dtype=torch.uint8, device=DEV)
    for start in range(0, 1 << 32, chunk):
        _encode_bit_patterns[(chunk // 1024,)](out, one, start, BLOCK=1024)
        bits = torch.arange(start, start + chunk, dtype=torch.int64, device=DEV)
        bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
        want = e4m3.encode(bits.view(torch.float32), one)
        assert torch.equal(out, want), (hex(start), int((out != want).sum()))
