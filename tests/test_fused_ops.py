"""Fused decoder-layer kernels (residual add + RMSNorm, RoPE + q/k/v split, SiLU-mul) against
their torch twins in kvcap.models.llama (interpreter on CPU, compiled on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from kvcap.kernels import fused_ops, l2_prefetch  # noqa: E402
from kvcap.models.llama import RMSNorm, rotate_half  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The CPU interpreter converts to bf16 by truncation, not round-to-nearest (a known
# interpreter limitation, as for its bf16 tl.dot): bf16 is checked on GPUs only.
DTYPES = [torch.float16, torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEV == "cpu", reason="Triton interpreter rounds bf16 by truncation"))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 576])
def test_add_rms_norm_matches_torch(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=g) * 3).to(DEV, dtype)
    r = (torch.randn(7, hidden, generator=g) * 3).to(DEV, dtype)
    norm = RMSNorm(hidden, 1e-5).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
        s = x + r
        want = norm._norm(s)
        out, res = fused_ops.add_rms_norm(x, norm.weight, 1e-5, r)
        alone = fused_ops.add_rms_norm(x, norm.weight, 1e-5)
    assert torch.equal(res, s)  # the residual sum rounds exactly where torch rounds it
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    torch.testing.assert_close(alone, norm._norm(x), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 1, 16), (2, 2, 128)])
def test_rope_split_matches_torch(dtype, hq, hkv, d):
    g = torch.Generator().manual_seed(d + hq)
    t = 5
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(DEV, dtype)
    ang = torch.rand(t, 1, d, generator=g) * 6
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    q, k, v = fused_ops.rope_split_qkv(qkv, cos, sin, hq, hkv, d)
    q0, k0, v0 = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q0, k0, v0 = q0.view(t, hq, d), k0.view(t, hkv, d), v0.view(t, hkv, d)
    assert torch.equal(q, q0 * cos + rotate_half(q0) * sin)  # same roundings, bit for bit
    assert torch.equal(k, k0 * cos + rotate_half(k0) * sin)
    assert torch.equal(v, v0) and q.is_contiguous() and k.is_contiguous()


@pytest.mark.parametrize("kv", ["fp8_e4m3", "auto"])
@pytest.mark.parametrize("hq,hkv,d,block", [(9, 3, 64, 16), (4, 1, 16, 32)])
def test_rope_split_writes_the_cache_like_store_kv(kv, hq, hkv, d, block):
    """The RoPE kernel's cache write: the same bytes as store_kv of its own k/v (E4M3 with
    distinct non-unit scales), padding slots (-1) skipped, a large block index, and q/k/v as
    without the write."""
    from kvcap.kernels.store_kv import store_kv
    from kvcap.kv_cache.pool import LayerKVCache

    dtype = torch.float16
    g = torch.Generator().manual_seed(hq * d + block)
    t, num_blocks = 6, 70
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(DEV, dtype)
    ang = torch.rand(t, 1, d, generator=g) * 6
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    slots = torch.tensor([5, -1, 69 * block + block - 1, 2 * block, -1, 3 * block + 7],
                         dtype=torch.int64, device=DEV)
    fp8 = kv == "fp8_e4m3"
    cdtype = torch.uint8 if fp8 else dtype
    ks = torch.tensor(0.0137, device=DEV) if fp8 else None
    vs = torch.tensor(0.0061, device=DEV) if fp8 else None

    def pool():
        fill = 0xA5 if fp8 else 7.0  # a sentinel that shows any write to a skipped slot
        return [torch.full((num_blocks, hkv, block, d), fill, dtype=cdtype, device=DEV)
                for _ in range(2)]

    kc, vc = pool()
    cache = LayerKVCache(0, kc, vc, kv, ks, vs)
    q, k, v = fused_ops.rope_split_qkv(qkv, cos, sin, hq, hkv, d, cache=cache,
                                       slot_mapping=slots)
    q0, k0, v0 = fused_ops.rope_split_qkv(qkv, cos, sin, hq, hkv, d)
    assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0)
    kr, vr = pool()
    store_kv(k0, v0, kr, vr, slots, ks, vs)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    assert not torch.equal(kc, pool()[0])  # it wrote something
    with pytest.raises(ValueError, match="slot_mapping with one slot per row"):
        fused_ops.rope_split_qkv(qkv, cos, sin, hq, hkv, d, cache=cache, slot_mapping=slots[:2])
    with pytest.raises(ValueError, match="shape mismatch"):
        half = LayerKVCache(0, kc[..., : d // 2], vc[..., : d // 2], kv, ks, vs)
        fused_ops.rope_split_qkv(qkv, cos, sin, hq, hkv, d, cache=half, slot_mapping=slots)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 2 * 1536, generator=g) * 4).to(DEV, dtype)
    gate, up = x.split(1536, dim=-1)
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(fused_ops.silu_mul(x), F.silu(gate) * up, rtol=tol, atol=tol)


def test_empty_batches_and_switch(monkeypatch):
    from kvcap.models.llama import FUSED_OPS_ENV, fused_ops_for

    w = torch.ones(64, device=DEV)
    assert fused_ops.add_rms_norm(torch.empty(0, 64, device=DEV), w, 1e-6).shape == (0, 64)
    assert fused_ops.silu_mul(torch.empty(0, 32, device=DEV)).shape == (0, 16)
    monkeypatch.setenv(FUSED_OPS_ENV, "1")
    assert fused_ops_for(torch.empty(1, device=DEV)) is None
    monkeypatch.delenv(FUSED_OPS_ENV)
    assert (fused_ops_for(torch.empty(1, device=DEV)) is fused_ops) == (DEV == "cuda")


@pytest.mark.parametrize("kv", ["fp8_e4m3", "auto"])
def test_engine_writes_the_cache_in_the_rope_kernel(kv, tmp_path, monkeypatch):
    """Through the engine (tiny random model, Triton backend, prefill over two blocks then
    decode): with the cache written by the RoPE kernel, the backend's own store_kv never runs,
    and the tokens and every cache byte equal the run where the backend stores K/V."""
    import json

    from kvcap import LLM, SamplingParams
    from kvcap.attention import triton_backend
    from kvcap.models import llama

    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set before triton is imported) or a GPU")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 301, "hidden_size": 64,
        "intermediate_size": 97, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "rope_theta": 10000.0}))
    scales = {f"model.layers.{i}.self_attn.{n}_scale": s
              for i in range(2) for n, s in (("k", 0.013 + 0.004 * i), ("v", 0.006 + 0.002 * i))}
    kw = dict(model=f"dummy:{tmp_path}", device=DEV, num_blocks=16, block_size=16,
              attention_backend="triton", kv_cache_dtype=kv, dtype="float16")
    if kv == "fp8_e4m3":
        kw["kv_scales"] = scales
    monkeypatch.setattr(llama, "fused_ops_for", lambda x: fused_ops)
    stores = []
    real_store = triton_backend.store_kv
    monkeypatch.setattr(triton_backend, "store_kv", lambda *a, **k: (stores.append(1),
                                                                     real_store(*a, **k)))
    prompts = [[1, 5, 9, 33, 2], list(range(7, 26))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    runs = {}
    for in_rope in (True, False):
        monkeypatch.setenv("KVCAP_DISABLE_ROPE_KV_WRITE", "0" if in_rope else "1")
        stores.clear()
        with LLM(**kw) as llm:
            tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            caches = [c.clone() for c in llm.pool.k_caches + llm.pool.v_caches]
        runs[in_rope] = (tokens, caches, len(stores))
    assert runs[True][2] == 0 and runs[False][2] > 0
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1], strict=True))


@pytest.mark.skipif(not l2_prefetch.supported(torch.device(DEV)),
                    reason="the bulk L2 prefetch needs an sm_90+ GPU")
def test_l2_prefetch_changes_nothing():
    """The experiment's prefetch kernel (scripts/l2_prefetch_probe.py) leaves its tensor as it
    was and refuses what it cannot address."""
    w = torch.randn(640, 48, device=DEV)
    before = w.clone()
    l2_prefetch.l2_prefetch(w)
    torch.cuda.synchronize()
    assert torch.equal(w, before)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch.l2_prefetch(w.t())
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        l2_prefetch.l2_prefetch(torch.ones(3, dtype=torch.uint8, device=DEV))


def test_fused_ops_write_into_given_buffers():
    """The piecewise CUDA graphs' static buffers: rope_split_qkv's `out` and add_rms_norm's
    `res_out` (also the residual itself, in place) hold what the allocating calls return."""
    dtype, hq, hkv, d, t, hidden = torch.float16, 4, 2, 32, 5, 96
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(DEV, dtype)
    ang = torch.rand(t, 1, d, generator=g) * 6
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    want = fused_ops.rope_split_qkv(qkv, cos, sin, hq, hkv, d)
    bufs = tuple(torch.full_like(w, 9.0) for w in want)
    got = fused_ops.rope_split_qkv(qkv, cos, sin, hq, hkv, d, out=bufs)
    assert all(a is b for a, b in zip(got, bufs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="rope_split_qkv out"):
        fused_ops.rope_split_qkv(qkv, cos, sin, hq, hkv, d, out=(bufs[0], bufs[2], bufs[1][:2]))

    x = torch.randn(t, hidden, generator=g).to(DEV, dtype)
    r = torch.randn(t, hidden, generator=g).to(DEV, dtype)
    w = torch.rand(hidden, generator=g).to(DEV, dtype)
    out, res = fused_ops.add_rms_norm(x, w, 1e-5, r)
    sink = torch.zeros_like(r)
    out2, res2 = fused_ops.add_rms_norm(x, w, 1e-5, r, sink)
    assert res2 is sink and torch.equal(res2, res) and torch.equal(out2, out)
    inplace = r.clone()
    out3, res3 = fused_ops.add_rms_norm(x, w, 1e-5, inplace, inplace)
    assert res3 is inplace and torch.equal(res3, res) and torch.equal(out3, out)
    with pytest.raises(ValueError, match="res_out must be"):
        fused_ops.add_rms_norm(x, w, 1e-5, r, sink[:2])
