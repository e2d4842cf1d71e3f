"""A random-weight model with the reference system's QSA shapes (SYSTEM.md §6, issue 9 1a).

head_dim 256, GQA-6 (6 query heads per KV head), q/k RMSNorm, partial RoPE (the first
`rotary_dim` dims), a sigmoid output gate on the attention output, and on every QSA layer a
trained-indexer head set: index queries [T, 4, 128] (RoPE at the row position) and one raw
index key [T, 128] per token; a complete group's compressed key is the mean of its 4 raw keys,
RMS-normalised, with RoPE at the group's first position (`Indexer.compress`). The other
layers are plain dense attention (the reference's non-QSA layers are linear attention, which
has no KV cache; here they keep one so the whole model runs through one pool).
Built from kvcap.models.llama's RMSNorm and ForwardContext; runs on any AttentionBackend
(a QSABackend gets the index inputs on QSA layers, any other backend attends densely).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvcap.models.llama import ForwardContext, RMSNorm, rotate_half
from kvcap.qsa.backend import IndexInputs, QSABackend


@dataclass(frozen=True)
class RefShape:
    """Reference-shape model sizes (small hidden/vocab so it runs on a CPU)."""

    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 12
    num_kv_heads: int = 2
    head_dim: int = 256
    rotary_dim: int = 64
    index_heads: int = 4
    index_dim: int = 128
    intermediate_size: int = 768
    vocab_size: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    qsa_every: int = 4

    @property
    def qsa_layers(self) -> tuple[int, ...]:
        return tuple(range(self.qsa_every - 1, self.num_layers, self.qsa_every))


def rope_tables(positions: torch.Tensor, rotary_dim: int, theta: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 cos/sin [n, 1, rotary_dim] for int positions [n]."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=positions.device).float()
                           / rotary_dim))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, None, :], emb.sin()[:, None, :]


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of x [n, H, D]; the rest pass through."""
    rd = cos.shape[-1]
    xr = x[..., :rd]
    xr = xr * cos.to(x.dtype) + rotate_half(xr) * sin.to(x.dtype)
    return torch.cat((xr, x[..., rd:]), dim=-1)


class Indexer(nn.Module):
    """Trained-indexer projections of one QSA layer."""

    def __init__(self, shape: RefShape):
        super().__init__()
        self.shape = shape
        self.wq = nn.Linear(shape.hidden_size, shape.index_heads * shape.index_dim, bias=False)
        self.wk = nn.Linear(shape.hidden_size, shape.index_dim, bias=False)
        self.k_norm = RMSNorm(shape.index_dim, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (index queries [T, Hi, di] post-RoPE, raw index keys [T, di])."""
        s = self.shape
        iq = self.wq(x).view(x.shape[0], s.index_heads, s.index_dim)
        return partial_rope(iq, cos, sin), self.wk(x)

    def compress(self, keys: torch.Tensor, first_pos: torch.Tensor) -> torch.Tensor:
        """FP32 raw keys [n, R, 1, di] + group first positions [n] -> [n, 1, di] FP32."""
        s = self.shape
        mean = keys.mean(1)  # [n, 1, di]
        normed = mean * torch.rsqrt(mean.pow(2).mean(-1, keepdim=True) + s.rms_norm_eps)
        normed = normed * self.k_norm.weight.float()
        cos, sin = rope_tables(first_pos, s.rotary_dim, s.rope_theta)
        return partial_rope(normed, cos, sin)


class GatedAttention(nn.Module):
    def __init__(self, shape: RefShape, layer_idx: int, qsa: bool):
        super().__init__()
        self.shape, self.layer_idx = shape, layer_idx
        hq, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.sizes = [hq * d, hq * d, hkv * d, hkv * d]  # q, gate, k, v
        self.qgkv_proj = nn.Linear(shape.hidden_size, sum(self.sizes), bias=False)
        self.q_norm = RMSNorm(d, shape.rms_norm_eps)
        self.k_norm = RMSNorm(d, shape.rms_norm_eps)
        self.o_proj = nn.Linear(hq * d, shape.hidden_size, bias=False)
        self.indexer = Indexer(shape) if qsa else None
        self.attn_out = nn.Identity()  # hook point: gated attention output before o_proj
        self.softmax_scale = d ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        s, t = self.shape, x.shape[0]
        q, gate, k, v = self.qgkv_proj(x).split(self.sizes, dim=-1)
        q = partial_rope(self.q_norm(q.view(t, s.num_heads, s.head_dim)), cos, sin)
        k = partial_rope(self.k_norm(k.view(t, s.num_kv_heads, s.head_dim)), cos, sin)
        v = v.view(t, s.num_kv_heads, s.head_dim)
        if ctx.kv_observer is not None:
            n = ctx.meta.num_tokens
            ctx.kv_observer(self.layer_idx, k[:n], v[:n])
        out = torch.empty_like(q)
        cache = ctx.pool.layer(self.layer_idx)
        k, v = k.contiguous(), v.contiguous()
        backend = ctx.backend
        if self.indexer is not None and isinstance(backend, QSABackend) and \
                self.layer_idx in backend.layers:
            iq, ik = self.indexer(x, cos, sin)
            backend.forward(q, k, v, cache, ctx.meta, self.softmax_scale, out,
                            index=IndexInputs(iq, ik, self.indexer.compress))
        else:
            backend.forward(q, k, v, cache, ctx.meta, self.softmax_scale, out)
        gated = out.view(t, -1) * torch.sigmoid(gate)
        return self.o_proj(self.attn_out(gated))


class Block(nn.Module):
    def __init__(self, shape: RefShape, layer_idx: int, qsa: bool):
        super().__init__()
        self.self_attn = GatedAttention(shape, layer_idx, qsa)
        self.gate_up = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.down = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        gate, up = self.gate_up(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class QSAReferenceModel(nn.Module):
    """Random-weight reference-shape decoder: forward(ids [T], positions [T], ctx) ->
    final hidden states [T, hidden]; `compute_logits` -> FP32 [n, vocab]."""

    def __init__(self, shape: RefShape = RefShape(), seed: int = 0):
        super().__init__()
        self.shape = shape
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
            qsa = set(shape.qsa_layers)
            self.layers = nn.ModuleList(Block(shape, i, i in qsa)
                                        for i in range(shape.num_layers))
            self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
            self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        finally:
            torch.random.set_rng_state(gen_state)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = rope_tables(positions, self.shape.rotary_dim, self.shape.rope_theta)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
