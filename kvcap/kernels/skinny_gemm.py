"""Y = X @ W^T for the few rows of a decode step (M <= 64): a weight-streaming GEMM.

At decode batch sizes a linear layer reads its whole weight matrix to produce a handful of rows,
so it is a pure streaming read: one program per BLOCK_N weight rows walks the whole K axis in
BLOCK_K steps (software-pipelined loads, num_stages deep), multiplies the [BLOCK_M, BLOCK_K]
activation tile (M padded to the 16-row MMA minimum) with tl.dot and writes its [M, BLOCK_N]
output once. With `split_k` > 1 the K axis is split over that many programs per output tile and
reduced inside the kernel, deterministically (the last split to arrive adds the FP32 partials in
split order): more programs for square matrices, still no reduction kernel. X is tiny and stays
in L2. FP32 accumulation, FP16/BF16 in and out.

`skinny_swiglu` is the same loop over the fused gate/up weight ([gate; up], 2I rows) with
SiLU(gate) * up in the epilogue: each program reads the gate rows and the up rows of its BLOCK_N
output columns, so the [M, 2I] intermediate and the separate activation kernel disappear.
Rounding follows the unfused path exactly past the dots: gate and up are rounded to the model
dtype, SiLU is computed in FP32 and rounded, the product in FP32 and rounded (as
`fused_ops.silu_mul` and `F.silu(gate) * up` do).

On the H200 at 16 rows (docs/benchmarks/gemm-2026-12-03-h200.json, `python -m kvcap.bench.gemm`)
the defaults take 0.91-0.98x cuBLAS's time on the Llama-3.1-8B o_proj, down_proj and LM head
(94% of the read ceiling there) and 0.93x cuBLAS + the activation kernel on gate/up; QKV stays
on cuBLAS (no gain, 2026-12-01). Which linears the model routes here, up to how many rows, is
kvcap.models.decode_gemm's rule (docs/kernels.md, "Twentieth change").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_ROWS = 64


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, res_ptr, g_ptr, xn_ptr, ss_out_ptr,
                        ss_in_ptr, M, N, K, k_split, eps, ss_tiles, stride_xm, stride_wn,
                        stride_ym, stride_rm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        ROW_SCALE: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
                        NORM_OUT: tl.constexpr = False, SS_TILES: tl.constexpr = 1):
    pid = tl.program_id(0)
    k0 = tl.program_id(1) * k_split  # this program's K range: [k0, k0 + k_split) within K
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    xp = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :]
    wp = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :]
    k_end = tl.minimum(k0 + k_split, K)
    if ROW_SCALE:
        scale = _row_scale(ss_in_ptr, ss_tiles, K, eps, rm, BLOCK_M, SS_TILES)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(xp, mask=mmask[:, None], other=0.0)
            w = tl.load(wp, mask=nmask[:, None], other=0.0)
        else:
            kmask = (k + rk) < k_end
            x = tl.load(xp, mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(wp, mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
        xp += BLOCK_K
        wp += BLOCK_K
    if SPLIT_K > 1:
        # Deterministic split-K: each split stores its FP32 partial, counts itself in (after a
        # barrier, acq_rel), and the last to arrive adds the partials in split order -- the
        # same sum whatever the arrival order -- writes Y and resets the counter for the next
        # call or graph replay. No workspace zeroing, no second kernel.
        tile = rm[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        ws = ws_ptr + pid.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
        tl.store(ws + tl.program_id(1) * (BLOCK_M * BLOCK_N) + tile, acc)
        tl.debug_barrier()
        prev = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
        tl.debug_barrier()
        if prev != SPLIT_K - 1:
            return
        tl.store(cnt_ptr + pid, 0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(ws + s * (BLOCK_M * BLOCK_N) + tile, cache_modifier=".cg")
    if ROW_SCALE:
        acc = acc * scale[:, None]
    ymask = mmask[:, None] & nmask[None, :]
    dtype = y_ptr.dtype.element_ty
    y = acc.to(dtype)
    if RESIDUAL:  # the residual stream's add, rounded as fused_ops.add_rms_norm rounds it
        r = tl.load(res_ptr + rm[:, None].to(tl.int64) * stride_rm + rn[None, :], mask=ymask,
                    other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
    offs = rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y_ptr + offs, y, mask=ymask)
    if NORM_OUT:
        # The next RMSNorm's operands: y * its weight (the consumer GEMM's input) and this
        # tile's per-row sum of squares (the consumer adds the tiles' sums in tile order).
        yf = tl.where(ymask, y.to(tl.float32), 0.0)
        tl.store(ss_out_ptr + pid * BLOCK_M + rm, tl.sum(yf * yf, axis=1))
        g = tl.load(g_ptr + rn, mask=nmask, other=0.0)
        tl.store(xn_ptr + offs, (yf * g.to(tl.float32)[None, :]).to(dtype), mask=ymask)


@triton.jit
def _row_scale(ss_ptr, ss_tiles, K, eps, rm, BLOCK_M: tl.constexpr, SS_TILES: tl.constexpr):
    """rsqrt(mean of squares + eps) per row: the RMSNorm row scale of the GEMM's input, from
    the producer's per-tile sums of squares [ss_tiles, BLOCK_M]. A per-row factor commutes
    with the dot, so it multiplies the FP32 result instead of the input rows; it is read
    before the K loop, where its latency hides behind the first weight loads."""
    t = tl.arange(0, SS_TILES)
    parts = tl.load(ss_ptr + t[:, None] * BLOCK_M + rm[None, :], mask=t[:, None] < ss_tiles,
                    other=0.0)
    return tl.rsqrt(tl.sum(parts, axis=0) / K + eps)


@triton.jit
def _norm_operands_kernel(x_ptr, g_ptr, xn_ptr, ss_ptr, K, stride_xm, stride_om,
                          BLOCK: tl.constexpr):
    """One row: x * g (rounded to x's dtype) and the row's sum of squares, the operands a
    ROW_SCALE GEMM takes (for a stream no epilogue produced them: the embedding)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < K
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=m, other=0.0)
    xf = x.to(tl.float32)
    tl.store(ss_ptr + row, tl.sum(xf * xf, axis=0))
    g = tl.load(g_ptr + cols, mask=m, other=0.0)
    tl.store(xn_ptr + row.to(tl.int64) * stride_om + cols, (xf * g.to(tl.float32)).to(x.dtype),
             mask=m)


@triton.jit
def _skinny_gemm_swiglu_kernel(x_ptr, w_ptr, y_ptr, ss_ptr, M, INTER, K, eps, ss_tiles,
                               stride_xm, stride_wn, stride_ym,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                               ROW_SCALE: tl.constexpr = False, SS_TILES: tl.constexpr = 1):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < INTER
    xp = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    gp = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    up = w_ptr + (rn[:, None].to(tl.int64) + INTER) * stride_wn + rk[None, :]  # after gate rows
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if ROW_SCALE:
        scale = _row_scale(ss_ptr, ss_tiles, K, eps, rm, BLOCK_M, SS_TILES)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(xp, mask=mmask[:, None], other=0.0)
            g = tl.load(gp, mask=nmask[:, None], other=0.0)
            u = tl.load(up, mask=nmask[:, None], other=0.0)
        else:
            kmask = (k + rk) < K
            x = tl.load(xp, mask=mmask[:, None] & kmask[None, :], other=0.0)
            g = tl.load(gp, mask=nmask[:, None] & kmask[None, :], other=0.0)
            u = tl.load(up, mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc_g += tl.dot(x, tl.trans(g))
        acc_u += tl.dot(x, tl.trans(u))
        xp += BLOCK_K
        gp += BLOCK_K
        up += BLOCK_K
    dtype = y_ptr.dtype.element_ty
    # The unfused path's roundings: gate_up in the model dtype, F.silu rounded, product rounded.
    if ROW_SCALE:
        acc_g = acc_g * scale[:, None]
        acc_u = acc_u * scale[:, None]
    gate = acc_g.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    y = (silu.to(tl.float32) * acc_u.to(dtype).to(tl.float32)).to(dtype)
    yp = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(yp, y, mask=mmask[:, None] & nmask[None, :])


def default_config(n: int, k: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, split_k): the H200 sweep's winners at 16 rows
    on the Llama-3.1-8B linears (docs/benchmarks/gemm-2026-12-03-h200.json): wide matrices (the
    LM head) 64-column tiles, 3 stages; long K (down_proj) 256-wide K steps; square ones
    (o_proj) 5 stages and K split in two, so 256 programs fill the SMs instead of 128."""
    if device.type != "cuda":
        return 16, 32, 1, 1, 1
    if n >= 16384:
        return 64, 128, 4, 3, 1
    if k >= 2 * n:
        return 32, 256, 4, 5, 1
    return 32, 128, 4, 5, 2


def swiglu_config(rows: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for skinny_swiglu: the H200 sweep's winners on
    the 8B gate/up (docs/benchmarks/gemm-2026-12-03-h200*.json): 32 output columns (two
    32-row weight tiles per step) up to 16 rows, 64 above (at 32 rows 32 columns took 73 µs,
    64 columns 60)."""
    if device.type != "cuda":
        return 16, 32, 1, 1
    return (32 if rows <= 16 else 64), 128, 4, 3


def _check_operands(x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{what} needs x [M, K] and w [N, K]; got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{what} handles 1..{MAX_ROWS} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{what} needs x and w contiguous along K")
    if x.dtype != w.dtype:
        raise ValueError(f"x is {x.dtype} but w is {w.dtype}")


def _block_m(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


class RowNorm(NamedTuple):
    """An RMSNorm's operands for the GEMM that consumes it (ROW_SCALE): the GEMM's input is
    x * weight (rounded to the dtype) and `sums` [tiles, BLOCK_M] holds per-tile FP32 sums of
    squares of x's rows; the GEMM multiplies its FP32 result by rsqrt(sum / K + eps)."""
    sums: torch.Tensor
    eps: float


def _row_norm_args(rn: RowNorm | None, x: torch.Tensor, what: str) -> tuple:
    """(sums tensor or a stand-in, tiles, SS_TILES) for a launch over x's rows."""
    if rn is None:
        return x, 1, 1
    bm = _block_m(x.shape[0])
    sums = rn.sums
    if sums.dim() != 2 or sums.shape[1] != bm or sums.dtype != torch.float32 \
            or not sums.is_contiguous():
        raise ValueError(f"{what}'s row norm sums must be contiguous FP32 [tiles, {bm}] for "
                         f"{x.shape[0]} rows, got {tuple(sums.shape)} {sums.dtype}")
    return sums, sums.shape[0], triton.next_power_of_2(sums.shape[0])


def norm_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (M <= 64) -> (x * weight in x's dtype, sums of squares [1, BLOCK_M] FP32): the
    RMSNorm operands a ROW_SCALE GEMM takes, for a stream no GEMM epilogue produced."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.stride(1) != 1:
        raise ValueError(f"norm_operands needs x [1..{MAX_ROWS}, K] contiguous along K, got "
                         f"{tuple(x.shape)}")
    if weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"the norm weight must be a contiguous [{x.shape[1]}] vector, got "
                         f"{tuple(weight.shape)}")
    m, k = x.shape
    xn = torch.empty_like(x)
    sums = torch.zeros((1, _block_m(m)), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _norm_operands_kernel[(m,)](x, weight, xn, sums, k, x.stride(0), xn.stride(0), BLOCK=block,
                                num_warps=max(1, min(16, block // 256)) if x.is_cuda else 1,
                                enable_fp_fusion=False)
    return xn, sums


def skinny_swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, out: torch.Tensor | None = None,
                  block_n: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  row_norm: RowNorm | None = None) -> torch.Tensor:
    """x [M, K] (M <= 64), w_gate_up [2I, K] (gate rows, then up rows) ->
    silu(x @ gate.T) * (x @ up.T) [M, I], one kernel. With `row_norm`, x holds an RMSNorm's
    weighted rows and the dots are row-scaled before the activation (RowNorm)."""
    _check_operands(x, w_gate_up, "skinny_swiglu")
    if w_gate_up.shape[0] % 2:
        raise ValueError(f"skinny_swiglu needs [gate; up] weights with an even row count, got "
                         f"{w_gate_up.shape[0]}")
    m, k = x.shape
    inter = w_gate_up.shape[0] // 2
    sums, tiles, ss_tiles = _row_norm_args(row_norm, x, "skinny_swiglu")
    bn, bk, nw, ns = swiglu_config(m, x.device)
    bn, bk, nw, ns = block_n or bn, block_k or bk, num_warps or nw, num_stages or ns
    if out is None:
        out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    _skinny_gemm_swiglu_kernel[(triton.cdiv(inter, bn),)](
        x, w_gate_up, out, sums, m, inter, k, row_norm.eps if row_norm else 0.0, tiles,
        x.stride(0), w_gate_up.stride(0), out.stride(0),
        BLOCK_M=_block_m(m), BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        ROW_SCALE=row_norm is not None, SS_TILES=ss_tiles, num_warps=nw, num_stages=ns,
        enable_fp_fusion=False)
    return out


_SPLIT_STATE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_state(device: torch.device, tiles: int, split_k: int, block_m: int,
                 block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP32 partials and the zeroed arrival counters of one split-K launch shape, kept per
    device and shape: allocated by the first (eager) call, so CUDA graphs capture a fixed
    address, and the counters are back at 0 after every call. Calls of one shape share them,
    so they must be ordered on one stream (a model's forward is)."""
    key = (device, tiles, split_k, block_m, block_n)
    state = _SPLIT_STATE.get(key)
    if state is None:
        state = (torch.empty(tiles * split_k * block_m * block_n, dtype=torch.float32,
                             device=device),
                 torch.zeros(tiles, dtype=torch.int32, device=device))
        _SPLIT_STATE[key] = state
    return state


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                  block_n: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  split_k: int | None = None, row_norm: RowNorm | None = None,
                  residual: torch.Tensor | None = None,
                  next_norm_weight: torch.Tensor | None = None):
    """x [M, K] (M <= 64), w [N, K] (row-major, K contiguous) -> x @ w.T [M, N]. `split_k` > 1
    splits K over that many programs per output tile (a deterministic in-kernel reduction).

    A decoder layer's neighbours, folded in (kvcap.models.llama's folded decode steps):
    `row_norm` -- x holds an RMSNorm's weighted rows, the result is row-scaled (RowNorm);
    `residual` [M, N] -- added to the result, rounded as the residual stream's add is, so the
    output is the new stream; `next_norm_weight` [N] -- also returns the next RMSNorm's
    operands for its consumer: (out, out * weight, RowNorm sums [tiles, BLOCK_M])."""
    _check_operands(x, w, "skinny_linear")
    m, k = x.shape
    n = w.shape[0]
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1
                                 or residual.dtype != x.dtype):
        raise ValueError(f"skinny_linear's residual must be [{m}, {n}] {x.dtype}, contiguous "
                         f"along N; got {tuple(residual.shape)} {residual.dtype}")
    if next_norm_weight is not None and (next_norm_weight.shape != (n,)
                                         or not next_norm_weight.is_contiguous()):
        raise ValueError(f"skinny_linear's next_norm_weight must be a contiguous [{n}] vector, "
                         f"got {tuple(next_norm_weight.shape)}")
    sums_in, in_tiles, ss_tiles = _row_norm_args(row_norm, x, "skinny_linear")
    bn, bk, nw, ns, sk = default_config(n, k, x.device)
    bn, bk, nw, ns = block_n or bn, block_k or bk, num_warps or nw, num_stages or ns
    sk = split_k or sk
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = _block_m(m)
    tiles = triton.cdiv(n, bn)
    k_split = triton.cdiv(triton.cdiv(k, sk), bk) * bk  # whole BLOCK_K steps per split
    sk = triton.cdiv(k, k_split)  # a split never starts past K
    ws, cnt = (_split_state(x.device, tiles, sk, block_m, bn) if sk > 1
               else (out, out))  # unused when SPLIT_K == 1
    xn, sums_out = out, out  # unused without next_norm_weight
    if next_norm_weight is not None:
        xn = torch.empty_like(out)
        sums_out = torch.empty((tiles, block_m), dtype=torch.float32, device=x.device)
    res = out if residual is None else residual
    _skinny_gemm_kernel[(tiles, sk)](
        x, w, out, ws, cnt, res, out if next_norm_weight is None else next_norm_weight, xn,
        sums_out, sums_in, m, n, k, k_split, row_norm.eps if row_norm else 0.0, in_tiles,
        x.stride(0), w.stride(0), out.stride(0), res.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0 and k_split % bk == 0,
        SPLIT_K=sk, ROW_SCALE=row_norm is not None, RESIDUAL=residual is not None,
        NORM_OUT=next_norm_weight is not None, SS_TILES=ss_tiles, num_warps=nw, num_stages=ns,
        enable_fp_fusion=False)
    if next_norm_weight is not None:
        return out, xn, sums_out
    return out
