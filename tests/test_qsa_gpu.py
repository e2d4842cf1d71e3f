"""QSA on a CUDA GPU (compiled Triton): the reference shape (head_dim 256, GQA-6, indexer
4 x 128, top-512) with contexts long enough for the two-stage top-k; identical selections
to the torch path and outputs within the E4M3 tolerance, for both indexer sources."""

from __future__ import annotations

import pytest
import torch

from kvcap.qsa.config import QSAConfig
from kvcap.qsa.synthetic import make_backend, make_cache, make_steps, run_steps

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("indexer,kv,fp8_mode", [("trained", "fp8_e4m3", "native"),
                                                 ("trained", "fp8_e4m3", "software"),
                                                 ("training_free", "fp8_e4m3", "native"),
                                                 ("trained", "fp16", "auto")])
def test_reference_shape_triton_equals_torch(indexer, kv, fp8_mode):
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, nb = 24, 4, 256, 1200
    trained = indexer == "trained"
    steps = make_steps([[9000, 2100, 700], [1, 300, 1], [1, 1, 1]], [9002, 2401, 702], hq,
                       hkv, d, 16, nb, torch.float16, g, "cuda",
                       index_heads=4 if trained else 0, index_dim=128, pad_rows=3)
    res = []
    for path in ("torch", "triton"):
        cfg = QSAConfig(layer_rule="explicit", layers=(0,), topk_groups=512, indexer=indexer,
                        path=path)
        be = make_backend(cfg, nb, 16, *((1, 128) if trained else (hkv, d)), device="cuda")
        be.fp8_mode = fp8_mode
        res.append(run_steps(be, make_cache(nb, hkv, 16, d, kv, "cuda"), steps, d ** -0.5))
    for (o_t, t_t), (o_k, t_k) in zip(*res, strict=True):
        assert torch.equal(t_t, t_k)
        assert bool((o_k[-3:] == 7.0).all())
        torch.testing.assert_close(o_k.float(), o_t.float(), rtol=2e-2, atol=2e-2)
