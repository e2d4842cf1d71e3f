"""Number formats: the exact E4M3FN codec."""

from kvcap.numerics.e4m3 import E4M3_MAX, decode, encode

__all__ = ["E4M3_MAX", "decode", "encode"]
