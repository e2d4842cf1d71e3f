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
(94% of the read ceiling there) and 0.93x cuBLAS + the activation kernel on gate/up; QKV alone
took 1.02x cuBLAS's (2026-12-01) and comes here at <= 16 rows only so that a step's kernels
launch as programmatic dependents without a cuBLAS kernel between them (kernels.common
.pdl_launch; every kernel here waits with pdl_wait). Which linears the model routes here, up to
how many rows, is kvcap.models.decode_gemm's rule (docs/kernels.md, "Twentieth change",
"Twenty-second change").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcap.kernels.common import FP_FUSION, pdl_launch, pdl_mode, pdl_release, pdl_wait

MAX_ROWS = 64


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, k_split, stride_xm,
                        stride_wn, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        GDC: tl.constexpr = 0):
    pdl_wait(GDC)  # x comes from the kernel before (common.pdl_launch)
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
    yp = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    ymask = mmask[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=ymask)
    else:
        reduce_splits(acc, ws_ptr, cnt_ptr, pid, tl.program_id(1), yp, ymask, y_ptr, rn, nmask,
                      False, SPLIT_K, BLOCK_M, BLOCK_N)
    pdl_release(GDC)


@triton.jit
def reduce_splits(acc, ws_ptr, cnt_ptr, tile_id, split_id, yp, ymask, b_ptr, rn, nmask,
                  HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Deterministic split-K: each split stores its FP32 partial `acc` of output tile
    `tile_id`, counts itself in (after a barrier, acq_rel), and the last to arrive adds the
    partials in split order -- the same sum whatever the arrival order -- adds the bias
    b_ptr[rn] (HAS_BIAS), writes the tile to `yp` and resets the counter for the next call or
    graph replay. No workspace zeroing, no second kernel."""
    tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    ws = ws_ptr + tile_id.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
    tl.store(ws + split_id * (BLOCK_M * BLOCK_N) + tile, acc)
    tl.debug_barrier()
    prev = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
    tl.debug_barrier()
    if prev == SPLIT_K - 1:
        tl.store(cnt_ptr + tile_id, 0)
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in tl.static_range(SPLIT_K):
            total += tl.load(ws + s * (BLOCK_M * BLOCK_N) + tile, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(yp, total.to(yp.dtype.element_ty), mask=ymask)


@triton.jit
def _skinny_gemm_swiglu_kernel(x_ptr, w_ptr, y_ptr, M, INTER, K, stride_xm, stride_wn,
                               stride_ym,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                               GDC: tl.constexpr = 0):
    pdl_wait(GDC)
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
    gate = acc_g.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    y = (silu.to(tl.float32) * acc_u.to(dtype).to(tl.float32)).to(dtype)
    yp = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(yp, y, mask=mmask[:, None] & nmask[None, :])
    pdl_release(GDC)


def default_config(n: int, k: int, rows: int,
                   device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, split_k): the H200 sweeps' winners on the
    Llama-3.1-8B linears. Up to 32 rows (docs/benchmarks/gemm-2026-12-03-h200.json, 16 rows):
    wide matrices (the LM head) 64-column tiles, 3 stages; long K (down_proj) 256-wide K steps;
    square ones (o_proj) 5 stages and K split in two, so 256 programs fill the SMs instead of
    128; QKV (more columns than K) 5 stages, no split. Above 32 rows (the same file's 64-row
    cells; QKV from gemm-2026-12-01-h200.json) the 64-row activation tile doubles each stage:
    down_proj's 256-wide steps at 5 stages would need 240 KiB of shared memory (more than an
    SM has), and its winner is 64-column tiles, 128-wide steps, K split in two (35.0 us against
    cuBLAS's 36.0); o_proj's is no split, 8 stages (12.2 against 12.1); QKV's 64-column tiles
    (16.7 against 16.3)."""
    if device.type != "cuda":
        return 16, 32, 1, 1, 1
    if n >= 16384:
        return 64, 128, 4, 3, 1
    wide_rows = rows > 32
    if k >= 2 * n:
        return (64, 128, 4, 5, 2) if wide_rows else (32, 256, 4, 5, 1)
    if n > k:  # QKV: 192 tiles already fill the SMs (the 2026-12-01 sweep's best, no split)
        return (64 if wide_rows else 32), 128, 4, 5, 1
    return (32, 128, 4, 8, 1) if wide_rows else (32, 128, 4, 5, 2)


def pipeline_bytes(rows: int, block_n: int, block_k: int, num_stages: int,
                   itemsize: int = 2, weight_tiles: int = 1) -> int:
    """Shared memory the software pipeline holds: num_stages copies of the [BLOCK_M, BLOCK_K]
    activation tile and of `weight_tiles` [BLOCK_N, BLOCK_K] weight tiles (two for SwiGLU).
    Tests hold every default launch under an SM's limit with it."""
    block_m = max(16, triton.next_power_of_2(rows))
    return num_stages * block_k * itemsize * (block_m + weight_tiles * block_n)


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


def skinny_swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, out: torch.Tensor | None = None,
                  block_n: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= 64), w_gate_up [2I, K] (gate rows, then up rows) ->
    silu(x @ gate.T) * (x @ up.T) [M, I], one kernel."""
    _check_operands(x, w_gate_up, "skinny_swiglu")
    if w_gate_up.shape[0] % 2:
        raise ValueError(f"skinny_swiglu needs [gate; up] weights with an even row count, got "
                         f"{w_gate_up.shape[0]}")
    m, k = x.shape
    inter = w_gate_up.shape[0] // 2
    bn, bk, nw, ns = swiglu_config(m, x.device)
    bn, bk, nw, ns = block_n or bn, block_k or bk, num_warps or nw, num_stages or ns
    if out is None:
        out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    pdl = pdl_launch(x.device, m)
    grid = (triton.cdiv(inter, bn),)
    _skinny_gemm_swiglu_kernel[grid](
        x, w_gate_up, out, m, inter, k, x.stride(0), w_gate_up.stride(0), out.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk,
        EVEN_K=k % bk == 0, GDC=pdl_mode(pdl, grid, x.device), num_warps=nw,
        num_stages=ns, enable_fp_fusion=False, **pdl)
    return out


_SPLIT_STATE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def split_plan(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(columns per split, splits) for K split about `split_k` ways in whole BLOCK_K steps;
    fewer splits where the last would start past K."""
    k_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return k_split, triton.cdiv(k, k_split)


def split_state(device: torch.device, tiles: int, split_k: int, block_m: int,
                 block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP32 partials and the zeroed arrival counters of one split-K launch shape, kept per
    device and shape: allocated by the first (eager) call, so CUDA graphs capture a fixed
    address, and the counters are back at 0 after every call. Calls of one shape share them,
    so they must be ordered on one stream (a model's forward is). Never created during CUDA
    graph capture: the graph's private pool would own them, and their zeroing would only
    happen when the graph replays. Shared by the 16-bit and the FP8-weight (fp8_gemm) GEMMs."""
    key = (device, tiles, split_k, block_m, block_n)
    state = _SPLIT_STATE.get(key)
    if state is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"a split-K GEMM of {tiles} tiles x {split_k} splits runs "
                             "for the first time inside CUDA graph capture: make one call of "
                             "this shape before capturing")
        state = (torch.empty(tiles * split_k * block_m * block_n, dtype=torch.float32,
                             device=device),
                 torch.zeros(tiles, dtype=torch.int32, device=device))
        _SPLIT_STATE[key] = state
    return state


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                  block_n: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= 64), w [N, K] (row-major, K contiguous) -> x @ w.T [M, N]. `split_k` > 1
    splits K over that many programs per output tile (a deterministic in-kernel reduction)."""
    _check_operands(x, w, "skinny_linear")
    m, k = x.shape
    n = w.shape[0]
    bn, bk, nw, ns, sk = default_config(n, k, m, x.device)
    bn, bk, nw, ns = block_n or bn, block_k or bk, num_warps or nw, num_stages or ns
    sk = split_k or sk
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))
    tiles = triton.cdiv(n, bn)
    k_split, sk = split_plan(k, sk, bk)
    ws, cnt = (split_state(x.device, tiles, sk, block_m, bn) if sk > 1
               else (out, out))  # unused when SPLIT_K == 1
    pdl = pdl_launch(x.device, m)
    grid = (tiles, sk)
    _skinny_gemm_kernel[grid](
        x, w, out, ws, cnt, m, n, k, k_split, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0 and k_split % bk == 0,
        SPLIT_K=sk, GDC=pdl_mode(pdl, grid, x.device), num_warps=nw, num_stages=ns,
        **pdl, **FP_FUSION)
    return out
