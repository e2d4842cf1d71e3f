"""TorchReferenceBackend against an independent dense float64 computation."""

from __future__ import annotations

import pytest
import torch
from test_kernels_cases import (
    SENTINEL,
    dense_expected,
    expected_cache_bytes,
    make_case,
    read_slots,
)

from kvcap.attention.torch_ref import TorchReferenceBackend

MIXED = [(0, 7), (20, 1), (13, 5), (33, 1), (0, 1), (16, 16)]
TOL = {"fp32": 2e-5, "fp16": 3e-3, "bf16": 2e-2, "fp8_e4m3": 3e-3}


def _run(case):
    out = case.out_buffer()
    res = TorchReferenceBackend().forward(case.q, case.k, case.v, case.cache, case.meta,
                                          case.softmax_scale, out)
    assert res is out
    return out


@pytest.mark.parametrize("kv_dtype,dtype", [("fp32", torch.float32), ("fp16", torch.float16),
                                            ("bf16", torch.bfloat16),
                                            ("fp8_e4m3", torch.float16),
                                            ("fp8_e4m3", torch.float32)])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (6, 1, 32), (4, 4, 16)])
def test_mixed_batch_vs_dense(kv_dtype, dtype, hq, hkv, d):
    case = make_case(MIXED, hq, hkv, d, kv_dtype=kv_dtype, dtype=dtype, pad_rows=3, seed=hq + d)
    out = _run(case)
    nt = case.meta.num_tokens
    assert (out[nt:] == SENTINEL).all()  # padding rows untouched
    exp = dense_expected(case)
    got = out[:nt].double()
    err = (got - exp).norm() / exp.norm()
    assert err < TOL[kv_dtype], err
    # the store wrote exactly the expected bytes at every new token's slot
    slots = case.meta.slot_mapping[:nt]
    ek, ev = expected_cache_bytes(case)
    assert torch.equal(read_slots(case.cache.k_cache, slots), ek)
    assert torch.equal(read_slots(case.cache.v_cache, slots), ev)


def test_scales_are_applied():
    """With distinct non-unit scales, swapping or dropping one must change the result."""
    case = make_case([(30, 2)], 4, 2, 32, kv_dtype="fp8_e4m3", dtype=torch.float32)
    good = _run(case).clone()
    exp = dense_expected(case)
    assert (good.double() - exp).norm() / exp.norm() < 3e-3
    case.cache.v_scale.fill_(1.0)
    bad = _run(case)
    assert (bad.double() - exp).norm() / exp.norm() > 0.5


def test_padding_slots_are_skipped():
    case = make_case([(3, 2)], 2, 1, 16, kv_dtype="fp8_e4m3", pad_rows=4)
    before = case.cache.k_cache.clone()
    _run(case)
    changed = (case.cache.k_cache != before).any(dim=(1, 2, 3)).nonzero().flatten().tolist()
    assert len(changed) == 1  # only the block holding the two new tokens


def test_missing_blocks_raise():
    case = make_case([(20, 1)], 2, 1, 16)
    case.meta.block_tables[0, 1] = -1
    with pytest.raises(ValueError):
        _run(case)
