"""Exact FP8 E4M3FN codec in plain torch integer/float ops (SYSTEM.md section 1).

The codec never uses torch's float8 dtype, so tests can hold it against
`torch.float8_e4m3fn` and `ml_dtypes` as independent references. Works on CPU and CUDA.

Format: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7F/0xFF are NaN;
max finite 448; min normal 2^-6; min subnormal 2^-9 (subnormal value = m * 2^-9).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
E4M3_MIN_SUBNORMAL = 2.0**-9
E4M3_BIAS = 7
E4M3_NAN_CODE = 0x7F  # 0xFF is NaN too (negative sign bit)
E4M3_MAX_CODE = 0x7E  # +448; 0xFE is -448
DECODE_METHODS = ("bitcast", "scalar", "packed")

_FP32_BIAS = 127
_SUB_BOUND = 2.0**-6


def _scale_tensor(scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The scale as a 0-dim FP32 tensor on `device` (a device tensor, so CUDA divides
    exactly instead of multiplying by a reciprocal as it does for CPU scalars)."""
    if isinstance(scale, torch.Tensor):
        return scale.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(scale), dtype=torch.float32, device=device)


def encode(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Quantize `x` to E4M3FN raw bytes: q = e4m3(fp32(x) / scale).

    Round to nearest even, saturate to +-448 (finite input never yields NaN; inf saturates
    too), NaN input -> 0x7F with its sign bit. Returns uint8 of x's shape, on x's device.
    """
    y = x.float() / _scale_tensor(scale, x.device)
    bits = y.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign = (bits >> 31) & 1
    abits = bits & 0x7FFFFFFF
    a = (abits.to(torch.int32)).view(torch.float32)
    # Normal range: round the 23-bit FP32 mantissa to 3 bits (RNE), then rebias 127 -> 7.
    rounded = (abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20
    normal = rounded - ((_FP32_BIAS - E4M3_BIAS) << 3)
    # Subnormal range (|y| < 2^-6): m = RNE(|y| * 2^9), exact scaling by a power of two;
    # m == 8 is the smallest normal code, so the carry lands on the right code by itself.
    sub = torch.round(a * 512.0).to(torch.int64)
    code = torch.where(a < _SUB_BOUND, sub, normal).clamp(max=E4M3_MAX_CODE)
    code = torch.where(torch.isnan(y), torch.full_like(code, E4M3_NAN_CODE), code)
    return (code | (sign << 7)).to(torch.uint8)


def _fields(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.dtype != torch.uint8:
        raise ValueError(f"E4M3 codes must be uint8 raw bytes, got {q.dtype}")
    qi = q.to(torch.int32)
    return (qi >> 7) & 1, (qi >> 3) & 0xF, qi & 0x7


def _nan_fix(q: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    is_nan = (q & 0x7F) == E4M3_NAN_CODE
    return torch.where(is_nan, torch.full_like(val, float("nan")), val)


def _decode_scalar(q: torch.Tensor) -> torch.Tensor:
    s, e, m = _fields(q)
    pow2 = torch.tensor([2.0 ** (k - E4M3_BIAS) for k in range(16)], dtype=torch.float32,
                        device=q.device)
    mf = m.to(torch.float32)
    normal = (1.0 + mf / 8.0) * pow2[e.long()]
    sub = mf * E4M3_MIN_SUBNORMAL
    val = torch.where(e == 0, sub, normal)
    val = torch.where(s == 1, -val, val)
    return _nan_fix(q, val)


def _decode_bitcast(q: torch.Tensor) -> torch.Tensor:
    s, e, m = _fields(q)
    bits = (s << 31) | ((e + (_FP32_BIAS - E4M3_BIAS)) << 23) | (m << 20)
    normal = bits.view(torch.float32)
    sub = m.to(torch.float32) * E4M3_MIN_SUBNORMAL
    sub = torch.where(s == 1, -sub, sub)
    return _nan_fix(q, torch.where(e == 0, sub, normal))


def _decode_packed(q: torch.Tensor) -> torch.Tensor:
    """Four bytes per 32-bit word, moved into FP16 bit positions two at a time, one FP16
    multiply by 2^8. Within a 16-bit half holding a byte in bits 8..15 the sign is already at
    FP16's sign bit and `eeeemmm` only needs one right shift to sit at exponent/mantissa bits
    13..7; the even bytes are first moved up by 8. FP16 with exponent field e (bias 15) times
    2^8 is E4M3 with bias 7, and FP16 subnormals cover E4M3 subnormals exactly."""
    shape = q.shape
    flat = q.reshape(-1)
    pad = (-flat.numel()) % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    b = flat.view(-1, 4).to(torch.int64)
    w = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)  # little-endian word
    odd = (w & 0x80008000) | ((w >> 1) & 0x3F803F80)  # bytes 1 and 3 as FP16 pair
    even = ((w << 8) & 0x80008000) | ((w << 7) & 0x3F803F80)  # bytes 0 and 2
    halves = torch.stack([even & 0xFFFF, odd & 0xFFFF, (even >> 16) & 0xFFFF,
                          (odd >> 16) & 0xFFFF], dim=1).reshape(-1)
    halves = torch.where(halves >= 0x8000, halves - 0x10000, halves).to(torch.int16)
    h = halves.view(torch.float16) * torch.tensor(256.0, dtype=torch.float16, device=q.device)
    val = h.to(torch.float32)[: flat.numel() - pad].reshape(shape)
    return _nan_fix(q, val)


_DECODERS = {"bitcast": _decode_bitcast, "scalar": _decode_scalar, "packed": _decode_packed}


def decode(q: torch.Tensor, scale: float | torch.Tensor = 1.0,
           method: str = "bitcast") -> torch.Tensor:
    """Decode E4M3FN raw bytes to FP32 and multiply by `scale` (x_hat = decode(q) * scale).

    method: "bitcast" | "scalar" | "packed" — three exact decoders that agree bit for bit on
    the 254 finite codes and give NaN on exactly 0x7F/0xFF.
    """
    try:
        fn = _DECODERS[method]
    except KeyError:
        raise ValueError(
            f"unknown E4M3 decode method {method!r}; one of {DECODE_METHODS}"
        ) from None
    if q.dtype != torch.uint8:  # (the packed decoder has no _fields check: an int8 view of
        # the cache, sign-extended into its 32-bit words, decoded to garbage without a word)
        raise ValueError(f"E4M3 codes must be uint8 raw bytes, got {q.dtype}")
    val = fn(q)
    if isinstance(scale, torch.Tensor) or scale != 1.0:
        val = val * _scale_tensor(scale, q.device)
    return val
