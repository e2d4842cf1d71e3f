"""Edge cases of the attention kernels found in bug hunts (store, decode, chunked prefill,
the Triton backend: launch logic, and a sliding window's running max), each against the torch
twin and the float64 computation of test_kernels_cases. Kernels run under TRITON_INTERPRET=1
on CPU and compiled on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_kernels_cases import check_output as _check  # noqa: E402
from test_kernels_cases import (  # noqa: E402
    kernel_device,
    make_case,
    needs_kernels,
    store_new_kv,
    twin_output,
)
from test_kernels_cases import run_decode as _decode  # noqa: E402

from kvcap.attention.triton_backend import TritonBackend  # noqa: E402
from kvcap.kernels import prefill  # noqa: E402

DEV = kernel_device()
CUDA_GRID_YZ = 65535  # CUDA's limit on a grid's y and z axes


class _LaunchSpy:
    """Stands in for a Triton kernel: records each launch's grid and constexprs (and runs
    `real`, if given)."""

    def __init__(self, real=None):
        self.real, self.launches = real, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((tuple(grid), kwargs))
            if self.real is not None:
                self.real[grid](*args, **kwargs)
        return launch


def test_prefill_grid_stays_within_cuda_axis_limits(monkeypatch):
    """One 128K-token chunk of the reference shape (D = 256, GQA-6) in the tiles GPUs without
    MMA take (16 rows: 2 tokens x 8 padded heads) is 65,536 query tiles: the grid's y axis took
    them all, one past CUDA's 65,535, and the launch failed. The grid must stay within the
    limit and still cover every token."""
    spy = _LaunchSpy()
    monkeypatch.setattr(prefill, "_prefill_kernel", spy)
    n, hq, hkv, d = 131072, 6, 1, 256
    q = torch.zeros(4, hq, d, dtype=torch.float16)
    kc = torch.zeros(2, hkv, 16, d, dtype=torch.uint8)
    scale = torch.tensor(0.5)
    prefill.paged_prefill(q, kc, kc.clone(), torch.empty_like(q),
                          torch.zeros(1, 1, dtype=torch.int32),
                          torch.tensor([n], dtype=torch.int32),
                          torch.tensor([0, n], dtype=torch.int32), 0.0625, n, scale, scale,
                          block_m=16, block_n=16)
    ((grid, consts),) = spy.launches
    assert grid[1] <= CUDA_GRID_YZ and grid[2] <= CUDA_GRID_YZ, grid
    assert grid[1] * consts["BLOCK_Q"] >= n, (grid, consts["BLOCK_Q"])


@needs_kernels()
@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8_e4m3"])
def test_prefill_taller_tiles_past_the_grid_limit(monkeypatch, kv_dtype):
    """With the y axis capped at 2 tiles, a 19-token chunk takes 16-token tiles (not the
    4 that 16 rows over GQA-4 give) and computes what the small tiles do: chunks over more
    than one tile, a decode row the prefill kernel serves too, a row without new tokens,
    48-token blocks (not a power of two), distinct k/v scales."""
    seqs = [(0, 19), (47, 1), (50, 0), (5, 13), (96, 9)]
    case = make_case(seqs, 8, 2, 32, block_size=48, kv_dtype=kv_dtype, pad_rows=2, seed=21,
                     device=DEV)
    twin = twin_output(case)
    store_new_kv(case)
    spy = _LaunchSpy(prefill._prefill_kernel)
    monkeypatch.setattr(prefill, "_prefill_kernel", spy)
    monkeypatch.setattr(prefill, "MAX_GRID_Y", 2)
    m, c, out = case.meta, case.cache, case.out_buffer()
    prefill.paged_prefill(case.q, c.k_cache, c.v_cache, out, m.block_tables, m.seq_lens,
                          m.query_start_loc, case.softmax_scale, m.max_query_len, c.k_scale,
                          c.v_scale, skip_decode=False, block_m=16)
    ((grid, consts),) = spy.launches
    assert grid[1] == 2 and consts["BLOCK_Q"] == 16, (grid, consts["BLOCK_Q"])
    _check(case, out, kv_dtype, twin)


@needs_kernels()
def test_decode_refuses_zero_splits():
    """num_splits=0 launched an empty grid: nothing ran and `out` kept whatever it held."""
    case = make_case([(20, 1), (3, 1)], 4, 2, 32, kv_dtype="fp8_e4m3", seed=4, device=DEV)
    with pytest.raises(ValueError, match="num_splits=0"):
        _decode(case, num_splits=0)


@needs_kernels()
@pytest.mark.parametrize("block_size,hq,hkv,d", [(48, 6, 1, 128), (80, 9, 3, 64),
                                                 (272, 7, 1, 256)])
def test_backend_block_sizes_not_powers_of_two(block_size, hq, hkv, d):
    """The backend over blocks of 48 / 80 / 272 tokens (the kernels gather each row's block,
    no tile assumes a power-of-two block): decode rows ending exactly on and one past a block
    edge, a first token, a row with no new tokens and a chunk longer than a block, E4M3 with
    distinct scales, GQA 6 / 3 / 7."""
    bs = block_size
    seqs = [(bs - 1, 1), (bs, 1), (0, 1), (bs + 3, 0), (3, bs + 2), (2 * bs - 4, 4)]
    case = make_case(seqs, hq, hkv, d, block_size=bs, kv_dtype="fp8_e4m3", pad_rows=2,
                     seed=bs, device=DEV)
    twin = twin_output(case)
    out = case.out_buffer()
    TritonBackend().forward(case.q, case.k, case.v, case.cache, case.meta, case.softmax_scale,
                            out)
    _check(case, out, "fp8_e4m3", twin)


# --- a second hunt ---------------------------------------------------------------------------

@needs_kernels()
@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8_e4m3"])
def test_prefill_window_row_that_sees_nothing_in_the_first_tile(kv_dtype):
    """A chunk through a 4-token sliding window: each query tile starts at its first row's
    window, so its later rows see nothing in the first KV tile, and that tile left them a
    running max of 0 instead of -inf. Their real scores (every new key points away from every
    query: logits near -20) were then taken relative to 0, their FP16 probabilities underflowed
    and the rows came out 0. Mixed batch (a decode row too), GQA 2, E4M3 with distinct scales;
    80 new tokens so the GPU's 64-token tiles hit it as well as the interpreter's small ones."""
    ctx, n, window = 40, 80, 4
    case = make_case([(ctx, n), (9, 1)], 2, 1, 16, kv_dtype=kv_dtype, pad_rows=2,
                     window=window, seed=3, device=DEV)
    g = torch.Generator().manual_seed(0)
    q = 1 + 0.1 * torch.randn(case.q[:n].shape, generator=g)
    k = -5 + 0.1 * torch.randn(case.k[:n].shape, generator=g)
    case.q[:n] = q.to(case.q.dtype).to(DEV)
    case.k[:n] = k.to(case.k.dtype).to(DEV)
    case.full_k[0][ctx:] = case.k[:n]
    twin = twin_output(case)
    out = case.out_buffer()
    TritonBackend().forward(case.q, case.k, case.v, case.cache, case.meta, case.softmax_scale,
                            out)
    _check(case, out, kv_dtype, twin)
