"""Sliding-window attention (LayerKVCache.window): a query at position p sees p - W + 1 .. p.

The torch twin, the decode kernel (every route, split-K, folded merge) and the chunked-prefill
kernel against an independent float64 computation, with the cached positions no query sees
poisoned (NaN / 0x7F): a kernel that reads one, even masked out of the softmax, fails. Kernels
run under TRITON_INTERPRET=1 on CPU and compiled on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_kernels_cases import (  # noqa: E402
    QUERY_DTYPE,
    kernel_device,
    make_case,
    needs_kernels,
    store_new_kv,
    twin_output,
)
from test_kernels_cases import check_output as _check  # noqa: E402
from test_kernels_cases import run_decode as _decode  # noqa: E402

from kvcap.attention.triton_backend import TritonBackend  # noqa: E402
from kvcap.kernels.decode import paged_decode  # noqa: E402
from kvcap.kernels.prefill import paged_prefill  # noqa: E402

DEV = kernel_device()
kernels = needs_kernels()

# Contexts below, at, across and far past a 20-token window (not a multiple of any tile).
DECODE = [(40, 1), (3, 1), (70, 1), (19, 1), (20, 1), (133, 1)]
MIXED = [(0, 7), (20, 1), (13, 5), (45, 1), (0, 30), (16, 19), (50, 12)]
_DT, _twin = QUERY_DTYPE, twin_output


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8_e4m3"])
@pytest.mark.parametrize("window", [1, 7, 20])
def test_twin_sees_only_the_window(kv_dtype, window):
    """The torch twin (the CPU engine's attention) against the float64 computation, prefill
    and decode rows together, never touching a poisoned position."""
    case = make_case(MIXED, 6, 2, 16, kv_dtype=kv_dtype, dtype=_DT[kv_dtype], pad_rows=2,
                     seed=window, window=window)
    _check(case, _twin(case), kv_dtype)


def test_twin_window_past_every_sequence_is_full_attention():
    case = make_case(MIXED, 6, 2, 16, kv_dtype="fp32", dtype=torch.float32, seed=3, window=500)
    full = make_case(MIXED, 6, 2, 16, kv_dtype="fp32", dtype=torch.float32, seed=3)
    assert torch.equal(_twin(case), _twin(full))


@kernels
@pytest.mark.parametrize("kv_dtype,fp8_mode,words", [("fp16", "auto", False),
                                                     ("bf16", "auto", False),
                                                     ("fp8_e4m3", "native", False),
                                                     ("fp8_e4m3", "software", False),
                                                     ("fp8_e4m3", "native", True),
                                                     ("fp8_e4m3", "software", True)])
@pytest.mark.parametrize("num_splits,fold", [(1, False), (3, False), (3, True), (8, False)])
def test_decode_reads_only_the_window(kv_dtype, fp8_mode, words, num_splits, fold):
    """Split-K over the window's tiles only (the first starts below the window and is masked),
    empty splits for short sequences, the merge kernel and the folded merge."""
    case = make_case(DECODE, 8, 2, 64, kv_dtype=kv_dtype, dtype=_DT[kv_dtype], pad_rows=2,
                     seed=num_splits, window=20)
    out = _decode(case, fp8_mode=fp8_mode, words=words or None, num_splits=num_splits,
                  block_n=16, fold=fold)
    _check(case, out, kv_dtype, _twin(case))


@kernels
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("window,block_size", [(1, 16), (16, 16), (33, 32)])
def test_decode_window_edges(grouped, window, block_size):
    """A one-token window, a window of exactly one tile, and one past a block boundary."""
    case = make_case(DECODE, 9, 3, 32, block_size=block_size, kv_dtype="fp8_e4m3", seed=window,
                     window=window)
    _check(case, _decode(case, grouped=grouped, num_splits=2), "fp8_e4m3", _twin(case))


@kernels
@pytest.mark.parametrize("kv_dtype,fp8_mode", [("fp16", "auto"), ("fp32", "auto"),
                                               ("fp8_e4m3", "native"),
                                               ("fp8_e4m3", "software")])
@pytest.mark.parametrize("window", [5, 20])
def test_backend_mixed_batch(kv_dtype, fp8_mode, window):
    """The Triton backend's mixed step: prefill rows (chunks before, across and past the
    window, each tile of queries starting its own window) and decode rows."""
    case = make_case(MIXED, 9, 3, 32, kv_dtype=kv_dtype, dtype=_DT[kv_dtype], pad_rows=3,
                     seed=window, window=window)
    out = case.out_buffer()
    TritonBackend(fp8_mode).forward(case.q, case.k, case.v, case.cache, case.meta,
                                    case.softmax_scale, out)
    _check(case, out, kv_dtype, _twin(case))


@kernels
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32)])
def test_prefill_serves_decode_rows_in_a_window(block_m, block_n):
    """skip_decode=False: the prefill kernel alone, at tiles of several sizes."""
    case = make_case(MIXED, 8, 2, 32, kv_dtype="fp8_e4m3", seed=block_m + block_n, window=11)
    store_new_kv(case)
    m, out = case.meta, case.out_buffer()
    paged_prefill(case.q, case.cache.k_cache, case.cache.v_cache, out, m.block_tables,
                  m.seq_lens, m.query_start_loc, case.softmax_scale, m.max_query_len,
                  case.cache.k_scale, case.cache.v_scale, skip_decode=False,
                  block_m=block_m, block_n=block_n, window=11)
    _check(case, out, "fp8_e4m3")


@kernels
def test_backend_keeps_a_plan_per_window():
    """Sliding and full layers alternate (Qwen2 / Qwen3 layer_types): each gets its own launch
    plan in one step, and the full layer still sees everything."""
    sliding = make_case(MIXED, 4, 2, 16, kv_dtype="fp16", seed=2, window=6)
    full = make_case(MIXED, 4, 2, 16, kv_dtype="fp16", seed=2)
    backend = TritonBackend()
    for case in (sliding, full, sliding):
        out = case.out_buffer()
        backend.forward(case.q, case.k, case.v, case.cache, sliding.meta, case.softmax_scale,
                        out)
        _check(case, out, "fp16")
    assert {key[1] for key in backend._launchers} == {6, None}


@kernels
@pytest.mark.parametrize("launcher", [paged_decode, paged_prefill])
def test_bad_window_is_refused(launcher):
    case = make_case(MIXED, 4, 2, 16, kv_dtype="fp16", seed=1)
    m = case.meta
    with pytest.raises(ValueError, match="window=0"):
        launcher(case.q, case.cache.k_cache, case.cache.v_cache, case.out_buffer(),
                 m.block_tables, m.seq_lens, m.query_start_loc, case.softmax_scale,
                 m.max_seq_len, window=0)
