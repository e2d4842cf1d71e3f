"""The QSA benchmark's wiring, run once on tiny shapes through the CPU interpreter: the dense
and QSA arms compute what they claim (dense decode / attention over the selected tokens)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # never on a GPU box: it would reach its GPU tests too
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcap.attention.torch_ref import attend_reference, gather_kv_reference  # noqa: E402
from kvcap.bench.qsa import QSACell  # noqa: E402
from kvcap.qsa.backend import attend_masked_reference  # noqa: E402
from kvcap.qsa.selection import selection_mask  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU-interpreter tests (TRITON_INTERPRET=1)")


def test_bench_arms_compute_attention():
    cell = QSACell(1, 160, 0, device="cpu", topk=6)
    cache = cell.caches["e4m3"]
    meta = cell.metas[0]
    kf, vf = gather_kv_reference(cache, meta.block_tables[0], 160)
    cell.fns("dense_e4m3_software")[0]()
    dense = attend_reference(cell.q[0], kf, vf, 159, 256 ** -0.5)
    torch.testing.assert_close(cell.out[0].float(), dense, rtol=2e-2, atol=2e-2)
    cell.fns("qsa_e4m3_native")[0]()
    tokens = cell.be.record  # the bench keeps recording off
    assert tokens is None
    sel = cell.tokens[0]
    assert int((sel[0, 0] >= 0).sum()) == 6 * 4  # pos 159 completes a group: no open tail
    sparse = attend_masked_reference(cell.q[0], kf, vf, selection_mask(sel, 160), 256 ** -0.5)
    torch.testing.assert_close(cell.out[0].float(), sparse, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(sparse, dense, atol=1e-3)


@pytest.mark.parametrize("argv,flag", [(["--batches", "0"], "--batches"),
                                       (["--contexts", "16K"], "--contexts"),
                                       (["--e2e-concurrency", "1,-8"], "--e2e-concurrency"),
                                       (["--topk-chunks", "big"], "--topk-chunks")])
def test_bad_lists_are_usage_errors_before_the_gpu_is_needed(capsys, argv, flag):
    """The comma lists were parsed after the checks ran on the GPU: a 0 batch divided by zero
    in QSACell, a non-number was a ValueError traceback."""
    from kvcap.bench.qsa import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err
