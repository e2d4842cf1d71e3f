"""The E4M3 decoder self-check (kvcap.kernels.decoder_check): every form of each decoder the
kernels use must pass it -- compiled on a GPU (the inline PTX), in the CPU interpreter (its
Triton-op twins) -- and a decoder that mis-decodes one code must be refused with a message
naming it."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcap.errors import DecoderCheckError  # noqa: E402
from kvcap.kernels import decoder_check  # noqa: E402
from kvcap.numerics import e4m3  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available()
                   and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
pytestmark = pytest.mark.skipif(
    DEV.type == "cpu" and type(decoder_check._decode_all_forms).__name__ != "InterpretedFunction",
    reason="no CUDA: run with TRITON_INTERPRET=1 set before triton is imported")


def test_expected_bits_match_the_reference_decoder():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = e4m3.decode(codes)
    finite = ~ref.isnan()
    native = decoder_check.expected_bits(codes, False).view(torch.float16).float()
    assert torch.equal(native[finite], ref[finite]) and native[~finite].isnan().all()
    soft = decoder_check.expected_bits(codes, True).view(torch.float16).float()
    assert torch.equal(soft[finite] * 256, ref[finite]) and soft[~finite].isnan().all()
    assert torch.equal(torch.signbit(soft[finite]), codes[finite] >= 128)


def test_decoded_wrong_compares_finite_bits_and_nan_as_nan():
    codes = torch.tensor([0x00, 0x80, 0x41, 0x7F, 0xFF], dtype=torch.uint8)
    want = decoder_check.expected_bits(codes, True)
    right = want.view(torch.float16).clone()
    right[3:] = torch.tensor([0x7FFF, 0xFC01], dtype=torch.int32).to(torch.int16).view(
        torch.float16)  # other NaN payloads and signs
    assert not decoder_check.decoded_wrong(right, want).any()
    old = torch.tensor([0, 0x8000, 0x2080, 0x3F80, 0xBF80],  # +-480 * 2^-8: before 2026-12-07
                       dtype=torch.int32).to(torch.int16).view(torch.float16)
    assert decoder_check.decoded_wrong(old, want).tolist() == [False, False, False, True, True]
    minus_zero = right.clone()
    minus_zero[0] = -0.0  # +0 and -0 differ
    assert decoder_check.decoded_wrong(minus_zero, want).tolist()[0]


def test_the_decoders_no_longer_read_0x7f_as_480(monkeypatch):
    """Judged by the reference of before 2026-12-07 (0x7F/0xFF as the finite +-480 * 2^-8),
    today's software decoder is refused at code 0x7f: it gives a NaN there."""
    decoder_check._PASSED.clear()
    real = decoder_check.expected_bits

    def old_reference(codes, software):
        b = codes.to(torch.int32)
        return torch.where((b & 0x7F) == 0x7F, (((b & 0x80) << 8) | 0x3F80).to(torch.int16),
                           real(codes, software))

    monkeypatch.setattr(decoder_check, "expected_bits", old_reference)
    with pytest.raises(DecoderCheckError, match="code 0x7f to FP16 bits .*expected 0x3f80"):
        decoder_check.check_e4m3_decoders(DEV, {True})
    assert not decoder_check._PASSED


def test_a_decoder_reading_0x7f_as_a_number_is_refused(monkeypatch):
    """A decoder that gives a finite number for a NaN code is refused with 'expected a NaN'."""
    decoder_check._PASSED.clear()

    class FiniteNaNCodes:  # stands in for the probe kernel: exact, but 0x7F/0xFF -> +-480 * 2^-8
        def __getitem__(self, grid):
            def launch(words, out, software, *args, **kwargs):
                b = words.view(torch.uint8).to(torch.int32)
                bits = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(torch.int16)
                out.copy_(bits.view(torch.float16).expand_as(out))
            return launch

    monkeypatch.setattr(decoder_check, "_decode_all_forms", FiniteNaNCodes())
    with pytest.raises(DecoderCheckError,
                       match=r"software E4M3 decoder \(byte tile\) decoded code 0x7f to FP16 "
                             r"bits 0x3f80, expected a NaN"):
        decoder_check.check_e4m3_decoders(DEV, {True})
    assert not decoder_check._PASSED


def test_the_integer_encoder_passes_the_encoder_check():
    """The check's machinery (probe values, both scales, the CPU codec) on the integer encoder;
    on a GPU with the conversion the hardware encoder is checked too."""
    decoder_check._ENCODER_PASSED.clear()
    decoder_check.check_e4m3_encoder(DEV, hardware=False)
    forms = [False]
    if DEV.type == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
        decoder_check.check_e4m3_encoder(DEV, hardware=True)
        forms.append(True)
    assert {h for _, h in decoder_check._ENCODER_PASSED} == set(forms)


def test_the_probe_holds_every_tie():
    """Each midpoint between two adjacent E4M3 values is an FP16 value of the probe, so an
    encoder that rounds ties the wrong way fails the check."""
    codes = torch.arange(0, 0x7E, dtype=torch.int32).to(torch.uint8)
    vals = e4m3.decode(codes).double()
    mids = ((vals[:-1] + vals[1:]) / 2).float()
    probe = set(decoder_check.encoder_probe_values().tolist())
    assert all(m in probe and -m in probe for m in mids.tolist())


def test_a_wrong_encoder_is_refused(monkeypatch):
    decoder_check._ENCODER_PASSED.clear()
    real = e4m3.encode

    def flips_one_tie(x, scale=1.0):  # the reference an encoder wrong at 0.5625 would fail
        out = real(x, scale)
        return torch.where((x / scale) == 0.5625, out ^ 1, out)

    monkeypatch.setattr(decoder_check.e4m3, "encode", flips_one_tie)
    with pytest.raises(DecoderCheckError, match=r"integer E4M3 encoder wrote 0x3\w for 0\.5625"):
        decoder_check.check_e4m3_encoder(DEV, hardware=False)
    assert not decoder_check._ENCODER_PASSED


def test_the_encoder_check_ignores_only_a_nan_sign():
    codes = torch.tensor([0x7F, 0xFF, 0x7E, 0xFE, 0x00, 0x80], dtype=torch.uint8)
    assert decoder_check._nan_unsigned(codes).tolist() == [0x7F, 0x7F, 0x7E, 0xFE, 0x00, 0x80]
