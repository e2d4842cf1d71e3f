"""The inline-PTX E4M3 decoders (kvcap.kernels.common), run on the CPU by a small emulator of
the PTX instructions they use (prmt.b32 in its generic mode, shl/and/mov.b32, mul/fma.rn.f16x2
and cvt.rn.f16x2.e4m3x2 through torch's float8_e4m3fn), over every byte pair: each string must
decode like the reference (kvcap.numerics.e4m3; the software decoder times 2^-8) and put each
byte where its kernel expects it. The GPU tests run the same strings compiled
(test_kernels_gpu.py, test_decoder_check.py); this catches a wrong selector or register
before a GPU does."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kvcap.kernels import common
from kvcap.kernels.decoder_check import expected_bits


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """prmt.b32 d, a, b, sel (generic mode): byte k of d is source byte sel[4k+2:4k] of {b, a},
    or that byte's sign replicated when sel bit 4k+3 is set (PTX ISA, "prmt")."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a)
    for k in range(4):
        nib = (sel >> (4 * k)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = np.where(byte & 0x80, 0xFF, 0).astype(np.uint32)
        out |= byte << (8 * k)
    return out


def _cvt_e4m3x2(h: np.ndarray) -> np.ndarray:
    """cvt.rn.f16x2.e4m3x2: two E4M3 bytes (low byte -> low half) -> f16x2 bits."""
    codes = torch.from_numpy(np.stack([h & 0xFF, h >> 8], -1).astype(np.uint8))
    f16 = codes.view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16).numpy()
    return (f16[..., 0].astype(np.uint32) & 0xFFFF) | ((f16[..., 1].astype(np.uint32) & 0xFFFF)
                                                      << 16)


def _f16x2_arith(op: str, *operands: np.ndarray | int) -> np.ndarray:
    """mul.rn.f16x2 d, a, b / fma.rn.f16x2 d, a, b, c per 16-bit half, IEEE with subnormals
    (no .ftz): computed in float64, where these products and sums are exact, then rounded
    once to FP16 (NaN and inf as IEEE gives them)."""
    out = np.zeros(np.broadcast(*operands).shape, dtype=np.uint32)
    for half in (0, 1):
        x = [((np.asarray(o, dtype=np.uint32) >> (16 * half)) & 0xFFFF).astype(np.uint16)
             .view(np.float16).astype(np.float64) for o in operands]
        with np.errstate(invalid="ignore", over="ignore"):
            r = x[0] * x[1] if op.startswith("mul") else x[0] * x[1] + x[2]
            bits = r.astype(np.float16).view(np.uint16).astype(np.uint32)
        out |= bits << (16 * half)
    return out


def run_ptx(ptx: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute one of common.py's PTX strings on uint32 arrays; returns every register."""
    regs = dict(inputs)

    def val(tok: str) -> np.ndarray | int:
        tok = tok.strip()
        if tok.startswith("0x"):
            return int(tok, 16)
        return int(tok) if tok.isdigit() else regs[tok]

    body = ptx.strip().removeprefix("{").removesuffix("}")
    for ins in filter(None, (s.strip() for s in body.split(";"))):
        ins = ins.strip("{} ")
        if ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        args = [a.strip() for a in re.split(r",(?![^{]*})", rest)]
        if op == "prmt.b32":
            regs[args[0]] = _prmt(val(args[1]), val(args[2]), val(args[3]))
        elif op == "shl.b32":
            regs[args[0]] = (val(args[1]) << val(args[2])) & 0xFFFFFFFF
        elif op == "and.b32":
            regs[args[0]] = val(args[1]) & val(args[2])
        elif op in ("mul.rn.f16x2", "fma.rn.f16x2"):
            regs[args[0]] = _f16x2_arith(op, *(val(a) for a in args[1:]))
        elif op == "cvt.rn.f16x2.e4m3x2":
            regs[args[0]] = _cvt_e4m3x2(val(args[1]))
        elif op == "mov.b32" and args[0].startswith("{"):  # split into 16-bit halves
            lo, hi = (x.strip() for x in args[0].strip("{}").split(","))
            regs[lo], regs[hi] = val(args[1]) & 0xFFFF, val(args[1]) >> 16
        elif op == "mov.b32" and args[1].startswith("{"):  # join halves
            lo, hi = (x.strip() for x in args[1].strip("{}").split(","))
            regs[args[0]] = val(lo) | (val(hi) << 16)
        elif op == "mov.b32":
            regs[args[0]] = val(args[1])
        else:
            raise AssertionError(f"the emulator does not know {op!r}: extend it")
    return regs


def _words(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)


def _f16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((bits & 0xFFFF).astype(np.uint16).view(np.int16)).view(torch.float16)


def _expect(codes: np.ndarray, software: bool) -> torch.Tensor:
    """Reference decode of uint8 codes (software: times 2^-8; NaN codes NaN; the startup check's
    reference, itself tested against kvcap.numerics.e4m3)."""
    c = torch.from_numpy(codes.astype(np.uint8))
    return expected_bits(c, software).view(torch.float16)


def _same(got_bits: np.ndarray, codes: np.ndarray, software: bool) -> bool:
    got, want = _f16(got_bits), _expect(codes, software)
    finite = ~want.isnan()
    return bool(torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
                and got[~finite].isnan().all())


# every byte pair (lo, hi) at every position of the input words, random bytes elsewhere
_PAIRS = np.stack(np.meshgrid(np.arange(256), np.arange(256)), -1).reshape(-1, 2).astype(np.uint32)


@pytest.mark.parametrize("software", [False, True])
def test_byte_route_ptx(software):
    """convert_tile: bytes 0,1 of $2 -> $0 (f16x2, element order), bytes 2,3 -> $1."""
    ptx = (common._SOFTWARE_PTX if software else common._NATIVE_PTX).value
    rng = np.random.default_rng(0)
    for pos in (0, 2):  # the pair at bytes 0,1 then at 2,3
        x = _words(rng, len(_PAIRS))
        mask = np.uint32(0xFFFF << (8 * pos))
        x = (x & ~mask) | (_PAIRS[:, 0] << (8 * pos)) | (_PAIRS[:, 1] << (8 * pos + 8))
        r = run_ptx(ptx, {"$2": x})
        for k, out in enumerate(("$0", "$1")):
            for half in (0, 1):
                byte = (x >> (8 * (2 * k + half))) & 0xFF
                assert _same(r[out] >> (16 * half), byte, software), (out, half)


@pytest.mark.parametrize("software", [False, True])
def test_word_route_ptx(software):
    """convert_words without pairs: byte j of $4 -> $j (one FP16 each)."""
    ptx = (common._SOFTWARE_WORD_PTX if software else common._NATIVE_WORD_PTX).value
    rng = np.random.default_rng(1)
    x = _words(rng, len(_PAIRS))
    x = (x & np.uint32(0xFFFF0000)) | _PAIRS[:, 0] | (_PAIRS[:, 1] << 8)
    x2 = (x << 16) | (x >> 16)  # the pairs at bytes 2,3 too
    for w in (x, x2):
        r = run_ptx(ptx, {"$4": w})
        for j in range(4):
            assert _same(r[f"${j}"], (w >> (8 * j)) & 0xFF, software), j


@pytest.mark.parametrize("software", [False, True])
def test_word_pairs_ptx(software):
    """convert_words with pairs: $j = f16x2(byte j of $4, byte j of $5), for every group j."""
    ptx = (common._SOFTWARE_PAIR_PTX if software else common._NATIVE_PAIR_PTX).value
    rng = np.random.default_rng(2)
    for j in range(4):
        a, b = _words(rng, len(_PAIRS)), _words(rng, len(_PAIRS))
        mask = ~np.uint32(0xFF << (8 * j))
        a = (a & mask) | (_PAIRS[:, 0] << (8 * j))
        b = (b & mask) | (_PAIRS[:, 1] << (8 * j))
        r = run_ptx(ptx, {"$4": a, "$5": b})
        for g in range(4):
            assert _same(r[f"${g}"], (a >> (8 * g)) & 0xFF, software), (j, g)
            assert _same(r[f"${g}"] >> 16, (b >> (8 * g)) & 0xFF, software), (j, g)


@pytest.mark.parametrize("name,outs,ins", [("_SOFTWARE_PTX", 2, ["$2"]),
                                            ("_SOFTWARE_WORD_PTX", 4, ["$4"]),
                                            ("_SOFTWARE_PAIR_PTX", 4, ["$4", "$5"])])
def test_software_outputs_may_share_an_input_register(name, outs, ins):
    """Inline-asm outputs may be given an input's register: each software string must give the
    same results when any one output is that register (it writes its outputs last)."""
    ptx = getattr(common, name).value
    rng = np.random.default_rng(3)
    inputs = {r: _words(rng, 4096) for r in ins}
    want = run_ptx(ptx, inputs)
    for k in range(outs):
        for r in ins:
            got = run_ptx(ptx.replace(f"${k}", r), dict(inputs))
            assert np.array_equal(got[r], want[f"${k}"]), (k, r)
            for j in range(outs):
                if j != k:
                    assert np.array_equal(got[f"${j}"], want[f"${j}"]), (k, r, j)
