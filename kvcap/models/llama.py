"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

Numerics follow HF transformers step for step (RMSNorm in FP32, RoPE tables in FP32) so that
FP32 runs reproduce its logits. Q/K/V and gate/up projections are fused at load time.
Attention goes through an AttentionBackend over the paged KV pool.

Built with a `ModelParallel` (kvcap.distributed.layers), the model holds one tensor-parallel
rank's shard: its query/KV heads and MLP columns (column-parallel QKV and gate/up), row-parallel
o_proj/down_proj that all-reduce, and vocabulary-parallel embedding/LM head. Without one it is
the plain single-process model (`shard` covers everything, no collectives).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvcap.attention.base import AttentionBackend
from kvcap.attention.metadata import AttentionMetadata
from kvcap.config import ModelSpec, env_flag
from kvcap.distributed.partition import TPShard, full_shard
from kvcap.errors import ModelLoadError
from kvcap.kv_cache.pool import KVCachePool
from kvcap.models import decode_gemm
from kvcap.models.fp8_linear import FP8Linear, layout
from kvcap.models.fp8_weights import FP8Weights

if TYPE_CHECKING:
    from kvcap.distributed.layers import ModelParallel

KVObserverFn = Callable[[int, torch.Tensor, torch.Tensor], None]
QKVBuffers = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
FUSED_OPS_ENV = "KVCAP_DISABLE_FUSED_OPS"


def fused_ops_for(x: torch.Tensor):
    """kvcap.kernels.fused_ops when x is on CUDA and KVCAP_DISABLE_FUSED_OPS is unset, else
    None (torch ops). Imported here, lazily: CPU installs need not have triton."""
    if not x.is_cuda or env_flag(FUSED_OPS_ENV):
        return None
    from kvcap.kernels import fused_ops

    return fused_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                res_out: torch.Tensor | None = None):
        """norm(x), or with `residual`: (norm(x + residual), x + residual) — the residual
        stream's add fused into the norm (one kernel on CUDA, kvcap.kernels.fused_ops).
        `res_out` receives x + residual (a piecewise CUDA graph's static buffer)."""
        fused = fused_ops_for(x) if x.dim() == 2 else None
        if fused is not None:
            return fused.add_rms_norm(x, self.weight, self.eps, residual, res_out)
        if residual is not None:
            x = x + residual
            if res_out is not None:
                x = res_out.copy_(x)
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the model's RoPE variant."""
    dim = spec.head_dim
    period = spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv = 1.0 / period
    rs = spec.rope_scaling
    if rs is None:
        return inv, 1.0
    kind = rs.get("rope_type", rs.get("type"))
    try:
        if kind == "linear":
            return inv / float(rs["factor"]), 1.0
        if kind == "llama3":
            factor = float(rs["factor"])
            low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
            old_ctx = float(rs["original_max_position_embeddings"])
            low_wl, high_wl = old_ctx / low, old_ctx / high
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wl, inv / factor, inv)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wl) & (wavelen <= low_wl)
            return torch.where(medium, smoothed, scaled), 1.0
        if kind == "yarn":
            return _yarn(period, spec)
    except KeyError as e:  # a config's mistake, said as one (not a bare KeyError at load)
        raise ModelLoadError(f"config.json's rope_scaling of type {kind!r} lacks {e.args[0]!r}, "
                             "which that type needs") from None
    except (TypeError, ValueError) as e:  # a value that is no number ("factor": "x" or null)
        raise ModelLoadError(f"config.json's rope_scaling of type {kind!r} holds a value that "
                             f"is not a number ({e})") from None
    raise ModelLoadError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3, "
                         "yarn)")


def _yarn(period: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv:2309.00071) as transformers computes it: the frequencies that turn fewer
    than `beta_slow` times over the pretraining length are interpolated (divided by `factor`),
    those turning more than `beta_fast` times kept, a linear ramp between; cos and sin scaled by
    the attention factor (0.1 ln(factor) + 1 unless the config sets it). `period`: 1 / each
    unscaled frequency."""
    rs, dim = spec.rope_scaling or {}, spec.head_dim
    old_ctx = float(rs["original_max_position_embeddings"])
    factor = float(rs.get("factor") or spec.max_position_embeddings / old_ctx)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rs.get("attention_factor")
    if attention is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_turning(turns: float) -> float:  # the rotary dim whose frequency turns `turns` times
        return dim * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(spec.rope_theta))

    lo = dim_turning(float(rs.get("beta_fast") or 32))
    hi = dim_turning(float(rs.get("beta_slow") or 1))
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: interpolated
    return 1.0 / (factor * period) * (1 - keep) + 1.0 / period * keep, float(attention)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        inv, self.attention_scaling = rope_inv_freq(spec)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]  # [T, 1, D]


def _linear(in_features: int, out_features: int, kind: str | None,
            fp8: FP8Weights | None = None, parts: list[int] | None = None,
            row_offsets: tuple[int, ...] = (), bias: bool = False) -> nn.Module:
    """A linear whose output rows need no communication (single process, or column-parallel):
    FP8 weights kept where `fp8` is the checkpoint's format (output rows stored as the
    checkpoint tensors `parts`, taken from `row_offsets` of them: fp8_linear.layout), else
    16-bit with `kind`'s decode_gemm rule (None: cuBLAS; biased linears always run cuBLAS)."""
    if fp8 is not None:
        row_block, k_group = layout(fp8, in_features, parts or [out_features], row_offsets)
        return FP8Linear(in_features, out_features, row_block, k_group, bias)
    if bias or kind is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return decode_gemm.DecodeLinear(in_features, out_features, kind)


def _row_linear(in_features: int, out_features: int, tp: ModelParallel | None,
                kind: str | None = None, fp8: FP8Weights | None = None,
                k_offset: int = 0) -> nn.Module:
    """Bias-free row-parallel linear (this rank's inputs start at checkpoint column
    `k_offset`); `kind` names its decode_gemm rule (None: cuBLAS)."""
    if tp is None:
        return _linear(in_features, out_features, kind, fp8)
    from kvcap.distributed.layers import RowParallelFP8Linear, RowParallelLinear

    if fp8 is not None:
        row_block, k_group = layout(fp8, in_features, [out_features], k_offset=k_offset)
        return RowParallelFP8Linear(in_features, out_features, row_block, k_group, tp.comm)
    return RowParallelLinear(in_features, out_features, tp.comm, kind)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, shard: TPShard,
                 tp: ModelParallel | None = None, fp8: FP8Weights | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = shard.num_q_heads, shard.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_out = self.q_size + 2 * self.kv_size
        q_at, kv_at = shard.q_heads[0] * self.head_dim, shard.kv_heads[0] * self.head_dim
        self.qkv_proj = _linear(spec.hidden_size, qkv_out, "qkv_proj", fp8,
                                [self.q_size, self.kv_size, self.kv_size], (q_at, kv_at, kv_at),
                                spec.qkv_bias)
        self.o_proj = _row_linear(self.q_size, spec.hidden_size, tp, "o_proj", fp8, q_at)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn_out = nn.Identity()  # hook point: attention output before o_proj
        self.softmax_scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        q, k, v, stored = self.project(x, cos, sin, ctx)
        return self.o_proj_of(self.attend(q, k, v, stored, ctx))

    def project(self, x, cos, sin, ctx: ForwardContext, out: QKVBuffers | None = None):
        """QKV projection and RoPE: (q [T, Hq, D], k, v [T, Hkv, D], stored), stored = the
        fused RoPE kernel also wrote k/v into the layer's cache (the backend attends over it).
        `out`: tensors q, k, v end up in (a piecewise CUDA graph's static buffers)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        fused = fused_ops_for(qkv) if self.q_norm is None else None
        cache = ctx.pool.layer(self.layer_idx)
        # The fused RoPE kernel also writes the cache when the backend can attend over it.
        stored = fused is not None and ctx.backend.accepts_stored_kv
        if fused is not None:
            q, k, v = fused.rope_split_qkv(
                qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim,
                cache=cache if stored else None, slot_mapping=ctx.meta.slot_mapping,
                fp8_mode=getattr(ctx.backend, "fp8_mode", "auto"), out=out)
            return q, k, v, stored
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if out is not None:
            q, k, v = (buf.copy_(val) for buf, val in zip(out, (q, k, v), strict=True))
        return q, k, v, stored

    def attend(self, q, k, v, stored: bool, ctx: ForwardContext,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q over the layer's cache (writing k/v first unless `stored`), into
        `out` [T, Hq, D] (new when None)."""
        if ctx.kv_observer is not None:
            n = ctx.meta.num_tokens
            ctx.kv_observer(self.layer_idx, k[:n], v[:n])
        out = torch.empty_like(q) if out is None else out
        cache = ctx.pool.layer(self.layer_idx)
        if stored:
            ctx.backend.attend_stored(q, cache, ctx.meta, self.softmax_scale, out)
        else:
            ctx.backend.forward(q, k.contiguous(), v.contiguous(), cache, ctx.meta,
                                self.softmax_scale, out)
        return out

    def o_proj_of(self, out: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn_out(out.view(out.shape[0], self.q_size)))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, shard: TPShard, tp: ModelParallel | None = None,
                 fp8: FP8Weights | None = None):
        super().__init__()
        self.inter = shard.inter_size
        self.gate_up_proj = _linear(spec.hidden_size, 2 * self.inter, None, fp8,
                                    [self.inter, self.inter], (shard.inter[0],) * 2)
        self.down_proj = _row_linear(self.inter, spec.hidden_size, tp, "down_proj", fp8,
                                     shard.inter[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # decode rows: the GEMM and the activation in one kernel
        if isinstance(self.gate_up_proj, FP8Linear):
            act = self.gate_up_proj.swiglu(x)
        else:
            act = decode_gemm.swiglu(x, self.gate_up_proj.weight)
        if act is not None:
            return self.down_proj(act)
        gate_up = self.gate_up_proj(x)
        fused = fused_ops_for(gate_up)
        if fused is not None:
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, shard: TPShard,
                 tp: ModelParallel | None = None, fp8: FP8Weights | None = None):
        super().__init__()
        self.self_attn = Attention(spec, layer_idx, shard, tp, fp8)
        self.mlp = MLP(spec, shard, tp, fp8)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, residual, cos, sin, ctx: ForwardContext):
        """(x, residual) -> (mlp output, residual): the stream x + residual is added inside
        the next norm, so each add costs no kernel of its own on CUDA. residual=None on the
        first layer (x is then the embedding)."""
        q, k, v, stored, residual = self.pre(x, residual, cos, sin, ctx)
        return self.post(self.self_attn.attend(q, k, v, stored, ctx), residual)

    def pre(self, x, residual, cos, sin, ctx: ForwardContext, out: QKVBuffers | None = None,
            res_out: torch.Tensor | None = None):
        """The layer up to its attention: (q, k, v, stored, residual) (Attention.project).
        `out` / `res_out`: where q, k, v and the residual end up (piecewise CUDA graphs)."""
        if residual is None:
            h = self.input_layernorm(x)
            residual = x if res_out is None else res_out.copy_(x)
        else:
            h, residual = self.input_layernorm(x, residual, res_out)
        return (*self.self_attn.project(h, cos, sin, ctx, out), residual)

    def post(self, attn: torch.Tensor, residual: torch.Tensor):
        """The layer after its attention: o_proj, the residual add + norm, the MLP."""
        h, residual = self.post_attention_layernorm(self.self_attn.o_proj_of(attn), residual)
        return self.mlp(h), residual


class ForwardContext:
    """What every layer needs for one forward: backend, pool, metadata, optional observer."""

    def __init__(self, backend: AttentionBackend, pool: KVCachePool, meta: AttentionMetadata,
                 kv_observer: KVObserverFn | None = None):
        self.backend, self.pool, self.meta, self.kv_observer = backend, pool, meta, kv_observer


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, tp: ModelParallel | None = None,
                 fp8: FP8Weights | None = None):
        """`fp8`: the checkpoint's FP8 weight format, to keep its linears' weights in FP8
        (kvcap.models.fp8_linear), or None for 16-bit weights."""
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.fp8 = fp8
        self.shard = tp.shard if tp is not None else full_shard(spec)
        # Registration order fixes named_parameters() order (dummy weights depend on it).
        self.embed_tokens: nn.Embedding
        if tp is None:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        else:
            from kvcap.distributed.layers import ParallelLMHead, VocabParallelEmbedding

            self.embed_tokens = VocabParallelEmbedding(self.shard.vocab, spec.hidden_size,
                                                       tp.comm)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, self.shard, tp, fp8)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = Rotary(spec)
        self.lm_head: nn.Module
        if tp is None:
            self.lm_head = decode_gemm.DecodeLinear(spec.hidden_size, spec.vocab_size, "lm_head")
        else:
            self.lm_head = ParallelLMHead(self.shard, spec.vocab_size, spec.hidden_size, tp.comm)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [n, hidden] -> FP32 logits [n, vocab] (None on tensor-parallel ranks > 0)."""
        logits = self.lm_head(hidden)
        return logits.float() if logits is not None else None
