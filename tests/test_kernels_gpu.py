"""GPU-only kernel tests at real model shapes and longer contexts (compiled, not interpreted)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU (compiled Triton)")]

if torch.cuda.is_available():
    from test_kernels_cases import SENTINEL, dense_expected, make_case, twin_output

    from kvcap.attention.torch_ref import TorchReferenceBackend
    from kvcap.attention.triton_backend import TritonBackend
    from kvcap.kernels.decode import paged_decode
    from kvcap.kernels.store_kv import store_kv
    from kvcap.kv_cache.pool import LayerKVCache
    from kvcap.numerics import e4m3

SHAPES = [(32, 8, 128), (24, 4, 256), (9, 3, 64), (12, 2, 128), (8, 8, 64)]
DEVICE = "cuda"


def _err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_store_kv_bit_exact_large():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = (torch.randn(8192, 8, 128, device="cuda") * 40).to(dtype)
        x[0, 0, :8] = torch.tensor([0.0, -0.0, 1e-30, 448 * 0.02, 1e6, -1e6, 3e-5, -7e-6])
        kc = torch.zeros(512, 8, 16, 128, dtype=torch.uint8, device="cuda")
        vc = torch.zeros_like(kc)
        slots = torch.randperm(8192, device="cuda")
        s = torch.tensor(0.0213, device="cuda")
        store_kv(x, x, kc, vc, slots, s, s)
        assert torch.equal(kc[slots // 16, :, slots % 16], e4m3.encode(x, s))
        ref = (x.float() / s).to(torch.float8_e4m3fn).view(torch.uint8)
        inside = (x.float() / s).abs() <= 448
        assert torch.equal(kc[slots // 16, :, slots % 16][inside], ref[inside])


@pytest.mark.parametrize("hq,hkv,d", SHAPES)
@pytest.mark.parametrize("kv,mode", [("fp16", "auto"), ("bf16", "auto"), ("fp8_e4m3", "native"),
                                     ("fp8_e4m3", "software")])
def test_mixed_long_context(hq, hkv, d, kv, mode):
    _mixed_long_context(hq, hkv, d, kv, mode, [(3000, 1), (17, 1), (700, 300), (5000, 1),
                                               (0, 65), (1, 1)], hq + d)


@pytest.mark.parametrize("hq,hkv,d", SHAPES[:3])
@pytest.mark.parametrize("kv,mode", [("bf16", "auto"), ("fp8_e4m3", "native"),
                                     ("fp8_e4m3", "software")])
@pytest.mark.parametrize("window", [1000, 4096])
def test_sliding_window_long_context(hq, hkv, d, kv, mode, window):
    """Sliding-window layers at real shapes over the default launches (split-K over the
    window's tiles, the word / byte / 16-bit routes, prefill tiles); cached positions no
    query sees are poisoned, so reading one shows as NaN."""
    _mixed_long_context(hq, hkv, d, kv, mode, [(3000, 1), (17, 1), (700, 300), (5000, 1),
                                               (0, 65), (9000, 1), (4000, 200)],
                        hq + d + window, window)


def _mixed_long_context(hq, hkv, d, kv, mode, seqs, seed, window=None):
    dtype = torch.bfloat16 if kv == "bf16" else torch.float16
    case = make_case(seqs, hq, hkv, d, kv_dtype=kv, dtype=dtype, pad_rows=5, device="cuda",
                     seed=seed, window=window)
    twin = twin_output(case)
    out = case.out_buffer()
    TritonBackend(mode).forward(case.q, case.k, case.v, case.cache, case.meta,
                                case.softmax_scale, out)
    n = case.meta.num_tokens
    assert (out[n:] == SENTINEL).all() and torch.isfinite(out[:n]).all()
    tol = 2e-2 if kv == "bf16" else 5e-3
    assert _err(out[:n], twin[:n]) < tol
    assert _err(out[:n], dense_expected(case)) < tol


@pytest.mark.parametrize("hq,hkv,d", SHAPES[:3])
def test_decode_routes_agree(hq, hkv, d):
    """grouped/plain x split/no-split x native/software agree on one long-context batch."""
    case = make_case([(20000, 1), (333, 1), (8191, 1)], hq, hkv, d, kv_dtype="fp8_e4m3",
                     device="cuda", seed=1)
    m, c = case.meta, case.cache
    store_kv(case.k, case.v, c.k_cache, c.v_cache, m.slot_mapping, c.k_scale, c.v_scale)
    exp = dense_expected(case)
    outs = {}
    for grouped in (True, False):
        for splits in (1, None):
            for mode in ("native", "software"):
                out = case.out_buffer()
                paged_decode(case.q, c.k_cache, c.v_cache, out, m.block_tables, m.seq_lens,
                             m.query_start_loc, case.softmax_scale, m.max_seq_len, c.k_scale,
                             c.v_scale, fp8_mode=mode, grouped=grouped, num_splits=splits)
                assert _err(out, exp) < 5e-3, (grouped, splits, mode)
                outs[(grouped, splits, mode)] = out
    for g in (True, False):
        for s in (1, None):
            assert _err(outs[(g, s, "software")], outs[(g, s, "native")]) < 1e-3


def _long_context_case(hq, hkv, d, dtype, seed):
    """Three decode rows (20K, 333 and 8,191 cached tokens) in an E4M3 cache written by
    store_kv, their dense float64 expectation and the tolerance for `dtype` queries."""
    case = make_case([(20000, 1), (333, 1), (8191, 1)], hq, hkv, d, kv_dtype="fp8_e4m3",
                     dtype=dtype, device="cuda", seed=seed)
    m, c = case.meta, case.cache
    store_kv(case.k, case.v, c.k_cache, c.v_cache, m.slot_mapping, c.k_scale, c.v_scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    return case, m, c, dense_expected(case), tol


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (24, 4, 256), (9, 3, 64)])
@pytest.mark.parametrize("mode", ["native", "software"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_word_route_long_context(hq, hkv, d, mode, dtype):
    """The E4M3 word route (compiled: the four-result PTX) against a dense float64 computation
    and the byte route, with and without split-K."""
    case, m, c, exp, tol = _long_context_case(hq, hkv, d, dtype, seed=d)
    for splits in (1, None):
        outs = []
        for words in (True, False):
            out = case.out_buffer()
            paged_decode(case.q, c.k_cache, c.v_cache, out, m.block_tables, m.seq_lens,
                         m.query_start_loc, case.softmax_scale, m.max_seq_len, c.k_scale,
                         c.v_scale, fp8_mode=mode, num_splits=splits, words=words)
            assert _err(out, exp) < tol, (splits, words)
            outs.append(out)
        assert _err(outs[0], outs[1]) < tol / 4


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (24, 4, 256), (40, 8, 64)])
@pytest.mark.parametrize("mode", ["native", "software", "native-k", "native-v"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_word_pairs_bit_identical(hq, hkv, d, mode, dtype):
    """The word route converting byte pairs (pairs=True: bytes permuted before the conversion,
    each group's pair out as one f16x2 register) gives the four-result PTX's output bit for
    bit (same values, same dot order), split and unsplit, and matches float64."""
    case, m, c, exp, tol = _long_context_case(hq, hkv, d, dtype, seed=d + 2)
    for splits in (1, 7):
        outs = []
        for pairs in (False, True):
            out = case.out_buffer()
            paged_decode(case.q, c.k_cache, c.v_cache, out, m.block_tables, m.seq_lens,
                         m.query_start_loc, case.softmax_scale, m.max_seq_len, c.k_scale,
                         c.v_scale, fp8_mode=mode, num_splits=splits, words=True, pairs=pairs)
            assert _err(out, exp) < tol, (splits, pairs)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), splits


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (24, 4, 256), (9, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_decoders_bit_identical(hq, hkv, d, dtype):
    """K and V on different E4M3 decoders (compiled PTX) give the all-native output bit for
    bit, split and unsplit, and match a dense float64 computation."""
    case, m, c, exp, tol = _long_context_case(hq, hkv, d, dtype, seed=d + 1)
    for splits in (1, None):
        outs = {}
        for mode in ("native", "native-k", "native-v"):
            out = case.out_buffer()
            paged_decode(case.q, c.k_cache, c.v_cache, out, m.block_tables, m.seq_lens,
                         m.query_start_loc, case.softmax_scale, m.max_seq_len, c.k_scale,
                         c.v_scale, fp8_mode=mode, num_splits=splits)
            assert _err(out, exp) < tol, (splits, mode)
            outs[mode] = out
        assert torch.equal(outs["native-k"], outs["native"])
        assert torch.equal(outs["native-v"], outs["native"])


@pytest.mark.parametrize("software", [False, True])
def test_conversion_exact_all_codes(software):
    """convert_tile's inline PTX (native cvt.rn.f16x2.e4m3x2 and the packed software decoder,
    each in the pure and the opaque form) maps all 256 E4M3 codes exactly as torch's
    float8_e4m3fn does (software: times 2^-8). NaN codes: NaN natively; the software decoder
    gives +-480 * 2^-8 (the encoder never writes them)."""
    import triton
    import triton.language as tl

    from kvcap.kernels.common import convert_tile

    @triton.jit
    def _convert(src, dst16, dstbf, SOFTWARE: tl.constexpr, OPAQUE: tl.constexpr):
        i = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
        x = tl.load(src + i)
        tl.store(dst16 + i, convert_tile(x, True, SOFTWARE, tl.float16, OPAQUE))
        tl.store(dstbf + i, convert_tile(x, True, SOFTWARE, tl.bfloat16, OPAQUE))

    codes = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    nan = want.isnan()
    if software:
        want = want / 256
        want[nan] = torch.where(codes[nan] >= 128, -480.0, 480.0) / 256
        nan = torch.zeros_like(nan)
    for opaque in (False, True):
        h = torch.empty(256, dtype=torch.float16, device="cuda")
        b = torch.empty(256, dtype=torch.bfloat16, device="cuda")
        _convert[(1,)](codes, h, b, software, opaque)
        for got in (h.float(), b.float()):
            assert torch.equal(got.isnan(), nan)
            assert torch.equal(got[~nan], want[~nan])
            assert torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))


@pytest.mark.parametrize("mode", ["native", "software"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_register_cap_bit_identical(mode, dtype):
    """The E4M3 prefill default (on Hopper a register cap, prefill.PREFILL_E4M3_MAXNREG) gives
    the uncapped kernel's output bit for bit, and both match the torch twin and float64."""
    from kvcap.kernels.prefill import paged_prefill

    case = make_case([(3000, 700), (0, 300), (5000, 1), (1200, 65)], 32, 8, 128,
                     kv_dtype="fp8_e4m3", dtype=dtype, pad_rows=5, device="cuda", seed=21)
    c, m = case.cache, case.meta
    twin_cache = LayerKVCache(0, c.k_cache.clone(), c.v_cache.clone(), "fp8_e4m3", c.k_scale,
                              c.v_scale)
    twin = case.out_buffer()
    TorchReferenceBackend().forward(case.q, case.k, case.v, twin_cache, m, case.softmax_scale,
                                    twin)
    store_kv(case.k, case.v, c.k_cache, c.v_cache, m.slot_mapping, c.k_scale, c.v_scale)
    outs = []
    for knobs in ({}, {"maxnreg": 0}):  # the default launch, then the same tiles uncapped
        out = case.out_buffer()
        paged_prefill(case.q, c.k_cache, c.v_cache, out, m.block_tables, m.seq_lens,
                      m.query_start_loc, case.softmax_scale, m.max_query_len, c.k_scale,
                      c.v_scale, fp8_mode=mode, skip_decode=False, **knobs)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    n = m.num_tokens
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    assert _err(outs[0][:n], twin[:n]) < tol
    assert _err(outs[0][:n], dense_expected(case)) < tol


@pytest.mark.parametrize("kv,mode", [("bf16", "auto"), ("fp8_e4m3", "native"),
                                     ("fp8_e4m3", "software")])
def test_wide_call_default_launch(kv, mode):
    """64 decode rows of the 8B shape (512 (sequence, KV head) programs) over a 2K context class:
    the default launch (on the H200 the E4M3 word route's three-stage, one-split launch and the
    16-bit kernel's one-wave cap; docs/kernels.md, "Twenty-third change") against a dense float64
    computation and the launch before the change (5 stages / the uncapped split count)."""
    from kvcap.kernels.common import sm_count
    from kvcap.kernels.decode import choose_num_splits, decode_config, default_launch

    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(5)
    seqs = [(int(x), 1) for x in torch.randint(600, 1400, (64,), generator=g)]
    case = make_case(seqs, 32, 8, 128, kv_dtype=kv, dtype=dtype, device=DEVICE, seed=7)
    m, c = case.meta, case.cache
    fp8 = kv == "fp8_e4m3"
    store_kv(case.k, case.v, c.k_cache, c.v_cache, m.slot_mapping, c.k_scale, c.v_scale)
    exp = dense_expected(case)
    dev, cls = torch.device(DEVICE), 2048
    words, cfg, splits = default_launch(64, 8, cls, 128, fp8, dev)
    out = case.out_buffer()
    paged_decode(case.q, c.k_cache, c.v_cache, out, m.block_tables, m.seq_lens,
                 m.query_start_loc, case.softmax_scale, cls, c.k_scale if fp8 else None,
                 c.v_scale if fp8 else None, fp8_mode=mode if fp8 else "auto")
    n = m.num_tokens
    assert _err(out[:n], exp) < 2e-2
    old = decode_config(128, True, fp8, dev, words)  # without the call's size: the old launch
    old_splits = choose_num_splits(64, 8, cls, old.block_n, sm_count(dev), old.programs_per_sm,
                                   old.whole_waves, old.short_programs_per_sm)
    ref = case.out_buffer()
    knobs = dict(block_n=old.block_n, num_warps=old.num_warps, num_stages=old.num_stages,
                 maxnreg=old.maxnreg or 0, words=words, pairs=old.pairs) if fp8 else {}
    paged_decode(case.q, c.k_cache, c.v_cache, ref, m.block_tables, m.seq_lens,
                 m.query_start_loc, case.softmax_scale, cls, c.k_scale if fp8 else None,
                 c.v_scale if fp8 else None, fp8_mode=mode if fp8 else "auto",
                 num_splits=old_splits, **knobs)
    assert _err(out[:n], ref[:n]) < 5e-3
    if dev.type == "cuda" and torch.cuda.get_device_capability() == (9, 0) \
            and sm_count(dev) >= 128:
        assert splits == 1 and (not fp8 or cfg.num_stages == 3), (splits, cfg)


@pytest.mark.parametrize("mode", ["native", "software"])
@pytest.mark.parametrize("batch", [3, 16, 64])
def test_word_route_tiles_agree(monkeypatch, mode, batch):
    """The E4M3 word route's default launch in 64- and in 128-token tiles
    (KVCAP_WORD_ROUTE_TILE; 64 is the H100's default past 4K tokens, docs/kernels.md
    "Thirty-ninth change"), each with its own split rule, over a context class past 4K: both
    match a dense float64 computation, and each other."""
    from kvcap.kernels import decode

    g = torch.Generator().manual_seed(batch)
    seqs = [(int(x), 1) for x in torch.randint(300, 9000, (batch,), generator=g)]
    case = make_case(seqs, 32, 8, 128, kv_dtype="fp8_e4m3", dtype=torch.bfloat16,
                     device=DEVICE, seed=batch + 11)
    m, c = case.meta, case.cache
    store_kv(case.k, case.v, c.k_cache, c.v_cache, m.slot_mapping, c.k_scale, c.v_scale)
    exp, n, outs = dense_expected(case), m.num_tokens, []
    for tile in ("64", "128"):
        monkeypatch.setenv(decode.ENV_WORD_ROUTE_TILE, tile)
        cfg = decode.default_launch(batch, 8, 16384, 128, True, torch.device(DEVICE))[1]
        assert cfg.block_n == int(tile)
        out = case.out_buffer()
        paged_decode(case.q, c.k_cache, c.v_cache, out, m.block_tables, m.seq_lens,
                     m.query_start_loc, case.softmax_scale, 16384, c.k_scale, c.v_scale,
                     fp8_mode=mode)
        assert _err(out[:n], exp) < 2e-2, tile
        outs.append(out[:n])
    assert _err(outs[0], outs[1]) < 5e-3
