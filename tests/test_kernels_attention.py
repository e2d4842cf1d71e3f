"""Decode (split-K, grouped, plain) and chunked-prefill kernels against the torch reference
backend (their twin) and an independent dense float64 computation.

On CPU these run under TRITON_INTERPRET=1 with small shapes; on a GPU the same tests run
compiled. Every case poisons unused cache memory with NaN / 0x7F bytes and uses distinct
non-unit k/v scales and random non-contiguous block tables.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_kernels_cases import (  # noqa: E402
    QUERY_DTYPE,
    SENTINEL,
    TOL,
    kernel_device,
    make_case,
    needs_kernels,
    rel_err,
    store_new_kv,
    twin_output,
)
from test_kernels_cases import check_output as _check  # noqa: E402
from test_kernels_cases import run_decode as _decode  # noqa: E402

from kvcap.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from kvcap.attention.triton_backend import TritonBackend  # noqa: E402
from kvcap.kernels import common  # noqa: E402
from kvcap.kernels import decode as decode_module  # noqa: E402
from kvcap.kernels.decode import (  # noqa: E402
    choose_num_splits,
    decode_config,
    paged_decode,
)
from kvcap.kernels.prefill import paged_prefill  # noqa: E402

DEV = kernel_device()
pytestmark = needs_kernels()

MIXED = [(0, 7), (20, 1), (13, 5), (33, 1), (0, 1), (16, 19)]
DECODE = [(40, 1), (3, 1), (70, 1), (15, 1)]
_DT = QUERY_DTYPE
_err = rel_err
_reference = twin_output


@pytest.mark.parametrize("kv_dtype,fp8_mode", [("fp16", "auto"), ("fp8_e4m3", "native"),
                                               ("fp8_e4m3", "software")])
@pytest.mark.parametrize("grouped,num_splits", [(True, 1), (True, 3), (False, 1), (False, 2)])
def test_decode_routes(kv_dtype, fp8_mode, grouped, num_splits):
    case = make_case(DECODE, 6, 1, 32, kv_dtype=kv_dtype, dtype=_DT[kv_dtype], pad_rows=2,
                     seed=7, device=DEV)
    twin = _reference(case)
    out = _decode(case, fp8_mode=fp8_mode, grouped=grouped, num_splits=num_splits)
    _check(case, out, kv_dtype, twin)


@pytest.mark.parametrize("kv_dtype,fp8_mode,words", [("fp16", "auto", False),
                                                     ("fp8_e4m3", "software", False),
                                                     ("fp8_e4m3", "native", True)])
@pytest.mark.parametrize("grouped", [True, False])
def test_folded_merge_equals_merge_kernel(kv_dtype, fp8_mode, words, grouped):
    """The split-K merge done by each (sequence, head program)'s last program gives the merge
    kernel's bits, call after call (its counters are back at zero), in a mixed batch."""
    if words and not grouped:
        pytest.skip("the word route is grouped only")
    kw = dict(fp8_mode=fp8_mode, grouped=grouped, num_splits=3, words=words or None)
    for seqs in (MIXED, DECODE):
        case = make_case(seqs, 8, 2, 64, kv_dtype=kv_dtype, dtype=_DT[kv_dtype], pad_rows=2,
                         seed=11, device=DEV)
        two = _decode(case, fold=False, **kw)
        for _ in range(2):
            one = _decode(case, fold=True, **kw)
            assert torch.equal(one, two)
        assert all(int(c.abs().sum()) == 0 for c in decode_module._COUNTERS.values())
    _check(case, one, kv_dtype)


@pytest.mark.parametrize("kv_dtype,fp8_mode,words,d", [("fp16", "auto", False, 64),
                                                       ("fp8_e4m3", "native", False, 64),
                                                       ("fp8_e4m3", "software", True, 128),
                                                       ("bf16", "auto", False, 256)])
def test_prewait_prefetch_changes_nothing(kv_dtype, fp8_mode, words, d):
    """paged_decode(prewait=True) -- each program's first tile located (sequence length, split
    bounds, block-table rows) ahead of the dependent-launch wait and prefetched into L2 -- gives
    the default's bits in a mixed batch with empty splits (the interpreter runs the location,
    not the PTX hint; the hint's place before the wait is a compile test)."""
    case = make_case(MIXED, 8, 2, d, kv_dtype=kv_dtype, dtype=_DT[kv_dtype], pad_rows=2,
                     seed=13, device=DEV)
    kw = dict(fp8_mode=fp8_mode, words=words or None, num_splits=6, block_n=16)
    assert torch.equal(_decode(case, prewait=True, **kw), _decode(case, **kw))


@pytest.mark.parametrize("kv_dtype,fp8_mode,words", [("fp16", "auto", False),
                                                     ("fp8_e4m3", "native", True)])
@pytest.mark.parametrize("fold", [False, True])
def test_empty_splits_are_neither_written_nor_read(monkeypatch, kv_dtype, fp8_mode, words, fold):
    """Sequences shorter than the split count's tiles leave the last splits empty (40 / 3 /
    70 / 15 tokens in 16-token tiles over 8 splits use 3 / 1 / 5 / 1): their programs exit
    and the merge stops at the last used split, so NaN-poisoned partial buffers do not reach
    the output, which equals the unsplit decode's."""
    real = decode_module.split_buffers

    def poisoned(*args):
        return tuple(t.fill_(float("nan")) for t in real(*args))
    monkeypatch.setattr(decode_module, "split_buffers", poisoned)
    case = make_case(DECODE, 8, 2, 64, kv_dtype=kv_dtype, dtype=_DT[kv_dtype], pad_rows=2,
                     seed=5, device=DEV)
    kw = dict(fp8_mode=fp8_mode, words=words or None, block_n=16)
    whole = _decode(case, num_splits=1, **kw)
    split = _decode(case, num_splits=8, fold=fold, **kw)
    _check(case, split, kv_dtype, whole)


@pytest.mark.parametrize("hq,hkv,d,bs", [(8, 8, 32, 16), (9, 3, 64, 32), (8, 1, 16, 16),
                                         (4, 2, 256, 16), (8, 2, 128, 64)])
def test_decode_shapes_fp8(hq, hkv, d, bs):
    case = make_case([(50, 1), (9, 1)], hq, hkv, d, block_size=bs, kv_dtype="fp8_e4m3",
                     seed=hq * d, device=DEV)
    out = _decode(case, num_splits=2)
    _check(case, out, "fp8_e4m3")


@pytest.mark.parametrize("fp8_mode", ["native", "software"])
@pytest.mark.parametrize("hq,hkv,d,num_splits", [(9, 3, 64, 1), (8, 2, 128, 3), (4, 1, 256, 2)])
def test_decode_word_route(fp8_mode, hq, hkv, d, num_splits):
    """The E4M3 word route (four column groups per 32-bit word) against the torch twin and a
    dense float64 computation, and against the byte route."""
    case = make_case([(50, 1), (9, 1), (130, 1)], hq, hkv, d, kv_dtype="fp8_e4m3", pad_rows=2,
                     seed=d + num_splits, device=DEV)
    twin = _reference(case)
    out = _decode(case, fp8_mode=fp8_mode, num_splits=num_splits, words=True)
    _check(case, out, "fp8_e4m3", twin)
    nt = case.meta.num_tokens
    bytes_route = _decode(case, fp8_mode=fp8_mode, num_splits=num_splits, words=False)
    assert _err(out[:nt], bytes_route[:nt]) < 1e-3


@pytest.mark.parametrize("fp8_mode,words,grouped,num_splits,hq,hkv,d,magnitude", [
    ("native", True, True, 3, 8, 2, 128, 1.0), ("software", True, True, 3, 8, 2, 128, 1.0),
    ("native", True, True, 3, 8, 2, 128, 3e5), ("software", True, True, 1, 8, 2, 128, 1e-6),
    ("native", False, True, 1, 9, 3, 64, 1.0), ("software", False, False, 2, 4, 2, 32, 3e5)])
def test_bf16_queries_fp16_dots(fp8_mode, words, grouped, num_splits, hq, hkv, d, magnitude):
    """BF16 queries over an E4M3 cache on the FP16 route's dots (the default): the query goes
    into FP16 under one power-of-two scale per program, so queries past FP16's range (3e5,
    whose scores are huge) or deep in its subnormals (1e-6) still give the BF16 dots' output
    to within BF16 rounding, the torch twin's, and the dense reference's."""
    case = make_case(DECODE, hq, hkv, d, kv_dtype="fp8_e4m3", dtype=torch.bfloat16, pad_rows=2,
                     seed=d + num_splits, device=DEV)
    case.q.mul_(magnitude)
    kw = dict(fp8_mode=fp8_mode, words=words or None, grouped=grouped, num_splits=num_splits)
    fp16_dots = _decode(case, **kw)
    bf16_dots = _decode(case, fp16_dots=False, **kw)
    nt = case.meta.num_tokens
    assert _err(fp16_dots[:nt], bf16_dots[:nt]) < 1e-2
    _check(case, fp16_dots, "bf16", _reference(case))


def test_bf16_queries_mixed_decoders():
    """FP16 dots with K and V on different decoders give the all-native output bit for bit
    (the decoders' values are equal)."""
    case = make_case(DECODE, 8, 2, 128, kv_dtype="fp8_e4m3", dtype=torch.bfloat16, seed=5,
                     device=DEV)
    native = _decode(case, fp8_mode="native", num_splits=2)
    for mode in ("native-k", "native-v"):
        assert torch.equal(_decode(case, fp8_mode=mode, num_splits=2), native)


def test_fp16_dots_switch(monkeypatch):
    """KVCAP_DISABLE_FP16_DOTS=1 rolls BF16 queries back to BF16 dots (the same bits as
    fp16_dots=False), through the backend too."""
    case = make_case(DECODE, 8, 2, 128, kv_dtype="fp8_e4m3", dtype=torch.bfloat16, seed=9,
                     device=DEV)
    bf16_dots = _decode(case, fp16_dots=False, num_splits=2)
    monkeypatch.setenv(common.ENV_DISABLE_FP16_DOTS, "1")
    assert torch.equal(_decode(case, num_splits=2), bf16_dots)
    out = case.out_buffer()
    TritonBackend("auto").forward(case.q, case.k, case.v, case.cache, case.meta,
                                  case.softmax_scale, out)
    _check(case, out, "bf16", _reference(case))


def test_fp16_dots_needs_bf16_queries_and_e4m3():
    case = make_case(DECODE, 4, 1, 32, kv_dtype="fp8_e4m3", dtype=torch.float16, seed=3,
                     device=DEV)
    with pytest.raises(ValueError, match="fp16_dots=True"):
        _decode(case, fp16_dots=True)


def test_word_route_switch(monkeypatch):
    from kvcap.kernels.decode import use_words
    dev = torch.device(DEV)
    assert use_words(128, True, True, dev) and use_words(256, True, True, dev)
    assert not use_words(64, True, True, dev)
    assert not use_words(128, False, True, dev) and not use_words(128, True, False, dev)
    monkeypatch.setenv("KVCAP_DISABLE_WORD_DECODE", "1")
    assert not use_words(128, True, True, dev) and not use_words(256, True, True, dev)


def test_decode_word_route_refuses_what_it_cannot_do():
    case = make_case([(20, 1)], 4, 2, 32, kv_dtype="fp8_e4m3", device=DEV)
    with pytest.raises(ValueError, match="words=True needs"):
        _decode(case, words=True)
    case = make_case([(20, 1)], 4, 2, 64, kv_dtype="fp16", device=DEV)
    with pytest.raises(ValueError, match="words=True needs"):
        _decode(case, words=True)


@pytest.mark.parametrize("fp8_mode", ["native-k", "native-v"])
@pytest.mark.parametrize("hq,hkv,d,words", [(8, 2, 128, True), (8, 2, 128, False),
                                            (9, 3, 64, False)])
def test_mixed_decoders_equal_native(fp8_mode, hq, hkv, d, words):
    """K and V decoded by different E4M3 decoders (the 2^8 of the software one folded into
    only its own scale) give the native result, split and unsplit, and match the twin."""
    case = make_case([(50, 1), (9, 1), (130, 1)], hq, hkv, d, kv_dtype="fp8_e4m3", pad_rows=2,
                     seed=d + hq, device=DEV)
    twin = _reference(case)
    nt = case.meta.num_tokens
    for splits in (1, 3):
        native = _decode(case, fp8_mode="native", num_splits=splits, words=words)
        out = _decode(case, fp8_mode=fp8_mode, num_splits=splits, words=words)
        _check(case, out, "fp8_e4m3", twin)
        assert _err(out[:nt], native[:nt]) < 1e-3


def test_software_equals_native():
    """Both decoders are exact, so the only difference is the 2^8 moved into the scales."""
    case = make_case(DECODE, 8, 2, 64, kv_dtype="fp8_e4m3", seed=3, device=DEV)
    a = _decode(case, fp8_mode="native", num_splits=2)
    b = _decode(case, fp8_mode="software", num_splits=2)
    assert _err(b[:4], a[:4]) < 1e-3


@pytest.mark.parametrize("kv_dtype,fp8_mode", [("fp16", "auto"), ("bf16", "auto"),
                                               ("fp32", "auto"), ("fp8_e4m3", "native"),
                                               ("fp8_e4m3", "software")])
def test_mixed_batch_backend(kv_dtype, fp8_mode):
    case = make_case(MIXED, 9, 3, 64, kv_dtype=kv_dtype, dtype=_DT[kv_dtype], pad_rows=3,
                     seed=11, device=DEV)
    twin = _reference(case)
    out = case.out_buffer()
    TritonBackend(fp8_mode).forward(case.q, case.k, case.v, case.cache, case.meta,
                                    case.softmax_scale, out)
    _check(case, out, kv_dtype, twin)


@pytest.mark.parametrize("hq,hkv,d", [(12, 2, 32), (8, 8, 16)])
def test_prefill_serves_decode_rows_too(hq, hkv, d):
    """skip_decode=False: the prefill kernel alone handles a mixed batch."""
    case = make_case(MIXED[:4], hq, hkv, d, kv_dtype="fp8_e4m3", seed=5, device=DEV)
    store_new_kv(case)
    m, out = case.meta, case.out_buffer()
    paged_prefill(case.q, case.cache.k_cache, case.cache.v_cache, out, m.block_tables,
                  m.seq_lens, m.query_start_loc, case.softmax_scale, m.max_query_len,
                  case.cache.k_scale, case.cache.v_scale, skip_decode=False)
    _check(case, out, "fp8_e4m3")


@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8_e4m3"])
def test_large_block_index(kv_dtype):
    case = make_case([(40, 1), (7, 3)], 2, 1, 64, kv_dtype=kv_dtype, big_block_index=True,
                     seed=2, device=DEV)
    assert int(case.meta.block_tables.max()) * 16 * 64 > 2**31
    out = case.out_buffer()
    TritonBackend().forward(case.q, case.k, case.v, case.cache, case.meta, case.softmax_scale,
                            out)
    _check(case, out, kv_dtype)


@pytest.mark.parametrize("switch", [common.ENV_FORCE_SOFTWARE_FP8, common.ENV_DISABLE_GROUPED,
                                    common.ENV_DISABLE_SPLIT_K])
def test_rollback_switches(monkeypatch, switch):
    case = make_case(MIXED, 8, 2, 32, kv_dtype="fp8_e4m3", pad_rows=1, seed=13, device=DEV)
    twin = _reference(case)
    monkeypatch.setenv(switch, "1")
    dev = torch.device(DEV)
    if switch == common.ENV_FORCE_SOFTWARE_FP8:
        assert common.use_software_fp8(dev)
    elif switch == common.ENV_DISABLE_GROUPED:
        assert not common.grouped_enabled()
    else:
        assert choose_num_splits(1, 1, 100_000, 16, 132) == 1
    out = case.out_buffer()
    TritonBackend().forward(case.q, case.k, case.v, case.cache, case.meta, case.softmax_scale,
                            out)
    _check(case, out, "fp8_e4m3", twin)


def test_split_heuristic():
    # a small batch over a long context splits; a full GPU or a short context does not
    assert choose_num_splits(1, 8, 32768, 64, 132) > 8
    assert choose_num_splits(128, 8, 32768, 64, 132) == 1
    assert choose_num_splits(1, 8, 64, 64, 132) == 1
    assert choose_num_splits(1, 1, 10**6, 64, 132) <= 64
    # whole waves: 64 (sequence, head) programs on 132 SMs x 4 -> 8 splits (512 programs),
    # not 9 (576: a second wave of 48); 16 x 8 programs -> 4; 64 x 8 -> 1
    assert choose_num_splits(8, 8, 32768, 128, 132, 4, whole_waves=True) == 8
    assert choose_num_splits(8, 8, 32768, 128, 132, 4) == 9
    assert choose_num_splits(16, 8, 16384, 128, 132, 4, whole_waves=True) == 4
    assert choose_num_splits(64, 8, 16384, 128, 132, 4, whole_waves=True) == 1
    # past one wave: the fewest splits whose last wave is >= 85% full (512 programs, 396 slots)
    assert choose_num_splits(64, 8, 16384, 128, 132, 3, whole_waves=True) == 2
    assert choose_num_splits(8, 8, 32768, 128, 132, 3, whole_waves=True) == 6
    assert choose_num_splits(16, 8, 16384, 128, 132, 3, whole_waves=True) == 3
    assert choose_num_splits(64, 8, 256, 128, 132, 3, whole_waves=True) == 1  # too few tiles
    # a kernel that aims at 4 programs per SM but holds 5 (the 16-bit kernel): where the
    # unsplit grid fits one wave of 660, the split one does too (32 x 8 programs: 2 splits, not
    # 3 = 768; 64 x 8: 1, not 2); smaller grids keep the target's split count
    assert choose_num_splits(32, 8, 16384, 64, 132, 4) == 3
    assert choose_num_splits(32, 8, 16384, 64, 132, 4, resident=5) == 2
    assert choose_num_splits(64, 8, 2048, 64, 132, 4, False, 4, 5) == 1
    assert choose_num_splits(21, 8, 16384, 64, 132, 4, resident=5) == 3
    for b in (1, 8, 16, 20, 24):
        assert choose_num_splits(b, 8, 16384, 64, 132, 4, resident=5) == \
            choose_num_splits(b, 8, 16384, 64, 132, 4)
    assert choose_num_splits(128, 8, 16384, 64, 132, 4, resident=5) == 1


def test_split_heuristic_short_contexts():
    # the 4-tile rule gives 1 x 2K (8 KV heads, 128-token tiles) 4 splits; the short-context
    # rule splits to one tile per split while the grid stays under 2 programs per SM
    assert choose_num_splits(1, 8, 2048, 128, 132, 3, True) == 4
    assert choose_num_splits(1, 8, 2048, 128, 132, 3, True, 2) == 16
    assert choose_num_splits(4, 8, 2048, 128, 132, 3, True, 2) == 8  # 264 // 32 programs
    assert choose_num_splits(1, 8, 1024, 64, 132, 4, False, 4) == 16  # 16-bit, 64-token tiles
    # ... at most MAX_SHORT_SPLITS: a context class far above the sequences' lengths would
    # otherwise merge mostly empty splits
    assert choose_num_splits(1, 8, 8192, 64, 132, 4, False, 4) == 32  # the 4-tile rule's own
    assert choose_num_splits(1, 3, 4096, 128, 132, 4, False, 4) == 16
    # it never lowers the long-context choice nor splits past the grid's wave
    assert choose_num_splits(8, 8, 4096, 128, 132, 3, True, 2) == 6
    assert choose_num_splits(1, 8, 16384, 128, 132, 3, True, 2) == 32
    assert choose_num_splits(64, 8, 1024, 128, 132, 3, True, 2) == 2
    assert choose_num_splits(1, 8, 100, 128, 132, 3, True, 2) == 1  # one tile: no split


@pytest.mark.parametrize("mma", [True, False])
def test_decode_config_by_gpu(monkeypatch, mma):
    """sm_80+ (tensor-core dots): the E4M3 word route runs at D = 128 capped at 128 registers
    with the stages and residency word_route_launch gives, at D = 256 in 64-token tiles with
    word_route_d256_launch's cap and residency; other shapes run uncapped. Below sm_80 (FMA
    dots) every cache reads bytes in 32-token tiles (16 at D = 256), uncapped. The CPU
    interpreter keeps its own small tiles."""
    from kvcap.kernels import decode

    monkeypatch.setattr(decode, "word_route_launch", lambda props: (5, 3))
    monkeypatch.setattr(decode, "word_route_d256_launch", lambda props: (96, 7))
    monkeypatch.setattr(decode, "device_properties", lambda device: common.target_properties(90))
    monkeypatch.setattr(decode, "programs_per_sm", lambda props, *kernel: 5)
    monkeypatch.setattr(decode, "has_mma", lambda device: mma)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cfg = decode_config(128, True, True, cuda)
    assert decode.use_words(128, True, True, cuda) == mma
    if mma:
        assert (cfg.block_n, cfg.num_stages, cfg.maxnreg) == (128, 5, 128)
        assert cfg.programs_per_sm == 3 and cfg.whole_waves and cfg.pairs
        byte_route = decode_config(128, True, True, cuda, words=False)  # the rollback switch
        assert byte_route.maxnreg is None and not byte_route.whole_waves
        d256 = decode_config(256, True, True, cuda)
        assert (d256.block_n, d256.num_stages, d256.maxnreg, d256.programs_per_sm) == \
            (64, 3, 96, 7) and d256.whole_waves and d256.pairs
        assert decode_config(256, True, True, cuda, words=False).maxnreg is None
        assert decode_config(128, True, False, cuda).resident == 5  # FP16 cache
    else:
        assert (cfg.block_n, cfg.maxnreg, cfg.pairs) == (32, None, False)
        assert decode_config(256, True, True, cuda).block_n == 16
        assert decode_config(256, True, True, cuda).maxnreg is None
        assert decode_config(128, True, False, cuda).block_n == 32  # FP16 cache
    assert decode_config(128, True, False, cuda).maxnreg is None  # FP16 cache
    assert decode_config(64, True, True, cuda).maxnreg is None
    assert decode_config(128, True, True, cpu).maxnreg is None


def test_short_calls_take_the_byte_route(monkeypatch):
    """E4M3 at D = 128 over a context class <= 2048 with at most one (sequence, KV head) per
    4 SMs reads bytes in 64-token tiles (H200: 0.86-1.00x the word route's time at B <= 4,
    1.02-1.40x at B >= 8); every other call keeps the word route."""
    from kvcap.kernels import decode

    monkeypatch.setattr(decode, "word_route_launch", lambda props: (5, 3))
    monkeypatch.setattr(decode, "word_route_d256_launch", lambda props: (128, 4))
    monkeypatch.setattr(decode, "device_properties", lambda device: common.target_properties(90))
    monkeypatch.setattr(decode, "programs_per_sm", lambda props, *kernel: 5)
    monkeypatch.setattr(decode, "has_mma", lambda device: True)
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    words, cfg, splits = decode.default_launch(4, 8, 2048, 128, True, cuda)
    assert not words and (cfg.block_n, cfg.num_stages, cfg.maxnreg) == (64, 2, None)
    assert splits == 16  # two 64-token tiles per split over 2K
    for b, ctx, d, fp8 in ((8, 2048, 128, True), (4, 2049, 128, True), (1, 1024, 64, True),
                           (1, 1024, 256, True)):
        assert decode.default_launch(b, 8, ctx, d, fp8, cuda)[0] == (d != 64), (b, ctx, d)
    assert not decode.default_launch(1, 8, 1024, 128, False, cuda)[0]  # 16-bit: no words
    assert not decode.short_byte_route(128, True, 1024, 34, 132)
    assert decode.short_byte_route(128, True, 1024, 33, 132)


def test_wide_short_calls(monkeypatch):
    """H200-like GPU (132 SMs; the word route holds 3 five-stage or 4 three-stage programs per
    SM, the 16-bit kernel 5): E4M3 calls with more (sequence, KV head) programs than 3 x 132
    but at most 4 x 132, over at most WIDE_WORD_ROUTE_TOKENS, take 3 stages and one split;
    longer, narrower or wider calls keep 5 stages. The 16-bit kernel's splits stay in one wave
    of its 5 resident programs per SM."""
    from kvcap.kernels import decode

    resident = {decode.WORD_ROUTE_SHARED_BYTES[3]: 4, decode.SIXTEEN_BIT_SHARED_BYTES[128]: 5}
    monkeypatch.setattr(decode, "word_route_launch", lambda props: (5, 3))
    monkeypatch.setattr(decode, "device_properties", lambda device: common.target_properties(90))
    monkeypatch.setattr(decode, "programs_per_sm", lambda props, smem, *rest: resident[smem])
    monkeypatch.setattr(decode, "has_mma", lambda device: True)
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    for ctx in (1152, 2048, decode.WIDE_WORD_ROUTE_TOKENS):
        words, cfg, splits = decode.default_launch(64, 8, ctx, 128, True, cuda)
        assert words and (cfg.num_stages, cfg.programs_per_sm, cfg.maxnreg, splits) == \
            (3, 4, 128, 1), ctx
    for b, ctx in ((64, 16384), (32, 2048), (67, 2048), (8, 2048)):
        words, cfg, splits = decode.default_launch(b, 8, ctx, 128, True, cuda)
        assert words and cfg.num_stages == 5, (b, ctx)
    assert decode.default_launch(64, 8, 16384, 128, True, cuda)[2] == 2
    assert decode.default_launch(32, 8, 16384, 128, False, cuda)[2] == 2
    assert decode.default_launch(64, 8, 2048, 128, False, cuda)[2] == 1
    assert decode.default_launch(8, 8, 16384, 128, False, cuda)[2] == 9


def test_sixteen_bit_d256_split_cap(monkeypatch):
    """At D = 256 the 16-bit kernel aims at 8 programs per SM; on a GPU whose SM holds 3 of
    them (the H200) a grid that fits one wave of 3 x 132 stays in it (GQA-6: 64 x 4 programs
    take 1 split, not 5; 32 x 4 take 3, not 9); a GPU holding fewer keeps the target's count."""
    from kvcap.kernels import decode

    monkeypatch.setattr(decode, "device_properties", lambda device: common.target_properties(90))
    monkeypatch.setattr(decode, "has_mma", lambda device: True)
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert decode.sixteen_bit_resident(common.target_properties(90), 256) == 3
    assert decode.sixteen_bit_resident(common.target_properties(80), 256) is None  # holds 2
    assert decode.decode_config(256, True, False, cuda).resident == 3
    for b, ctx, splits in ((64, 2048, 1), (64, 16384, 1), (32, 2048, 3), (32, 16384, 3),
                           (200, 16384, 2)):  # 800 programs: past one wave, the target's rule
        assert decode.default_launch(b, 4, ctx, 256, False, cuda)[2] == splits, (b, ctx)
    monkeypatch.setattr(decode, "device_properties", lambda device: common.target_properties(80))
    assert decode.decode_config(256, True, False, cuda).resident is None
    assert decode.default_launch(64, 4, 16384, 256, False, cuda)[2] == 5


def test_sixteen_bit_d64_split_cap(monkeypatch):
    """At D = 64 (the embedded model: 3 KV heads) the 16-bit kernel aims at 4 programs per SM
    and an H200 SM holds 5: a grid that fits one wave of 5 x 132 stays in it (80 sequences: 2
    splits, not 3; 132 and 150: 1, not 2), narrower calls keep the target's count."""
    from kvcap.kernels import decode

    monkeypatch.setattr(decode, "device_properties", lambda device: common.target_properties(90))
    monkeypatch.setattr(decode, "has_mma", lambda device: True)
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert decode.sixteen_bit_resident(common.target_properties(90), 64) == 5
    assert decode.sixteen_bit_resident(common.target_properties(80), 64) == 4
    assert decode.decode_config(64, True, False, cuda).resident == 5
    for b, splits in ((16, 11), (64, 3), (80, 2), (132, 1), (150, 1)):
        for ctx in (2048, 16384):
            assert decode.default_launch(b, 3, ctx, 64, False, cuda)[2] == splits, (b, ctx)


def test_e4m3_d64_five_stages_in_whole_waves(monkeypatch):
    """E4M3 at D = 64 (the embedded model): where an SM holds 4 five-stage programs (Hopper)
    the byte route double-buffers its K/V tiles and splits in whole waves of 4 x 132 (8 x 32K:
    22 splits, 16: 11, 64: 2); the A100 holds 2 and keeps the 2-stage launch at 8 programs per
    SM."""
    from kvcap.kernels import decode

    monkeypatch.setattr(decode, "has_mma", lambda device: True)
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    monkeypatch.setattr(decode, "device_properties", lambda device: common.target_properties(90))
    assert decode.byte_route_d64_launch(common.target_properties(90)) == (5, 4)
    cfg = decode.decode_config(64, True, True, cuda)
    assert (cfg.block_n, cfg.num_stages, cfg.programs_per_sm, cfg.whole_waves) == (128, 5, 4, True)
    for b, splits in ((8, 22), (16, 11), (64, 2)):
        assert decode.default_launch(b, 3, 32768, 64, True, cuda)[2] == splits, b
    assert decode.decode_config(128, True, True, cuda).num_stages == 5  # the word route's
    monkeypatch.setattr(decode, "device_properties", lambda device: common.target_properties(80))
    assert decode.byte_route_d64_launch(common.target_properties(80)) == (2, None)
    cfg = decode.decode_config(64, True, True, cuda)
    assert (cfg.num_stages, cfg.programs_per_sm, cfg.whole_waves) == (2, 8, False)


def test_short_route_default_is_the_byte_route(monkeypatch):
    """On the CPU interpreter (4 "SMs") one sequence over one KV head is a short call:
    paged_decode launches the byte route's configuration (recorded at decode_config) and
    agrees with the references; two sequences are not short and keep the word route."""
    if DEV == "cuda":
        pytest.skip("the CPU interpreter's SM count makes this call short")
    seen = []
    real = decode_module.decode_config

    def spy(*args, **kw):
        seen.append((args[4], kw.get("short_route")))
        return real(*args, **kw)
    monkeypatch.setattr(decode_module, "decode_config", spy)
    case = make_case([(30, 1)], 4, 1, 128, kv_dtype="fp8_e4m3", dtype=torch.float16,
                     pad_rows=2, seed=3, device=DEV)
    twin = _reference(case)
    out = _decode(case, num_splits=2)
    assert seen == [(False, True)]
    _check(case, out, "fp8_e4m3", twin)
    _decode(make_case([(30, 1), (20, 1)], 4, 1, 128, kv_dtype="fp8_e4m3",
                      dtype=torch.float16, seed=3, device=DEV))
    assert seen[-1] == (True, False)


def test_programs_per_sm():
    """Residency of the word-route program (41,472 B shared at 3 stages, 128 registers,
    4 warps): registers bound on Hopper, shared memory on A100 and on 100 KiB parts; a torch
    without the shared memory property falls back to the compute capability's figure."""
    from types import SimpleNamespace

    from kvcap.kernels.common import programs_per_sm
    from kvcap.kernels.decode import (
        WORD_ROUTE_SHARED_BYTES,
        word_route_d256_launch,
        word_route_launch,
    )

    smem = WORD_ROUTE_SHARED_BYTES[3]

    def props(major, minor, shared=None):
        p = SimpleNamespace(major=major, minor=minor, regs_per_multiprocessor=65536,
                            max_threads_per_multi_processor=2048)
        if shared is not None:
            p.shared_memory_per_multiprocessor = shared
        return p

    assert programs_per_sm(props(9, 0, 233472), smem, 128, 4) == 4  # H100 / H200
    assert programs_per_sm(props(9, 0), smem, 128, 4) == 4
    assert programs_per_sm(props(8, 0, 167936), smem, 128, 4) == 3  # A100
    assert programs_per_sm(props(8, 6, 102400), smem, 128, 4) == 2  # RTX 30xx
    assert programs_per_sm(props(8, 9), smem, 128, 4) == 2  # RTX 40xx / L4
    assert programs_per_sm(props(9, 0, 233472), smem, 168, 4) == 3  # uncapped
    # double-buffered K/V (5 stages) only where an SM still holds 3 programs
    assert word_route_launch(props(9, 0, 233472)) == (5, 3)
    assert word_route_launch(props(8, 0, 167936)) == (3, 3)
    assert word_route_launch(props(8, 6, 102400)) == (3, 2)
    # D = 256 (43,264 B): capped at 128 registers on Hopper (4 programs), uncapped (168) below
    assert word_route_d256_launch(props(9, 0, 233472)) == (128, 4)
    assert word_route_d256_launch(props(8, 0, 167936)) == (None, 3)  # A100
    assert word_route_d256_launch(props(8, 6, 102400)) == (None, 2)  # RTX 30xx


def test_bad_arguments():
    case = make_case([(5, 1)], 4, 2, 32, kv_dtype="fp8_e4m3", device=DEV)
    m = case.meta
    with pytest.raises(ValueError):
        paged_decode(case.q, case.cache.k_cache, case.cache.v_cache, case.out_buffer(),
                     m.block_tables, m.seq_lens, m.query_start_loc, 0.1, 6)
    with pytest.raises(ValueError):
        paged_decode(case.q[:, :3], case.cache.k_cache, case.cache.v_cache,
                     case.out_buffer()[:, :3], m.block_tables, m.seq_lens, m.query_start_loc,
                     0.1, 6, case.cache.k_scale, case.cache.v_scale)


@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8_e4m3"])
def test_backend_builds_a_steps_launchers_once_for_every_layer(monkeypatch, kv_dtype):
    """TritonBackend plans decode and prefill once per step (metadata) and shape and launches
    those plans in every layer: a second layer's cache (other values, E4M3: other scales) gets
    its own attention, as the twin computes it; a new step, or other shapes, plan again."""
    from kvcap.attention import triton_backend
    from kvcap.kv_cache.pool import LayerKVCache

    builds = []
    for name in ("decode_launcher", "prefill_launcher"):
        real = getattr(triton_backend, name)
        monkeypatch.setattr(triton_backend, name,
                            lambda *a, _real=real, _n=name, **k: builds.append(_n) or
                            _real(*a, **k))
    case = make_case(MIXED, 8, 2, 32, kv_dtype=kv_dtype, pad_rows=2, seed=21, device=DEV)
    c = case.cache
    fp8 = kv_dtype == "fp8_e4m3"
    other = LayerKVCache(
        1, c.k_cache.clone() if fp8 else c.k_cache * 0.5, c.v_cache.clone() if fp8 else
        c.v_cache * 1.5, kv_dtype, c.k_scale * 1.7 if fp8 else None,
        c.v_scale * 0.6 if fp8 else None)
    layers = [c, other, c]
    twins = []
    for cache in layers:  # the twin on copies, one layer at a time
        copy = LayerKVCache(0, cache.k_cache.clone(), cache.v_cache.clone(), kv_dtype,
                            cache.k_scale, cache.v_scale)
        out = case.out_buffer()
        TorchReferenceBackend().forward(case.q, case.k, case.v, copy, case.meta,
                                        case.softmax_scale, out)
        twins.append(out)
    be = TritonBackend()
    nt = case.meta.num_tokens
    for cache, twin in zip(layers, twins, strict=True):
        out = case.out_buffer()
        be.forward(case.q, case.k, case.v, cache, case.meta, case.softmax_scale, out)
        assert (out[nt:] == SENTINEL).all() and _err(out[:nt], twin[:nt]) < TOL[kv_dtype]
    assert sorted(builds) == ["decode_launcher", "prefill_launcher"]
    assert _err(twins[0][:nt], twins[1][:nt]) > 10 * TOL[kv_dtype]  # the layers differ
    be.attend_stored(case.q[:nt], c, case.meta, case.softmax_scale,
                     case.out_buffer()[:nt])  # other shapes: planned again
    assert len(builds) == 4
    # a CUDA graph capture never launches a plan built outside it (its split buffers), nor
    # an eager launch one built inside
    monkeypatch.setattr(triton_backend, "_capturing", lambda: True)
    be.attend_stored(case.q, c, case.meta, case.softmax_scale, case.out_buffer())
    be.attend_stored(case.q, other, case.meta, case.softmax_scale, case.out_buffer())
    assert len(builds) == 6
    monkeypatch.setattr(triton_backend, "_capturing", lambda: False)
    be.attend_stored(case.q, c, case.meta, case.softmax_scale, case.out_buffer())
    assert len(builds) == 8
    step = make_case(MIXED, 8, 2, 32, kv_dtype=kv_dtype, pad_rows=2, seed=21, device=DEV)
    be.forward(step.q, step.k, step.v, step.cache, step.meta, step.softmax_scale,
               step.out_buffer())  # a new step's metadata: planned again
    assert len(builds) == 10


def test_word_route_tiles_by_gpu(monkeypatch):
    """E4M3 word route at D = 128: 64-token tiles (5 stages, 4 resident programs per SM,
    splits aiming at 3) on the GPUs WORD_ROUTE_TILE_BY_GPU names, over calls longer than
    WIDE_WORD_ROUTE_TOKENS, except at more than one but at most three (sequence, KV head)
    programs per SM (32 sequences: 128-token tiles measured faster); 128-token tiles elsewhere;
    KVCAP_WORD_ROUTE_TILE forces either and refuses anything else. The split counts are the H100
    sweep's best: 6 / 3 / 1 at 8 / 16 / 64 sequences of 8 KV heads."""
    from types import SimpleNamespace

    from kvcap.kernels import decode

    gpu = {"name": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(decode, "device_properties", lambda device: SimpleNamespace(
        major=9, minor=0, name=gpu["name"], shared_memory_per_multiprocessor=233472,
        regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048))
    monkeypatch.setattr(decode, "has_mma", lambda device: True)
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    monkeypatch.delenv(decode.ENV_WORD_ROUTE_TILE, raising=False)
    cuda = torch.device("cuda")
    for b, ctx, splits in ((8, 16384, 6), (16, 16384, 3), (64, 16384, 1), (8, 32768, 6),
                           (16, 131072, 3), (64, 131072, 1)):
        words, cfg, n = decode.default_launch(b, 8, ctx, 128, True, cuda)
        assert words and (cfg.block_n, cfg.num_stages, cfg.maxnreg, cfg.resident) == \
            (64, 5, 128, 4), (b, ctx)
        assert n == splits, (b, ctx, n)
    for b in (17, 32, 49):  # 136-392 programs: more than one, at most three per SM
        assert decode.default_launch(b, 8, 16384, 128, True, cuda)[1].block_n == 128, b
    assert decode.default_launch(50, 8, 16384, 128, True, cuda)[1].block_n == 64
    short = decode.default_launch(64, 8, decode.WIDE_WORD_ROUTE_TOKENS, 128, True, cuda)
    assert short[1].block_n == 128 and short[1].num_stages == 3  # the wide short-call launch
    assert decode.default_launch(8, 8, 16384, 128, False, cuda)[1].block_n == 64  # 16-bit
    gpu["name"] = "NVIDIA H200"
    assert decode.default_launch(64, 8, 16384, 128, True, cuda)[1].block_n == 128
    monkeypatch.setenv(decode.ENV_WORD_ROUTE_TILE, "64")
    assert decode.default_launch(64, 8, 2048, 128, True, cuda)[1].block_n == 64
    gpu["name"] = "NVIDIA H100 80GB HBM3"
    monkeypatch.setenv(decode.ENV_WORD_ROUTE_TILE, "128")
    assert decode.default_launch(64, 8, 16384, 128, True, cuda)[1].block_n == 128
    monkeypatch.setenv(decode.ENV_WORD_ROUTE_TILE, "96")
    with pytest.raises(ValueError, match="KVCAP_WORD_ROUTE_TILE='96': expected 64 or 128"):
        decode.default_launch(64, 8, 16384, 128, True, cuda)


def test_word_route_64_token_residency():
    """The 64-token word-route program's shared memory leaves registers (128 per thread) as
    what bounds it: 4 programs per Hopper SM, as on the A100 (164 KiB) too."""
    from types import SimpleNamespace

    from kvcap.kernels.common import programs_per_sm
    from kvcap.kernels.decode import WORD_ROUTE_64_SHARED_BYTES

    def props(shared):
        return SimpleNamespace(major=9, minor=0, shared_memory_per_multiprocessor=shared,
                               regs_per_multiprocessor=65536,
                               max_threads_per_multi_processor=2048)

    assert programs_per_sm(props(233472), WORD_ROUTE_64_SHARED_BYTES, 128, 4) == 4
    assert programs_per_sm(props(167936), WORD_ROUTE_64_SHARED_BYTES, 128, 4) == 4
    assert programs_per_sm(props(102400), WORD_ROUTE_64_SHARED_BYTES, 128, 4) == 2
