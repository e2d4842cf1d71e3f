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


def test_decode_graphs_equal_eager(tmp_path):
    """enable_qsa re-captures decode CUDA graphs; graph replays (row info recomputed inside
    the graph) must give the eager QSA run's greedy tokens."""
    import json

    from kvcap import LLM, SamplingParams
    from kvcap.qsa.enable import enable_qsa

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320,
           "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
           "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 64,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (900, 333, 64)]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outs = []
    for eager in (True, False):
        llm = LLM(model=f"dummy:{tmp_path}", dtype="float16", max_num_seqs=4,
                  max_model_len=2048, num_blocks=512, enforce_eager=eager)
        enable_qsa(llm, QSAConfig(layer_rule="all_but_first", first_dense=1, topk_groups=16))
        assert (llm.runner.graphs is None) == eager
        outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]
