"""Programmatic dependent launch of a decode step's kernels (kvcap.kernels.common.pdl_launch):
each kernel may start while the one before it still runs and waits in-kernel for its inputs.
On the GPU a whole layer's chain of kernels, replayed from a CUDA graph, must give the bytes it
gives with every kernel launched the ordinary way."""

from __future__ import annotations

import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcap.kernels import common, fused_ops  # noqa: E402
from kvcap.kernels.decode import paged_decode  # noqa: E402
from kvcap.kernels.skinny_gemm import skinny_linear, skinny_swiglu  # noqa: E402
from kvcap.kv_cache.pool import LayerKVCache  # noqa: E402

GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def test_release_rule(monkeypatch):
    """Grids of at most one program per SM let the next kernel launch at once, larger ones at
    their end; an ordinary launch waits for nothing (sm_count is 4 off the GPU)."""
    cpu = torch.device("cpu")
    monkeypatch.delenv(common.ENV_PDL_RELEASE, raising=False)
    on = {"launch_pdl": True}
    assert common.pdl_mode({}, (1,), cpu) == 0
    assert common.pdl_mode(on, (2, 2), cpu) == 2 and common.pdl_mode(on, (5, 1, 1), cpu) == 1
    monkeypatch.setenv(common.ENV_PDL_RELEASE, "end")
    assert common.pdl_mode(on, (1,), cpu) == 1
    monkeypatch.setenv(common.ENV_PDL_RELEASE, "start")
    assert common.pdl_mode(on, (500,), cpu) == 2 and common.pdl_mode({}, (500,), cpu) == 0
    monkeypatch.setenv(common.ENV_PDL_RELEASE, "begin")  # a typo was ignored: the rule ran
    with pytest.raises(ValueError, match="use end or start"):
        common.pdl_mode(on, (1,), cpu)


def test_this_triton_has_programmatic_launch():
    """CI's and the H200's Triton launch dependents; the check is what keeps an older one on
    ordinary launches instead of failing on an unknown option."""
    assert common._triton_has_pdl()


def test_no_pdl_off_the_gpu_or_when_disabled(monkeypatch):
    monkeypatch.delenv(common.ENV_DISABLE_PDL, raising=False)
    assert common.pdl_launch(torch.device("cpu"), 1) == {}
    if GPU:
        dev = torch.device("cuda")
        want = {"launch_pdl": True} if torch.cuda.get_device_capability()[0] >= 9 else {}
        limit = common.pdl_max_rows(dev)
        assert common.pdl_launch(dev, limit) == want
        assert common.pdl_launch(dev, limit + 1) == {}
        monkeypatch.setenv(common.ENV_DISABLE_PDL, "1")
        assert common.pdl_launch(dev, 1) == {}


def test_pdl_rows_limit_switch(monkeypatch):
    """KVCAP_PDL_MAX_ROWS replaces PDL_MAX_ROWS (for measurements) and names itself when it
    is not a row count."""
    monkeypatch.delenv(common.ENV_PDL_MAX_ROWS, raising=False)
    assert common.pdl_max_rows() == common.PDL_MAX_ROWS == 16
    monkeypatch.setenv(common.ENV_PDL_MAX_ROWS, "64")
    assert common.pdl_max_rows() == 64
    assert common.pdl_launch(torch.device("cpu"), 32) == {}  # never off the GPU
    monkeypatch.setenv(common.ENV_PDL_MAX_ROWS, "-3")
    assert common.pdl_max_rows() == 0
    monkeypatch.setenv(common.ENV_PDL_MAX_ROWS, "all")
    with pytest.raises(ValueError, match="KVCAP_PDL_MAX_ROWS='all' is not an integer"):
        common.pdl_max_rows()
    if GPU and torch.cuda.get_device_capability()[0] >= 9:
        monkeypatch.delenv(common.ENV_PDL_MAX_ROWS)
        name = torch.cuda.get_device_name()
        measured = "H100 80GB HBM3" in name or "H200" in name
        assert common.pdl_max_rows(torch.device("cuda")) == (64 if measured else 16)
        monkeypatch.setenv(common.ENV_PDL_MAX_ROWS, "64")
        assert common.pdl_launch(torch.device("cuda"), 64) == {"launch_pdl": True}
        assert common.pdl_launch(torch.device("cuda"), 65) == {}


def test_pdl_rows_by_gpu_name(monkeypatch):
    """GPUs named in PDL_MAX_ROWS_BY_GPU (the SXM H100 and the H200: 64 rows, measured with
    every linear on the skinny kernels) take its limit, others PDL_MAX_ROWS; the switch
    replaces both."""
    monkeypatch.delenv(common.ENV_PDL_MAX_ROWS, raising=False)
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H100 PCIe", 2: "NVIDIA H200"}
    monkeypatch.setattr(common, "_PROPERTIES", {i: types.SimpleNamespace(name=n)
                                                 for i, n in names.items()})
    assert common.pdl_max_rows(torch.device("cuda", 0)) == 64
    assert common.pdl_max_rows(torch.device("cuda", 2)) == 64
    assert common.pdl_max_rows(torch.device("cuda", 1)) == common.PDL_MAX_ROWS == 16
    assert common.pdl_max_rows(torch.device("cpu")) == common.pdl_max_rows() == 16
    monkeypatch.setenv(common.ENV_PDL_MAX_ROWS, "8")
    assert common.pdl_max_rows(torch.device("cuda", 0)) == 8


def _layer_chain(x, res, w, cos, sin, cache, slots, meta, layers):
    """`layers` decoder layers' decode kernels in the engine's order, every layer on the same
    weights and cache (idempotent: replays write the same bytes)."""
    t = x.shape[0]
    for _ in range(layers):
        h, res = fused_ops.add_rms_norm(x, w["norm1"], 1e-5, res)
        qkv = skinny_linear(h, w["qkv"])
        q, _, _ = fused_ops.rope_split_qkv(qkv, cos, sin, 8, 2, 128, cache=cache,
                                           slot_mapping=slots)
        attn = torch.empty_like(q)
        paged_decode(q, cache.k_cache, cache.v_cache, attn, *meta, cache.k_scale,
                     cache.v_scale)
        o = skinny_linear(attn.view(t, -1), w["o"])  # K split in two, reduced in the kernel
        h, res = fused_ops.add_rms_norm(o, w["norm2"], 1e-5, res)
        x = skinny_linear(skinny_swiglu(h, w["gate_up"]), w["down"])
    return x, res


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a compiled sm_90+ run")
@pytest.mark.parametrize("release", ["", "end", "start"])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("rows", [1, 16])
def test_graph_of_dependent_launches_matches_ordinary_launches(kv, rows, release, monkeypatch):
    monkeypatch.setenv(common.ENV_PDL_RELEASE, release)  # "": the rule
    g = torch.Generator(device="cuda").manual_seed(rows)
    dev, dt = "cuda", torch.bfloat16

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * s).to(dt)

    w = {"norm1": rnd(1024, s=0.5) + 1, "norm2": rnd(1024, s=0.5) + 1,
         "qkv": rnd(1536, 1024, s=0.03), "o": rnd(1024, 1024, s=0.03),
         "gate_up": rnd(2 * 2816, 1024, s=0.03), "down": rnd(1024, 2816, s=0.02)}
    block, ctx = 16, 700
    blocks_per_seq = -(-ctx // block)
    nblocks = rows * blocks_per_seq + 3
    fp8 = kv == "fp8"
    cdt = torch.uint8 if fp8 else dt
    kc = torch.zeros(nblocks, 2, block, 128, dtype=cdt, device=dev)
    vc = torch.zeros_like(kc)
    if fp8:  # earlier tokens: random bytes that are finite E4M3 values
        kc.random_(0, 0x7E, generator=g)
        vc.random_(0, 0x7E, generator=g)
    else:
        kc.copy_(rnd(*kc.shape))
        vc.copy_(rnd(*vc.shape))
    scales = ((torch.tensor(0.02, device=dev), torch.tensor(0.015, device=dev)) if fp8
              else (None, None))
    cache = LayerKVCache(0, kc, vc, "fp8_e4m3" if fp8 else "bf16", *scales)
    perm = torch.randperm(nblocks, generator=g, device=dev)[:rows * blocks_per_seq]
    tables = perm.view(rows, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((rows,), ctx, dtype=torch.int32, device=dev)
    seq_lens[0] = ctx - 37
    pos = (seq_lens - 1).long()
    slots = tables.long().gather(1, (pos // block)[:, None])[:, 0] * block + pos % block
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=dev)
    meta = (tables, seq_lens, qsl, 128 ** -0.5, ctx)
    freqs = pos.float()[:, None] / (10000 ** (torch.arange(0, 128, 2, device=dev) / 128))
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dt)[:, None], emb.sin().to(dt)[:, None]
    x0, r0 = rnd(rows, 1024), rnd(rows, 1024)

    monkeypatch.setenv(common.ENV_DISABLE_PDL, "1")
    want = _layer_chain(x0, r0, w, cos, sin, cache, slots, meta, layers=4)
    monkeypatch.delenv(common.ENV_DISABLE_PDL)
    assert common.pdl_launch(torch.device(dev), rows) == {"launch_pdl": True}
    eager = _layer_chain(x0, r0, w, cos, sin, cache, slots, meta, layers=4)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        got = _layer_chain(x0, r0, w, cos, sin, cache, slots, meta, layers=4)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        for a, b, c in zip(want, eager, got, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
