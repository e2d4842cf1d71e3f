"""Chunked-prefill (varlen) attention over the paged cache.

Each sequence's new tokens sit after its cached context (position ctx + j for new token j)
and attend to everything cached plus, causally, to each other (the store runs first, so the
new tokens are in the cache too). One program per (sequence, tile of BLOCK_Q new tokens,
KV head); its tl.dot rows are the BLOCK_Q tokens x the padded query group, so each KV tile is
loaded once for the whole group. Sequences with exactly one new token are skipped when the
decode kernel serves them (mixed batches: both kernels run, each over its own rows).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvcap.kernels.common import (
    FP_FUSION,
    LOG2E,
    capability,
    check_attention_args,
    dot_dtype,
    has_mma,
    one_decoder_software_fp8,
)
from kvcap.kernels.decode import attend_tiles, store_rows


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, ks_ptr, vs_ptr, sm_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ch, stride_ct, bt_stride,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, SOFTWARE: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
    SKIP_DECODE: tl.constexpr, USE_DOT: tl.constexpr, PREFETCH: tl.constexpr,
    WINDOW: tl.constexpr = 0,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    qlen = tl.load(qsl_ptr + seq + 1) - q_start
    if SKIP_DECODE and qlen == 1:
        return
    if tile * BLOCK_Q >= qlen:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - qlen
    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    tok = tile * BLOCK_Q + r // BLOCK_G
    g = r % BLOCK_G
    rmask = (tok < qlen) & (g < GROUP)
    head = kvh * GROUP + g
    qpos = ctx + tok
    kv_end = tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_Q)
    if WINDOW > 0:  # from the tile holding the first query's first visible position
        wlo = tl.maximum(ctx + tile * BLOCK_Q - WINDOW + 1, 0)
        kv_start = (wlo // BLOCK_N) * BLOCK_N
    else:
        wlo = 0
        kv_start = 0

    qk_scale = sm_scale
    out_scale = 1.0
    if FP8:
        qk_scale = qk_scale * tl.load(ks_ptr)
        out_scale = tl.load(vs_ptr)
    if SOFTWARE:
        qk_scale = qk_scale * 256.0
        out_scale = out_scale * 256.0
    qbase = q_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_qt + \
        head.to(tl.int64)[:, None] * stride_qh
    d = tl.arange(0, HEAD_DIM)[None, :]
    q = tl.load(qbase + d, mask=rmask[:, None], other=0.0).to(DOT_DTYPE)
    m_i, l_i, acc = attend_tiles(
        q, kc_ptr, vc_ptr, bt_ptr, bt_stride, seq, kv_start, kv_end, qk_scale,
        kvh.to(tl.int64) * stride_ch, stride_cb, stride_ct, qpos,
        BLOCK_Q * BLOCK_G, HEAD_DIM, BLOCK_SIZE, BLOCK_N, FP8, SOFTWARE, SOFTWARE, USE_DOT,
        DOT_DTYPE, IEEE, True, PREFETCH, False, wlo, WINDOW)
    inv = (out_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    obase = out_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_ot + \
        head.to(tl.int64)[:, None] * stride_oh
    store_rows(obase, rmask, acc * inv, HEAD_DIM)


class PrefillConfig(NamedTuple):
    """Launch configuration of the chunked-prefill kernel: `block_m` dot rows (tokens x padded
    query group), `block_n` tokens per KV tile, warps, pipeline stages and a register cap per
    thread (None: the compiler's choice)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None


# E4M3 prefill at D = 128 on Hopper (64 x 64 tiles, 4 warps): ptxas (triton 3.6, sm_90a) gives
# the tile loop 175-187 registers per thread with BF16 queries or the software decoder, so an
# SM holds 2 programs (65,536 registers) although its shared memory holds 4 (48 KiB each); with
# FP16 queries over the hardware conversion it takes 168 and an SM holds 3. Capped at 168 every
# E4M3 variant compiles with no spill on sm_90 and holds 3; on sm_80-89 (mma.sync) the same cap
# spills 212-232 bytes, and at D = 64 / 256 it spills too, so it applies to D = 128 from sm_90
# on only. The 16-bit cache's tile needs 80 KiB of shared memory, so shared memory, not
# registers, holds it at 2 programs per SM there.
PREFILL_E4M3_MAXNREG = 168

# CUDA caps a grid's y axis, the query tiles of a chunk, at 65,535 programs. Without MMA at
# D = 256 a GQA-6 tile holds 2 tokens (16 rows / 8 padded heads: the reference model's shape on
# a V100), so a 128K-token chunk made 65,536 tiles and its launch failed ("invalid argument");
# 64-row tiles at GQA 64 fail past 65,535 tokens. Such chunks take taller tiles (more tokens a
# program; a compile of its own) until they fit; every other launch keeps its configuration.
MAX_GRID_Y = 65535


def prefill_config(head_dim: int, group: int, device: torch.device, fp8: bool = False,
                   mma: bool | None = None) -> PrefillConfig:
    """The launch configuration for this head size, cache (`fp8`: E4M3) and GPU (`mma`: the GPU
    has Triton's tensor-core dots, default: has_mma). Without them (V100, T4) the MMA tiles
    spill 0.6-35 KB per thread (ptxas, triton 3.6), so those GPUs take 32 x 16 tiles (16 x 16
    at D = 256), which compile without spills for FP16 and E4M3 — chosen from the compiler's
    output, not measured."""
    if device.type != "cuda":
        return PrefillConfig(16, 16, 1, 1)
    if not (has_mma(device) if mma is None else mma):
        return PrefillConfig(32 if head_dim <= 128 else 16, 16, 4, 2)
    if head_dim <= 64:
        return PrefillConfig(128, 64, 4, 2)
    if head_dim <= 128:
        # H200, 8B shape, one 2048-token chunk after 0-14K cached tokens (scripts/
        # prefill_sweep.py, docs/benchmarks/prefill-2026-12-01-h200*.json): 64 x 64 tiles on
        # 4 warps took 0.64-0.75x the time of 128 x 32 on 8 warps (the default before) for the
        # 16-bit and both E4M3 caches, FP16 and BF16 queries. 128 x 64 on 4 warps was as fast at
        # 8K-16K (faster with BF16 queries over E4M3) but spills 120-632 bytes (ptxas sm_80-90),
        # and slower at 2K, where the grid is small; 64 x 64 spills none on sm_90, 16 bytes on
        # sm_80. E4M3 on Hopper: a register cap for a third program per SM (see
        # PREFILL_E4M3_MAXNREG).
        cap = PREFILL_E4M3_MAXNREG if fp8 and capability(device) >= (9, 0) else None
        return PrefillConfig(64, 64, 4, 2, cap)
    return PrefillConfig(64, 32, 4, 2)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, softmax_scale: float, max_query_len: int,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  fp8_mode: str = "auto", **knobs) -> torch.Tensor:
    """Causal varlen attention for sequences with more than one new token (with
    skip_decode=False, for every sequence). Shapes as in `paged_decode`; `max_query_len`
    (host int) sizes the grid and must be >= every sequence's query length. `knobs`:
    prefill_launcher's keyword arguments -- `skip_decode` (default True), and the launch knobs
    (`block_m` dot rows, `block_n` tokens per KV tile, `num_warps`, `num_stages`, `maxnreg`)
    override prefill_config's for benchmarks and tests; the default register cap belongs to the
    default tiles and is dropped when a knob is given without it (`maxnreg=0`: no cap)."""
    launch = prefill_launcher(q, k_cache, v_cache, out, block_tables, seq_lens,
                              query_start_loc, softmax_scale, max_query_len, k_scale, v_scale,
                              fp8_mode=fp8_mode, **knobs)
    if launch is not None:
        launch(q, k_cache, v_cache, out, k_scale, v_scale)
    return out


def prefill_launcher(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, softmax_scale: float, max_query_len: int,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     fp8_mode: str = "auto", skip_decode: bool = True,
                     block_m: int | None = None, block_n: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     maxnreg: int | None = None, window: int | None = None):
    """paged_prefill's host work done once (as decode.decode_launcher): returns
    `launch(q, k_cache, v_cache, out, k_scale, v_scale)` for tensors shaped, strided and typed
    as these, or None when there is nothing to launch. `window`: the layer's sliding window
    (LayerKVCache.window): query at position p sees only p - window + 1 .. p."""
    num_seqs = seq_lens.shape[0]
    hq, hkv, d, fp8 = check_attention_args(q, k_cache, v_cache, out, k_scale, v_scale, window)
    if num_seqs == 0 or max_query_len < 1:
        return None
    group = hq // hkv
    software = fp8 and one_decoder_software_fp8(q.device, fp8_mode)
    block_g = triton.next_power_of_2(group)
    cfg = prefill_config(d, group, q.device, fp8)
    knobs = (block_m, block_n, num_warps, num_stages)
    if maxnreg is None and all(k is None for k in knobs):
        maxnreg = cfg.maxnreg  # the cap belongs to the default launch configuration
    block_m, bn, nw, ns = (knob or default for knob, default in
                           zip(knobs, cfg[:4], strict=True))
    block_q = max(1, block_m // block_g)
    while triton.cdiv(max_query_len, block_q) > MAX_GRID_Y:  # see MAX_GRID_Y
        block_q *= 2
    dt, ieee = dot_dtype(q.dtype)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), hkv)
    scalars = (softmax_scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    consts = dict(
        GROUP=group, BLOCK_G=block_g, BLOCK_Q=block_q, HEAD_DIM=d,
        BLOCK_SIZE=k_cache.shape[2], BLOCK_N=bn, FP8=fp8, SOFTWARE=software,
        DOT_DTYPE=dt, IEEE=ieee, SKIP_DECODE=skip_decode,
        USE_DOT=True, PREFETCH=False, WINDOW=window or 0,
        num_warps=nw, num_stages=ns,
        **({"maxnreg": maxnreg} if maxnreg and q.device.type == "cuda" else {}),  # 0: no cap
    )

    def run(q, k_cache, v_cache, out, k_scale, v_scale) -> None:
        ks, vs = (k_scale, v_scale) if fp8 else (k_cache, k_cache)  # unused without FP8
        _prefill_kernel[grid](q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
                              ks, vs, *scalars, **consts, **FP_FUSION)

    return run
