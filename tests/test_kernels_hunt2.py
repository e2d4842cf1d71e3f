"""Second bug hunt over the attention kernels (store, decode, chunked prefill, the Triton
backend): each test failed before its fix, against the torch twin and the float64 computation
of test_kernels_cases. Kernels run under TRITON_INTERPRET=1 on CPU and compiled on a GPU.
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
    twin_output,
)

from kvcap.attention.triton_backend import TritonBackend  # noqa: E402

DEV = kernel_device()
pytestmark = needs_kernels()


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
