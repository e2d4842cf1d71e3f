"""Turns a SchedulerOutput into one forward pass and sampled tokens.

Builds the flattened batch (ids, positions, AttentionMetadata) once per step, runs the model,
gathers the rows that sample, and collects teacher-forced prompt logits/logprobs on request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcap.attention.base import AttentionBackend
from kvcap.attention.metadata import AttentionMetadata
from kvcap.engine.request import Request
from kvcap.kv_cache.pool import KVCachePool
from kvcap.models.llama import ForwardContext, KVObserverFn, LlamaModel
from kvcap.sampling.sampler import Sampler, SamplingBatch, compute_topn_logprobs


@dataclass
class RequestExtras:
    """Per-request state the runner keeps beside the scheduler's Request."""

    seed: int
    want_prompt_logits: bool = False
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # CPU chunks [n, V]
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass
class StepResult:
    sampled: dict[str, int]


class ModelRunner:
    def __init__(self, model: LlamaModel, backend: AttentionBackend, pool: KVCachePool,
                 device: torch.device):
        self.model, self.backend, self.pool, self.device = model, backend, pool, device
        self.sampler = Sampler(device)
        self.kv_observer: KVObserverFn | None = None
        self.graphs = None  # DecodeGraphs, set by enable_cuda_graphs()

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        from kvcap.engine.cuda_graph import DecodeGraphs

        graphs = DecodeGraphs(self.model, self.backend, self.pool, self.device, max_num_seqs,
                              max_model_len)
        graphs.capture()
        self.graphs = graphs

    def _forward(self, chunks, ids, positions, query_lens, seq_lens, tables, eager_only):
        """Hidden states of every row, and the metadata (None on the graph path)."""
        if (self.graphs is not None and not eager_only and self.kv_observer is None
                and max(query_lens) == 1
                and self.graphs.can_run(len(chunks), max(seq_lens))):
            return self.graphs.run(ids, positions, tables), None
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.pool.spec.block_size,
                                       self.device)
        if self.graphs is not None and meta.is_decode_only:
            meta.max_seq_len = self.graphs.context_class(meta.max_seq_len)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        ctx = ForwardContext(self.backend, self.pool, meta, self.kv_observer)
        return self.model(input_ids, pos, ctx), meta

    @torch.inference_mode()
    def execute(self, chunks, extras: dict[str, RequestExtras]) -> StepResult:
        """chunks: the scheduler's ScheduledChunk list (request, start, num_tokens, samples)."""
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for ch in chunks:
            req: Request = ch.request
            ids.extend(req.all_token_ids[ch.start:ch.start + ch.num_tokens])
            positions.extend(range(ch.start, ch.start + ch.num_tokens))
            query_lens.append(ch.num_tokens)
            seq_lens.append(ch.start + ch.num_tokens)
            tables.append(req.block_ids)
        eager_only = any(extras[ch.request.request_id].want_prompt_logits
                         or ch.request.sampling_params.prompt_logprobs is not None
                         for ch in chunks)
        hidden, meta = self._forward(chunks, ids, positions, query_lens, seq_lens, tables,
                                     eager_only)
        ends = [0]
        for n in query_lens:
            ends.append(ends[-1] + n)
        if meta is not None:
            self._collect_prompt_outputs(chunks, extras, hidden, meta)
        sample_chunks = [(i, ch) for i, ch in enumerate(chunks) if ch.samples]
        if not sample_chunks:
            return StepResult({})
        rows = torch.tensor([ends[i + 1] - 1 for i, _ in sample_chunks], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        reqs = [ch.request for _, ch in sample_chunks]
        batch = SamplingBatch.from_params(
            [r.sampling_params for r in reqs],
            seeds=[extras[r.request_id].seed for r in reqs],
            steps=[len(r.output_token_ids) for r in reqs],
            device=self.device,
        )
        tokens = self.sampler.sample(logits, batch).tolist()
        self._collect_logprobs(reqs, extras, logits, tokens)
        return StepResult({r.request_id: t for r, t in zip(reqs, tokens, strict=True)})

    def _collect_prompt_outputs(self, chunks, extras, hidden, meta: AttentionMetadata) -> None:
        """Teacher-forced logits of prompt positions, for requests that asked for them."""
        for i, ch in enumerate(chunks):
            req: Request = ch.request
            ex = extras[req.request_id]
            n_lp = req.sampling_params.prompt_logprobs
            if not ex.want_prompt_logits and n_lp is None:
                continue
            if ch.start == 0:  # (re)started from scratch, e.g. after preemption
                ex.prompt_logits.clear()
                ex.prompt_logprobs = [None]
            end = min(ch.start + ch.num_tokens, req.num_prompt_tokens)
            if end <= ch.start:
                continue
            lo = meta.query_start_loc_cpu[i]
            logits = self.model.compute_logits(hidden[lo:lo + end - ch.start])
            if ex.want_prompt_logits:
                ex.prompt_logits.append(logits.cpu())
            if n_lp is not None:
                # logits at position p predict prompt token p+1
                nxt = req.prompt_token_ids[ch.start + 1:end + 1]
                logits = logits[: len(nxt)]
                vals, idx = compute_topn_logprobs(logits, n_lp)
                lsm = torch.log_softmax(logits, dim=-1)
                chosen = lsm[torch.arange(len(nxt)), torch.tensor(nxt, device=lsm.device)]
                for r in range(len(nxt)):
                    d = dict(zip(idx[r].tolist(), vals[r].tolist(), strict=True))
                    d[nxt[r]] = float(chosen[r])
                    ex.prompt_logprobs.append(d)

    def _collect_logprobs(self, reqs, extras, logits, tokens) -> None:
        want = [(j, r) for j, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
        if not want:
            return
        lsm = torch.log_softmax(logits, dim=-1)
        for j, r in want:
            n = r.sampling_params.logprobs
            d: dict[int, float] = {}
            if n:
                vals, idx = torch.topk(lsm[j], n)
                d = dict(zip(idx.tolist(), vals.tolist(), strict=True))
            d[tokens[j]] = float(lsm[j, tokens[j]])
            extras[r.request_id].logprobs.append(d)
