"""Y = X @ (W * S)^T with W kept in FP8 (E4M3) on the GPU: weight-only FP8 linears.

A checkpoint whose linear weights are E4M3 with FP32 scales (kvcap.models.fp8_weights) can stay
in one byte a weight on the GPU: half the memory of FP16/BF16 weights (more room for the KV
cache) and half the bytes a decode step streams. The scales come in groups: one per
ROW_BLOCK output rows x K_GROUP input columns (a whole row: per-tensor / per-channel formats;
128 x 128 blocks: transformers' fine-grained FP8). Activations stay FP16/BF16.

- `fp8_linear`: the streaming GEMM for up to MAX_ROWS rows (decode and small mixed steps).
  Each program walks K for its BLOCK_M x BLOCK_N output tile, loads the weight tile as bytes,
  decodes it to the activation dtype -- the hardware conversion on SM89+, the exact packed
  software decoder (kernels.common.convert_tile) below -- and multiplies on tensor cores with
  FP32 accumulation. The scale multiplies the FP32 dot, not the weight: once in the epilogue
  when a row has one scale, once per K step when the scales change along K (BLOCK_K divides
  K_GROUP, so a step sits in one group) -- or, on the swapped route below with scales along
  K where launch_config says (TILE_SCALES), on each step's decoded tile before its MMA,
  rounded to the activation dtype: the weights dequantize_into gives prefill. The software
  decoder yields value * 2^-8 exactly; the 2^8 is folded into the scale (exact: a power of
  two). With `swiglu` the MLP's [gate; up] weight runs as SiLU(gate) * up in the same kernel
  (each program walks its gate rows, then its up rows), rounding where the unfused path
  rounds: no [M, 2I] intermediate, no second kernel, nothing to break a decode step's chain
  of dependent launches. On Hopper above 32 rows, where the GEMM turns compute-bound, the
  operands swap (SWAP_AB; launch_config says where): weight rows become the warpgroup MMA's M
  and the decoded tile its register operand, so no tile goes back through shared memory and
  each is decoded once per BLOCK_M (up to 256) activation rows.
- `dequantize_into`: W * S rounded to the activation dtype, into a caller's buffer, for the
  large-M GEMMs (prefill chunks) that cuBLAS runs on the 16-bit weight -- there the GEMM is
  compute-bound and the extra write/read of the weight costs little. The bytes equal
  `(w.float() * s_full).to(dtype)`, the dequantize-at-load path's.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvcap.kernels.common import (
    _SHARED_PER_SM,
    convert_tile,
    device_properties,
    dot_dtype,
    pdl_launch,
    pdl_mode,
    pdl_release,
    pdl_wait,
    sm_count,
    use_software_fp8,
)
from kvcap.kernels.skinny_gemm import reduce_splits, split_plan, split_state

MAX_ROWS = 256
# The software decoder's results are the E4M3 value times 2^-8.
_SOFTWARE_FACTOR = 256.0


@triton.jit
def _scaled_dot(x_ptr, w_ptr, s_ptr, rm, mmask, rows, nmask, k0, k_end, stride_xm, stride_wn,
                stride_sn, scale_factor, ROW_BLOCK: tl.constexpr, K_GROUP: tl.constexpr,
                GROUPED_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SOFTWARE: tl.constexpr,
                DOT_DTYPE: tl.constexpr, SWAP_AB: tl.constexpr, TILE_SCALES: tl.constexpr):
    """FP32 x[rm, k0:k_end] @ (w[rows, k0:k_end] * s)^T, [BLOCK_M, BLOCK_N]: the K loop over
    E4M3 weight rows `rows`. Scales apply to this range's sum, so split-K partials add up to the
    whole product. SWAP_AB computes the transposed tile, (W * s) @ X^T, and returns it
    transposed back: weight rows are then the MMA's M and activation rows its N, so on Hopper
    the decoded weight tile is the warpgroup MMA's register operand -- no round trip through
    shared memory -- and one program decodes each weight tile once for all its BLOCK_M rows,
    where the unswapped tiles decode it once per 64 rows. With scales along K (GROUPED_K)
    each step's partial is scaled before it is added, or with TILE_SCALES (swapped only) the
    decoded tile takes them before its MMA, rounded as dequantize_into rounds them."""
    rk = tl.arange(0, BLOCK_K)
    xp = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :]
    wp = w_ptr + rows[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :]
    # each output column's scale row (its weight row's group of ROW_BLOCK rows)
    sp = s_ptr + (rows // ROW_BLOCK).to(tl.int64) * stride_sn
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(xp, mask=mmask[:, None], other=0.0)
            w = tl.load(wp, mask=nmask[:, None], other=0)
        else:
            kmask = (k + rk) < k_end
            x = tl.load(xp, mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(wp, mask=nmask[:, None] & kmask[None, :], other=0)
        x = x.to(DOT_DTYPE)
        if GROUPED_K and TILE_SCALES:
            # the step's scales on the decoded register tile, rounded once to the dot dtype:
            # the bytes dequantize_into gives (prefill's weights). Each step then accumulates
            # in the MMA as with one scale a row, instead of a scaled partial a step that
            # makes every warpgroup MMA wait for the one before
            s = tl.load(sp + k // K_GROUP, mask=nmask, other=0.0) * scale_factor
            v = convert_tile(w, True, SOFTWARE, tl.float32)
            acc += tl.dot((v * s[:, None]).to(DOT_DTYPE), tl.trans(x))
        else:
            wt = convert_tile(w, True, SOFTWARE, DOT_DTYPE)
            if GROUPED_K:
                s = tl.load(sp + k // K_GROUP, mask=nmask, other=0.0)
                if SWAP_AB:
                    acc += tl.dot(wt, tl.trans(x)) * s[:, None]
                else:
                    acc += tl.dot(x, tl.trans(wt)) * s[None, :]
            elif SWAP_AB:
                acc += tl.dot(wt, tl.trans(x))
            else:
                acc += tl.dot(x, tl.trans(wt))
        xp += BLOCK_K
        wp += BLOCK_K
    if GROUPED_K and TILE_SCALES:
        out = tl.trans(acc)  # scales and scale_factor are in the tiles
    elif SWAP_AB:
        if not GROUPED_K:
            acc = acc * tl.load(sp, mask=nmask, other=0.0)[:, None]
        out = tl.trans(acc * scale_factor)
    else:
        if not GROUPED_K:
            acc = acc * tl.load(sp, mask=nmask, other=0.0)[None, :]
        out = acc * scale_factor
    return out


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, k_split,
                     stride_xm, stride_wn, stride_sn, stride_ym, scale_factor,
                     ROW_BLOCK: tl.constexpr, K_GROUP: tl.constexpr, GROUPED_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     SOFTWARE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     SPLIT_K: tl.constexpr = 1, GDC: tl.constexpr = 0,
                     SWAP_AB: tl.constexpr = False, TILE_SCALES: tl.constexpr = False):
    """Y[:, rn] = X @ (W[rn] * S)^T (+ bias). SWIGLU: N is the intermediate size of a [gate; up]
    weight, and Y = SiLU(X @ gate^T) * (X @ up^T), rounded where the unfused path rounds
    (gate and up to the output dtype, SiLU rounded, the product rounded). SPLIT_K > 1: the
    grid's third axis splits K in ranges of k_split columns, reduced in the kernel as
    skinny_gemm reduces them (never with SWIGLU). SWAP_AB: _scaled_dot's transposed tile;
    TILE_SCALES: its scales along K on the decoded tiles."""
    pdl_wait(GDC)  # x comes from the kernel before (common.pdl_launch)
    # M is the fast grid axis: the programs that share a weight tile run side by side, so
    # the tile is read from memory once and from L2 by the others.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    if SPLIT_K == 1:
        k0 = 0
        k_end = K
    else:
        k0 = tl.program_id(2) * k_split
        k_end = tl.minimum(k0 + k_split, K)
    acc = _scaled_dot(x_ptr, w_ptr, s_ptr, rm, mmask, rn, nmask, k0, k_end, stride_xm,
                      stride_wn, stride_sn, scale_factor, ROW_BLOCK, K_GROUP, GROUPED_K,
                      BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SOFTWARE, DOT_DTYPE, SWAP_AB,
                      TILE_SCALES)
    dtype = y_ptr.dtype.element_ty
    yp = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    ymask = mmask[:, None] & nmask[None, :]
    if SWIGLU:
        up = _scaled_dot(x_ptr, w_ptr, s_ptr, rm, mmask, rn + N, nmask, k0, k_end, stride_xm,
                         stride_wn, stride_sn, scale_factor, ROW_BLOCK, K_GROUP, GROUPED_K,
                         BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SOFTWARE, DOT_DTYPE, SWAP_AB,
                         TILE_SCALES)
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        acc = silu.to(tl.float32) * up.to(dtype).to(tl.float32)
        tl.store(yp, acc.to(dtype), mask=ymask)
    elif SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(yp, acc.to(dtype), mask=ymask)
    else:
        # the bias once, on the sum
        reduce_splits(acc, ws_ptr, cnt_ptr, pid_n * tl.num_programs(0) + pid_m,
                      tl.program_id(2), yp, ymask, b_ptr, rn, nmask, HAS_BIAS, SPLIT_K,
                      BLOCK_M, BLOCK_N)
    pdl_release(GDC)


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                       scale_factor, ROW_BLOCK: tl.constexpr, K_GROUP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SOFTWARE: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :], mask=mask, other=0)
    s = tl.load(s_ptr + (rn // ROW_BLOCK)[:, None].to(tl.int64) * stride_sn
                + (rk // K_GROUP)[None, :], mask=mask, other=0.0)
    v = convert_tile(w, True, SOFTWARE, tl.float32)
    # v * (s * 2^8) == value * s exactly: the same FP32 product the torch dequantization rounds
    tl.store(out_ptr + rn[:, None].to(tl.int64) * stride_on + rk[None, :],
             (v * (s * scale_factor)).to(out_ptr.dtype.element_ty), mask=mask)


def check_operands(w: torch.Tensor, scale: torch.Tensor, row_block: int, k_group: int) -> None:
    """w: E4M3 (or its uint8 bytes) [N, K], K contiguous; scale: FP32 [ceil(N / row_block),
    ceil(K / k_group)]."""
    if w.dim() != 2 or w.dtype not in (torch.uint8, torch.float8_e4m3fn) or w.stride(1) != 1:
        raise ValueError(f"the FP8 weight must be E4M3 bytes [N, K], K contiguous; got "
                         f"{w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    want = (-(-n // row_block), -(-k // k_group))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want or scale.stride(1) != 1:
        raise ValueError(f"the scale of a {n} x {k} FP8 weight in {row_block} x {k_group} groups "
                         f"must be FP32 {want}; got {scale.dtype} {tuple(scale.shape)}")


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, swap_ab, tile_scales)
Launch = tuple[int, int, int, int, int, bool, bool]


def gemm_config(m: int, n: int, k_group: int, k: int, device: torch.device,
                swiglu: bool = False) -> Launch:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, swap_ab, tile_scales) of the launch
    for this shape on `device` (launch_config of its properties; the CPU interpreter takes small
    tiles). With `swiglu`, n is the intermediate size (each program reads 2 x BLOCK_N weight
    rows)."""
    if device.type != "cuda":
        bk = 32 if k_group >= k or k_group % 32 == 0 else 16
        return 16, 16, bk, 1, 1, False, False
    return launch_config(m, n, k_group, k, device_properties(device), sm_count(device), swiglu)


def gemm_split(m: int, n: int, launch: Launch, sms: int, swiglu: bool = False) -> int:
    """The default K split of `launch` (gemm_config's). Up to 32 rows: 2 where the
    output tiles do not give every SM two programs (the 8B QKV, o_proj and down_proj: 128-192
    tiles on 132 SMs), else 1. H100, `python -m kvcap.bench.fp8_gemm`
    (fp8-gemm-2026-12-06-h100-8b.json), 1 and 16 rows, us unsplit -> split in two: down_proj
    26.0-26.9 -> 23.8-24.5 with per-row scales and 36.2-39.4 -> 28.0-30.5 with 128 x 128
    blocks, QKV 12.2-13.7 -> 12.2-12.6 and 15.4-16.8 -> 13.5-14.4, o_proj 9.1-9.3 -> 8.9-9.5
    and 11.4-12.3 -> 10.6-11.3; the gate/up GEMM (448 tiles) lost (43 -> 58). The same at 17-32
    rows (fp8-gemm-2026-12-06b-h100-8b-mid.json, 32 rows, per-row / block scales): down_proj
    36.8 -> 32.6 / 54.8 -> 38.8, o_proj 12.3 -> 12.2 / 17.3 -> 14.4, QKV 17.8 -> 16.1 / 22.8 ->
    23.3. With the operands swapped (more rows, one program per 64 weight rows): 2 where the
    programs do not cover the SMs (64 rows: down_proj 71.0 -> 56.1 / 90.6 -> 44.9). Never with
    the fused SwiGLU; `sms` 0 (the CPU): 1."""
    bm, bn, swap = launch[0], launch[1], launch[5]
    if not sms or swiglu:
        return 1
    if swap:
        return _swapped_split(triton.cdiv(m, bm) * triton.cdiv(n, bn), sms)
    if m > 32:
        return 1
    return 2 if triton.cdiv(n, bn) < 2 * sms else 1


def _swapped_split(tiles: int, sms: int) -> int:
    """gemm_split of a swapped launch with `tiles` output tiles: 2 where they do not cover the
    SMs."""
    return 2 if tiles < sms else 1


ENV_FP8_SWIGLU = "KVCAP_FP8_SWIGLU"  # fused | unfused: swiglu_pays' answer on the GPU


def swiglu_pays(m: int, n: int, device: torch.device) -> bool:
    """Whether SiLU(gate) * up fused into the GEMM is the faster way to run m rows of an
    intermediate size n (KVCAP_FP8_SWIGLU=fused|unfused overrides it on the GPU, for A/B runs).
    On Hopper at decode rows (<= 16), and at 65-128 rows where the fused launch's 128 x 128
    tiles of gate and up (one program each, no K split) still cover two thirds of the SMs: there
    they beat the unfused GEMM plus the SiLU-and-multiply kernel (the 8B's 112 programs on 132
    SMs); at 17-64 and 129-256 rows the unfused pair was as fast or faster. H100, 8B gate/up,
    us unfused GEMM (its default launch, without the activation kernel) / fused
    (fp8-gemm-2026-12-06b-h100-8b-mid.json, -block-swiglu.json; 128 x 128 blocks at 64-256
    rows from the tile-scale sweep fp8-gemm-sweep-2026-12-06h-h100-8b-block-tile-scales.json
    and fp8-gemm-2026-12-06h-h100-8b-block-defaults.json): 32 rows 51.9 / 64.0 (per-row scales),
    49.9 / 80.3 (blocks); 64 rows 56.3 / 66.7, 66.8 / 69.5; 128 rows 93.2 / 89.4, 93.0 /
    91.2; 256 rows 170.8 / 182.3, 163.0 / 177.0. End to end at 128 x 1K, fused against
    unfused, arms alternating on one H100: +2.8% decode tok/s with per-row scales, +0.4% with
    blocks (throughput-2026-12-06i-h100-8b-fp8-swiglu-*.json). Elsewhere (unmeasured) fused,
    as before."""
    if device.type != "cuda":
        return True
    forced = os.environ.get(ENV_FP8_SWIGLU, "")
    if forced in ("fused", "unfused"):
        return forced == "fused"
    if forced:
        raise ValueError(f"{ENV_FP8_SWIGLU}={forced!r}: use 'fused' or 'unfused' (or unset it "
                         f"for the measured rule)")
    if m <= 16:
        return True
    props = device_properties(device)
    if (props.major, props.minor) < (9, 0):
        return True
    return 64 < m <= 128 and 3 * triton.cdiv(n, 128) >= 2 * sm_count(device)


def _swapped_tile(m: int, n: int, sms: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of a swapped launch with one scale a weight row
    and no SwiGLU: 128 weight rows a program in two warpgroups (64 each, the MMA's M), and the
    widest activation tile -- at most the rows, 256 -- whose programs, split in two along K
    where gemm_split says, still occupy two thirds of the SMs: each weight tile is decoded
    once per BLOCK_M rows, and fewer, fatter programs won wherever they filled the GPU. H100
    sweep, 8B linears, 64 / 128 / 256 rows (fp8-gemm-sweep-2026-12-06e-h100-8b-swap.json), us
    at this rule against the 64 x 64 / 128 x 64 tiles before it: QKV 20.9 / 28.9 / 41.2
    against 23.8 / 30.4 / 46.4, o_proj 19.5 / 20.8 / 28.9 against 19.9 / 25.6 / 30.7, gate/up
    - / 92.3 / 144.4 against - / 93.9 / 170.8, down_proj 55.0 / 56.9 / 72.9 against 57.0 /
    71.5 / 90.2. 256-row tiles take 64-wide K steps (128-wide ones spill) in 4 stages, the
    others 128-wide in 3."""
    def programs(bm: int) -> int:
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, 128)
        return tiles * _swapped_split(tiles, sms)

    bm = 64
    while bm < min(m, 256):
        bm *= 2
    while bm > 64 and 3 * programs(bm) < 2 * sms:
        bm //= 2
    return (bm, 128, 64, 8, 4) if bm == 256 else (bm, 128, 128, 8, 3)


def _swiglu_tile_scaled(m: int) -> tuple[int, int, int, int, int] | None:
    """The fused SwiGLU's swapped launch with scales along K above 64 rows: 128 weight rows of
    gate and of up a program in two warpgroups, each tile scaled as decoded (the partials'
    two-warpgroup form spilled: 157 us at 128 rows of the 8B gate/up; one warpgroup of 64 x 64
    took 135-140). H100, 8B gate/up, the sweep of 260a20b's scaled tiles
    (fp8-gemm-sweep-2026-12-06h-h100-8b-block-tile-scales.json): 91.2 / 177.0 us at 128 / 256
    rows, against 140.1 / 272.9 for the 64 x 64 partials."""
    return (128, 128, 128, 8, 3) if m > 64 else None


def _tile_scaled(m: int, n: int, sms: int) -> tuple[int, int, int, int, int] | None:
    """The swapped launch (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) with scales along K taken on
    each decoded tile (TILE_SCALES), or None for the one-warpgroup launch whose K steps scale
    their partials. Where the one-warpgroup tiles (64 weight rows, up to 128 activation rows)
    fill the SMs without a K split, the programs are bound by their K loop, and a partial
    scaled each step makes every warpgroup MMA wait for the one before; scaled tiles keep the
    MMAs chained: the activation rows rounded up to 128 / 256 a program, 128 weight rows in
    two warpgroups where those tiles still fill the SMs, else 64 in one (split in two by
    gemm_split). H100, 8B linears, us, this rule against the one-warpgroup launch
    (fp8-gemm-sweep-2026-12-06h-h100-8b-block-tile-scales.json against the same sweep of the
    partials, -06e-h100-8b-block.json): gate/up 92.8 / 169.6 against 104.4 / 199.5 at
    128 / 256 rows, QKV 45.7 against 51.3 at 256; where the tiles do not fill the SMs the
    partials stayed faster (o_proj 20.5 / 29.2 against 22.6 / 32.3 at the scaled tiles' best,
    down_proj 58.6 / 88.6 against 61.6 / 92.3 at 128 / 256 rows, QKV 28.8 against 29.3 at
    128)."""
    if m <= 64 or _swapped_split(triton.cdiv(m, 128) * triton.cdiv(n, 64), sms) > 1:
        return None
    bm = 128 if m <= 128 else 256
    if _swapped_split(triton.cdiv(m, bm) * triton.cdiv(n, 128), sms) == 1:
        return bm, 128, 64, 8, 4
    return bm, 64, 64, 4, 3


def launch_config(m: int, n: int, k_group: int, k: int, props, sms: int, swiglu: bool = False
                  ) -> Launch:
    """The launch on a GPU of `props` (compute capability, shared memory) with `sms` SMs.
    BLOCK_K divides the K group where the scales change along K. Decode rows (<= 32) stream
    the weight: 16-row tiles (the MMA minimum), 32 output columns unless 64 still give every
    SM two programs, and deep pipelines -- 256-byte K steps, or 128-byte ones in twice the
    stages where the scales change every 128 columns -- so that each SM keeps ~32 KB of weight
    in flight; on the H100 (with gemm_split's K split) these run the 8B linears at 1-16 rows
    1.52-1.74x faster than BF16 weights with per-row scales, 1.27-1.66x with 128 x 128 blocks
    (fp8-gemm-2026-12-06-h100-8b.json). On Hopper above 64 rows, and at 33-64 rows where 128
    weight rows a program would leave SMs idle (the 8B QKV, o_proj, down_proj), the operands
    are swapped (SWAP_AB): weight rows are the warpgroup MMA's M, their decoded tile a
    register operand, and the activation rows its N, so a weight tile is decoded once per
    BLOCK_M rows (_swapped_tile with per-row scales; with scales along K _tile_scaled's
    tile-scaled launch where it fills the SMs, and the fused SwiGLU's _swiglu_tile_scaled above
    64 rows; else 64 weight rows and up to 128 activation rows). H100 sweeps, 8B linears,
    per-row scales (fp8-gemm-sweep-2026-12-06b-h100-8b-swap.json, -06e-): at 256 rows 41 / 29
    / 144 / 73 us for QKV / o_proj / gate_up / down_proj against 68 / 35 / 259 / 121
    unswapped (fp8-gemm-2026-12-06-h100-8b.json); QKV at 64 rows 20.9 against 32.4.
    Elsewhere at 33-64 rows 128-byte K steps in 3 stages with 128 weight rows a step where that
    fills the SMs (the 8B gate/up: 58.1 us, swapped 66.9), else 32/64 columns in 4 stages.
    Without MMA (Volta, Turing: FMA dots) 32-wide K steps in two stages, which compile
    without spills there. `python -m kvcap.bench.fp8_gemm --sweep [all|swap]` measures the
    space."""
    bk = 256
    if k_group < k:
        while k_group % bk:
            bk //= 2
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = 2 if swiglu else 1  # weight tiles a program reads per K step
    cc = (props.major, props.minor)
    if cc < (8, 0):
        return bm, 32, min(bk, 32), 4, 2, False, False
    narrow = 64 if triton.cdiv(n, 64) >= 2 * sms else 32  # columns that still fill the SMs
    wide = triton.cdiv(n * tiles, 128) >= sms  # 128 weight rows a program still fill the SMs
    swap = cc >= (9, 0) and (m > 64 or (m > 32 and not wide))
    warps = 4
    scaled = swap and k_group < k and (_swiglu_tile_scaled(m) if swiglu
                                       else _tile_scaled(m, n, sms))
    if swap and not swiglu and k_group >= k:
        bm, bn, bk, warps, stages = _swapped_tile(m, n, sms)
    elif scaled:
        bm, bn, tile_k, warps, stages = scaled
        bk = min(bk, tile_k)  # still a divisor of the K groups (16- or 32-column ones)
    elif swap:
        # one warpgroup a program, 64 weight rows: where the scales change along K each step's
        # partial is scaled before it is added, and two or three such programs an SM beat
        # _swapped_tile's (H100, fp8-gemm-2026-12-06e-h100-8b-defaults.json and -sweep-block)
        bm, bn, bk, stages = (64, 64, min(bk, 128), 4) if m <= 64 else (128, 64, min(bk, 128), 3)
        if bm == 128 and swiglu:
            # two 64 x 128 accumulators spill in one warpgroup's registers: two warpgroups
            bn, warps = 128, 8
    elif m > 64:
        bn, bk, stages = 64, min(bk, 128), 4
    elif bm == 64:
        bk = min(bk, 128)
        bn, stages = (128 // tiles, 3) if wide else (narrow, 4)
    else:
        bn = narrow
        stages = max(2, min(8, (32 << 10) // (bn * bk)))
    # each stage holds an activation and the weight tiles in shared memory: stay within what
    # one program may have on this GPU (~100 KB on consumer parts, 164-228 KB on A100 / H100;
    # the swapped Hopper launches were measured up to the whole SM's)
    smem = getattr(props, "shared_memory_per_multiprocessor", 0) or _SHARED_PER_SM.get(
        cc, 100 << 10)
    per_stage = bm * bk * 2 + tiles * bn * bk
    stages = max(1, min(stages, (smem if swap else smem * 3 // 4) // per_stage))
    return bm, bn, bk, warps, stages, swap, bool(scaled)


def _as_bytes(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, row_block: int,
               k_group: int, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, fp8_mode: str = "auto",
               config: Launch | None = None,
               swiglu: bool = False, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] FP16/BF16 (M <= MAX_ROWS) @ (w * scale)^T (+ bias) -> [M, N] in x's dtype.
    `swiglu`: w is a [gate; up] weight [2I, K] and the result SiLU(x @ gate^T) * (x @ up^T)
    [M, I], in the same kernel. fp8_mode: "auto" (hardware conversion where the GPU has it),
    "native" or "software". `config`: a launch tuple (gemm_config's form) instead of its
    choice (sweeps, tests); its tile_scales (with swap_ab and scales along K) scales each
    decoded weight tile before its MMA instead of each K step's partial (_tile_scaled).
    `split_k` > 1 splits K over that many programs per output tile, in whole BLOCK_K steps,
    reduced deterministically inside the kernel (not with `swiglu`); None: gemm_split's
    choice with the default launch, 1 with a given `config`."""
    check_operands(w, scale, row_block, k_group)
    if x.dim() != 2 or x.shape[1] != w.shape[1] or x.stride(1) != 1:
        raise ValueError(f"fp8_linear needs x [M, {w.shape[1]}] contiguous along K; got "
                         f"{tuple(x.shape)}")
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"fp8_linear handles 1..{MAX_ROWS} rows, got {m}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"fp8_linear computes in FP16/BF16, got {x.dtype}")
    n = w.shape[0]
    if swiglu:
        if n % 2 or (n // 2) % row_block or bias is not None:
            raise ValueError(f"swiglu needs a bias-free [gate; up] weight whose up rows start on "
                             f"a {row_block}-row scale block; got {n} rows")
        n //= 2
    grouped = k_group < k
    if grouped and k_group % 16:
        raise ValueError(f"K groups of {k_group} columns: fp8_linear needs a multiple of 16")
    if config is not None and len(config) != 7:
        raise ValueError(f"config must be (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, "
                         f"swap_ab, tile_scales), gemm_config's form; got {config!r}")
    launch = config or gemm_config(m, n, k_group, k, x.device, swiglu)
    bm, bn, bk, nw, ns, swap, tile_scales = launch
    if tile_scales and not (swap and grouped):
        raise ValueError("tile_scales=True scales the swapped route's decoded tiles along K: it "
                         "needs swap_ab=True and scales that change along K")
    if split_k is None:
        sms = sm_count(x.device) if x.device.type == "cuda" else 0
        split_k = 1 if config else gemm_split(m, n, launch, sms, swiglu)
    if grouped and k_group % bk:
        raise ValueError(f"BLOCK_K {bk} does not divide the K groups of {k_group} columns")
    if split_k < 1 or (split_k > 1 and swiglu):
        raise ValueError(f"split_k must be >= 1, and 1 with swiglu; got {split_k}")
    software = use_software_fp8(x.device, fp8_mode)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_split, split_k = split_plan(k, split_k, bk)
    tiles = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    ws, cnt = (split_state(x.device, tiles[0] * tiles[1], split_k, bm, bn) if split_k > 1
               else (out, out))  # unused when SPLIT_K == 1
    pdl = pdl_launch(x.device, m)
    grid = tiles + (split_k,)
    _fp8_gemm_kernel[grid](
        x, _as_bytes(w), scale, bias if bias is not None else scale, out, ws, cnt, m, n, k,
        k_split, x.stride(0), w.stride(0), scale.stride(0), out.stride(0),
        _SOFTWARE_FACTOR if software else 1.0,
        ROW_BLOCK=row_block, K_GROUP=k_group if grouped else k, GROUPED_K=grouped,
        HAS_BIAS=bias is not None, SWIGLU=swiglu, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        EVEN_K=k % bk == 0, SOFTWARE=software, DOT_DTYPE=dot_dtype(x.dtype)[0],
        SPLIT_K=split_k, GDC=pdl_mode(pdl, grid, x.device), SWAP_AB=swap,
        TILE_SCALES=tile_scales, num_warps=nw, num_stages=ns, enable_fp_fusion=False, **pdl)
    return out


def dequantize_into(w: torch.Tensor, scale: torch.Tensor, row_block: int, k_group: int,
                    out: torch.Tensor, fp8_mode: str = "auto") -> torch.Tensor:
    """out [N, K] (FP16/BF16/FP32) <- w * scale, rounded once to out's dtype."""
    check_operands(w, scale, row_block, k_group)
    if tuple(out.shape) != tuple(w.shape) or out.stride(1) != 1:
        raise ValueError(f"dequantize_into needs out {tuple(w.shape)}, got {tuple(out.shape)}")
    n, k = w.shape
    software = use_software_fp8(w.device, fp8_mode)
    bn, bk = (32, 128) if w.device.type == "cuda" else (16, 32)
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _dequantize_kernel[grid](
        _as_bytes(w), scale, out, n, k, w.stride(0), scale.stride(0), out.stride(0),
        _SOFTWARE_FACTOR if software else 1.0, ROW_BLOCK=row_block, K_GROUP=k_group,
        BLOCK_N=bn, BLOCK_K=bk, SOFTWARE=software, num_warps=4,
        enable_fp_fusion=False)  # one product, rounded as torch rounds it
    return out
