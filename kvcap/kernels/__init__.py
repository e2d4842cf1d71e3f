"""Pure Triton kernels and thin launchers (they take tensors and ints; no other kvcap imports).

store_kv: paged cache write, E4M3 quantize-on-write. paged_decode: split-K / grouped decode.
paged_prefill: chunked-prefill varlen attention. See docs/kernels.md for routes and switches.
"""
