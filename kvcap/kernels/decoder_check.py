"""Startup self-check of the E4M3 conversions a CUDA engine is about to read its cache with.

The decode, prefill and QSA kernels convert E4M3 bytes with inline PTX (common.py): the
hardware `cvt` on SM89+, the packed software decoder elsewhere. The CPU tests cannot run PTX,
so before an engine serves from an E4M3 cache it runs every form of each decoder it will use
(the byte tile pure and opaque, the word route with and without byte pairs) over all 256 codes
on its own GPU and compares the bits with the reference (`kvcap.numerics.e4m3`): a decoder that
reads the cache wrong refuses to start, as a missing scale does, instead of serving garbage.
One small kernel per decoder, once per process and device.

The cache write's hardware encoder (SM89+, `cvt.rn.satfinite`; store_kv.encode_e4m3) is checked
the same way: every BF16 and every FP16 value, divided by two scales, must give the codec's
bytes, or the engine refuses to start.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcap.errors import DecoderCheckError
from kvcap.kernels.common import FP_FUSION, convert_tile, convert_words, interpreting
from kvcap.kernels.store_kv import encode_e4m3
from kvcap.numerics import e4m3

_ROWS, _WORDS = 16, 16  # 16 x 64 bytes: every code at every byte position of a word
_PASSED: set[tuple[int, bool]] = set()
_ENCODER_PASSED: set[tuple[int, bool]] = set()
_ENCODER_SCALES = (1.0, 0.0371)  # the quotient itself, and a typical calibrated scale
_ENCODE_BLOCK = 1024


def _device_key(device: torch.device) -> tuple[int, str]:
    """(index a check is remembered under, the device's name for an error): a CUDA device's
    index and name; -1 and the device itself for the CPU interpreter."""
    if device.type != "cuda":
        return -1, str(device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return idx, torch.cuda.get_device_name(idx)


@triton.jit
def _decode_all_forms(words_ptr, out_ptr, SOFTWARE: tl.constexpr, ROWS: tl.constexpr,
                      WORDS: tl.constexpr):
    """out[form, r, 4c + j] = decode(byte j of word (r, c)), forms: byte tile pure, opaque,
    words, word pairs (FP16; software: value * 2^-8)."""
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, WORDS)[None, :]
    w = tl.load(words_ptr + r * WORDS + c)
    n = ROWS * WORDS * 4
    b = tl.arange(0, 4 * WORDS)[None, :]
    x = tl.load(words_ptr.to(tl.pointer_type(tl.uint8)) + r * 4 * WORDS + b)
    tl.store(out_ptr + r * 4 * WORDS + b, convert_tile(x, True, SOFTWARE, tl.float16))
    tl.store(out_ptr + n + r * 4 * WORDS + b, convert_tile(x, True, SOFTWARE, tl.float16, True))
    for form in tl.static_range(2):
        t0, t1, t2, t3 = convert_words(w, SOFTWARE, tl.float16, form == 1)
        base = out_ptr + (2 + form) * n + r * 4 * WORDS + 4 * c
        tl.store(base, t0)
        tl.store(base + 1, t1)
        tl.store(base + 2, t2)
        tl.store(base + 3, t3)


def expected_bits(codes: torch.Tensor, software: bool) -> torch.Tensor:
    """FP16 bit patterns (int16) the decoder must produce for uint8 `codes`: the exact value
    (torch's float8_e4m3fn), times 2^-8 for the software decoder; NaN for 0x7F/0xFF (compared
    as NaN, whatever its payload)."""
    b = codes.to(torch.int32)
    if software:
        bits = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(torch.int16)
        return torch.where((b & 0x7F) == 0x7F, torch.full_like(bits, 0x7E00), bits)
    return codes.view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16)


def decoded_wrong(got: torch.Tensor, want_bits: torch.Tensor) -> torch.Tensor:
    """Where FP16 `got` is not the decode whose bits are `want_bits` (expected_bits): finite
    codes bit for bit, the NaN codes any NaN."""
    nan = want_bits.view(torch.float16).isnan()
    return torch.where(nan, ~got.isnan(), got.view(torch.int16) != want_bits)


def check_e4m3_decoders(device: torch.device, software_decoders: set[bool]) -> None:
    """Raise DecoderCheckError unless every form of each decoder in `software_decoders`
    (True: the packed software decoder, False: the hardware conversion) decodes all 256 codes
    exactly on `device` (CUDA; on the CPU under TRITON_INTERPRET=1 the interpreter's Triton-op
    twins of the PTX run, which tests the check itself)."""
    if device.type != "cuda" and not interpreting():
        return
    idx, where = _device_key(device)
    forms = ("byte tile", "byte tile (opaque)", "words", "word pairs")
    codes = (torch.arange(_ROWS * _WORDS * 4, device=device) % 256).to(torch.uint8)
    for software in sorted(software_decoders):
        if (idx, software) in _PASSED:
            continue
        out = torch.empty(len(forms), codes.numel(), dtype=torch.float16, device=device)
        _decode_all_forms[(1,)](codes.view(torch.int32), out, software, _ROWS, _WORDS,
                                **FP_FUSION)
        want_bits = expected_bits(codes, software)
        for form, got in zip(forms, out, strict=True):
            bad = decoded_wrong(got, want_bits)
            if bad.any():
                i = int(bad.nonzero()[0])
                name = "software" if software else "hardware (cvt.rn.f16x2.e4m3x2)"
                want = want_bits[i:i + 1]
                expected = ("a NaN" if want.view(torch.float16).isnan().item()
                            else f"{int(want) & 0xFFFF:#06x}")
                raise DecoderCheckError(
                    f"the {name} E4M3 decoder ({form}) decoded code {int(codes[i]):#04x} to FP16 "
                    f"bits {int(got.view(torch.int16)[i]) & 0xFFFF:#06x}, expected {expected}"
                    f", on {where} (triton "
                    f"{triton.__version__}): it "
                    "would read the E4M3 cache wrong. Serve with kv_cache_dtype='auto' (16-bit "
                    "cache) and report this GPU and versions.")
        _PASSED.add((idx, software))


@triton.jit
def _encode_probe(x_ptr, out_ptr, scale_ptr, n, HARDWARE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m)
    tl.store(out_ptr + i, encode_e4m3(x, tl.load(scale_ptr), HARDWARE), mask=m)


def encoder_probe_values() -> torch.Tensor:
    """FP32 inputs that exercise an E4M3 encoder: every BF16 bit pattern (every exponent, both
    zeros, subnormals, infinities, NaN) and every FP16 one (whose 10 mantissa bits hold each
    E4M3 rounding tie and its neighbours)."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    return torch.cat([every.view(torch.bfloat16).float(), every.view(torch.float16).float()])


def _nan_unsigned(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes with both NaN codes as 0x7F: the codec writes a NaN quotient's sign, which
    IEEE division leaves unspecified (the CPU keeps the dividend's, CUDA returns a positive
    canonical NaN), so the GPU and the CPU reference may differ there and only there."""
    return torch.where((codes & 0x7F) == 0x7F, torch.full_like(codes, 0x7F), codes)


def check_e4m3_encoder(device: torch.device, hardware: bool = True) -> None:
    """Raise DecoderCheckError unless encode_e4m3 (`hardware`: the SM89+ conversion) writes
    the bytes of the reference codec (kvcap.numerics.e4m3.encode, on the CPU) for
    encoder_probe_values() at each of _ENCODER_SCALES on `device` (CUDA, or the CPU under
    TRITON_INTERPRET=1, where only the integer encoder runs: that tests the check itself)."""
    if device.type != "cuda" and not interpreting():
        return
    idx, where = _device_key(device)
    if (idx, hardware) in _ENCODER_PASSED:
        return
    x = encoder_probe_values()
    xd = x.to(device)
    out = torch.empty(x.shape, dtype=torch.uint8, device=device)
    for scale in _ENCODER_SCALES:
        s = torch.tensor(scale, dtype=torch.float32)
        _encode_probe[(triton.cdiv(x.numel(), _ENCODE_BLOCK),)](
            xd, out, s.to(device), x.numel(), hardware, _ENCODE_BLOCK, **FP_FUSION)
        got, want = out.cpu(), e4m3.encode(x, s)
        bad = _nan_unsigned(got) != _nan_unsigned(want)
        if bad.any():
            i = int(bad.nonzero()[0])
            name = ("hardware (cvt.rn.satfinite.e4m3x2.f32)" if hardware else "integer")
            raise DecoderCheckError(
                f"the {name} E4M3 encoder wrote {int(got[i]):#04x} for {float(x[i])!r} / "
                f"{scale} (expected {int(want[i]):#04x}) on {where} (triton "
                f"{triton.__version__}): it would write the E4M3 cache wrong. Set "
                "KVCAP_SOFTWARE_E4M3_ENCODE=1 (the integer encoder) and report this GPU and "
                "versions.")
    _ENCODER_PASSED.add((idx, hardware))
