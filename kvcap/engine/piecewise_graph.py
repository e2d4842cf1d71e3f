"""Piecewise CUDA graphs for the steps the decode graphs cannot take: prefill chunks, mixed
prefill + decode batches, drafts verified as chunks.

Such a step runs eagerly, and eagerly the host -- not the GPU -- set its time: the 8B shape's
eager decode step launched 308 kernels in 21-23 ms on the H100 while its kernels took 5.8-6.6
ms, and the same step in the decode graph took 6.0-6.9 ms
(docs/benchmarks/step-profile-2026-12-05-h100-8b-fp16-{eager,graphs}.json). Attention is the
only part of a layer whose launch depends on the batch's make-up (sequences, query lengths,
block tables), so everything else is captured: one graph per stretch between two attentions
(embedding + layer 0 up to its attention; layer i's o_proj, norm and MLP with layer i+1 up to
its attention; the last layer's rest with the final norm), per token bucket. A step of n <=
the largest bucket tokens (512 on an 8B model, up to 2048 on smaller ones) pads its rows to
the bucket (token 0 at position 0, slot -1: the cache write and attention skip them) and
alternates replays with eager attention launches.

Tensors that cross from a piece to the attention after it or to the next piece live in static
buffers the pieces write in place (q/k/v straight from the fused RoPE kernel, the residual
from the fused add + norm), so the graphs share one memory pool without keeping a copy per
layer. Every eager step on CUDA pads to the same buckets (ModelRunner), so graph and
enforce_eager runs compute the same sums. Off with enforce_eager / KVCAP_ENFORCE_EAGER=1, or
alone with KVCAP_DISABLE_PIECEWISE_GRAPHS=1.
"""

from __future__ import annotations

import logging
import time

import torch
from tqdm.auto import tqdm

from kvcap.attention.metadata import AttentionMetadata
from kvcap.config import env_flag
from kvcap.models.llama import DecoderLayer, ForwardContext, LlamaModel

logger = logging.getLogger(__name__)

DISABLE_ENV = "KVCAP_DISABLE_PIECEWISE_GRAPHS"

# The largest step (tokens) the pieces are captured for, for an 8B-parameter model: there a
# 512-token step's GEMMs take about as long as the eager step's host work (~14-18 ms on the
# H100), so past it the GPU, not the launches, sets the time. A smaller model's steps cost the
# GPU proportionally less per token, so its buckets reach further (piecewise_max_tokens), up to
# PIECEWISE_TOKENS_CAP.
PIECEWISE_MAX_TOKENS = 512
PIECEWISE_REFERENCE_PARAMS = 8.0e9
PIECEWISE_TOKENS_CAP = 2048
MIN_BUCKET = 16


def piecewise_max_tokens(num_params: int) -> int:
    """The largest bucket for a model of `num_params` parameters (on this rank): the power of
    two nearest below PIECEWISE_MAX_TOKENS x 8e9 / num_params, kept within
    [PIECEWISE_MAX_TOKENS, PIECEWISE_TOKENS_CAP]."""
    reach = PIECEWISE_MAX_TOKENS * PIECEWISE_REFERENCE_PARAMS / max(num_params, 1)
    top = PIECEWISE_MAX_TOKENS
    while top * 2 <= min(reach, PIECEWISE_TOKENS_CAP):
        top *= 2
    return top


def token_buckets(max_tokens: int, largest: int = PIECEWISE_MAX_TOKENS) -> list[int]:
    """Powers of two from MIN_BUCKET up to min(max_tokens, largest) (and that bound itself):
    the row counts eager steps pad to."""
    top = min(max_tokens, largest)
    sizes, b = [], MIN_BUCKET
    while b < top:
        sizes.append(b)
        b *= 2
    return [*sizes, top] if top >= 1 else []


def bucket_for(buckets: list[int], num_tokens: int) -> int | None:
    """The smallest bucket holding num_tokens rows, None past the largest."""
    return next((b for b in buckets if b >= num_tokens), None)


def piecewise_disabled() -> bool:
    return env_flag(DISABLE_ENV)


def has_pieces(model) -> bool:
    """Whether `model` can run in pieces: kvcap's Llama-family model with its own decoder
    layers (not QSA's gated ones) and no tensor parallelism (its all-reduces stay eager)."""
    return (isinstance(model, LlamaModel) and getattr(model, "tp", None) is None
            and all(type(layer) is DecoderLayer for layer in model.layers))


class PiecewiseGraphs:
    """Captures `model` (a LlamaModel, no tensor parallelism) in pieces cut at its attentions,
    for each bucket; `run` replays them around the step's eager attention launches.
    `graphs=False` runs the same pieces as plain calls (what CPU tests exercise)."""

    def __init__(self, model, backend, pool, device: torch.device, buckets: list[int],
                 graphs: bool = True, pool_handle=None):
        self.model, self.backend, self.pool, self.device = model, backend, pool, device
        self.buckets = list(buckets)
        self.use_graphs = graphs
        self.capture_s: float | None = None  # seconds capture() took with graphs
        self.pool_handle = pool_handle
        attn = model.layers[0].self_attn
        hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        dtype = model.embed_tokens.weight.dtype
        n = self.buckets[-1]
        # The step's inputs, copied in by `run`; every slot is -1 while the pieces are captured,
        # so their warm-up writes no cache row.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.q = torch.zeros(n, hq, d, dtype=dtype, device=device)
        self.k = torch.zeros(n, hkv, d, dtype=dtype, device=device)
        self.v = torch.zeros(n, hkv, d, dtype=dtype, device=device)
        self.attn = torch.zeros(n, hq, d, dtype=dtype, device=device)
        self.residual = torch.zeros(n, model.spec.hidden_size, dtype=dtype, device=device)
        self._pieces: dict[int, list] = {}  # bucket -> callables (the plain-call mode)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.stored: list[bool] = []  # per layer: the piece wrote the layer's K/V already
        self._keep: dict[int, tuple] = {}  # bucket -> tensors used across its pieces (cos/sin)

    def _capture_ctx(self, t: int) -> ForwardContext:
        """The pieces read only the slot mapping (the fused RoPE kernel's cache write) from the
        metadata: the static one. The rest describes no real batch."""
        one = torch.zeros(1, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            query_start_loc=torch.zeros(2, dtype=torch.int32, device=self.device),
            seq_lens=one, context_lens=one,
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=self.device),
            slot_mapping=self.slot_mapping[:t], query_start_loc_cpu=[0, 0], seq_lens_cpu=[0],
            max_query_len=0, max_seq_len=0, block_size=self.pool.spec.block_size)
        return ForwardContext(self.backend, self.pool, meta, None)

    def _make_pieces(self, t: int) -> list:
        model, ctx = self.model, self._capture_ctx(t)
        qkv, res, attn = (self.q[:t], self.k[:t], self.v[:t]), self.residual[:t], self.attn[:t]
        layers = model.layers
        rope: dict[str, tuple] = {}
        stored = self.stored

        def note(i: int, s: bool) -> None:
            if len(stored) <= i:
                stored.append(s)
            elif stored[i] != s:  # a constant of the model and backend, never of a bucket
                raise RuntimeError(f"layer {i}: the K/V write moved between buckets")

        def first():
            x = model.embed_tokens(self.input_ids[:t])
            cos, sin = model.rotary(self.positions[:t], x.dtype)
            rope["cos_sin"] = (cos, sin)
            note(0, layers[0].pre(x, None, cos, sin, ctx, qkv, res)[3])

        def between(i: int):
            def piece():
                x, r = layers[i - 1].post(attn, res)
                cos, sin = rope["cos_sin"]
                note(i, layers[i].pre(x, r, cos, sin, ctx, qkv, res)[3])
            return piece

        def last():
            x, r = layers[-1].post(attn, res)
            return model.norm(x, r)[0]

        self._keep[t] = (rope,)
        return [first, *(between(i) for i in range(1, len(layers))), last]

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        for t in tqdm(list(reversed(self.buckets)), desc="capturing piecewise CUDA graphs"):
            pieces = self._make_pieces(t)
            if not self.use_graphs:
                self._pieces[t] = pieces
                continue
            for piece in pieces:  # warm-up: compile this bucket's kernels outside the graphs
                out = piece()
            torch.cuda.synchronize(self.device)
            graphs = []
            for piece in pieces:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool_handle):
                    out = piece()
                if self.pool_handle is None:
                    self.pool_handle = g.pool()
                graphs.append(g)
            self.graphs[t] = graphs
            self.hidden[t] = out  # the last piece's output: kept, so no later capture reuses it
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
        # benchmarks record it (startup cost); None without graphs (enforce_eager's padding)
        self.capture_s = time.perf_counter() - start if self.use_graphs else None
        logger.info("piecewise CUDA graphs: %d pieces x token buckets %s, captured in %.1f s",
                    len(self.model.layers) + 1, self.buckets, time.perf_counter() - start)

    def can_run(self, num_tokens: int) -> bool:
        return num_tokens <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            num_tokens: int) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a step whose ids, positions and
        meta.slot_mapping are padded to a bucket (EagerInputs.build's pad_to)."""
        t = input_ids.shape[0]
        if t not in self._pieces and t not in self.graphs:
            raise ValueError(f"{t} rows is not a captured bucket {self.buckets}")
        if positions.shape[0] != t or meta.slot_mapping.shape[0] != t:
            raise ValueError("ids, positions and slot_mapping must all be padded to the bucket")
        for dst, src in ((self.input_ids, input_ids), (self.positions, positions),
                         (self.slot_mapping, meta.slot_mapping)):
            dst[:t].copy_(src, non_blocking=True)
        ctx = ForwardContext(self.backend, self.pool, meta, None)
        q, k, v, attn = self.q[:t], self.k[:t], self.v[:t], self.attn[:t]
        steps = self.graphs[t] if self.use_graphs else self._pieces[t]
        replay = (lambda g: g.replay()) if self.use_graphs else (lambda f: f())
        out = replay(steps[0])
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attend(q, k, v, self.stored[i], ctx, out=attn)
            out = replay(steps[i + 1])
        hidden = self.hidden[t] if self.use_graphs else out
        return hidden[:num_tokens]
