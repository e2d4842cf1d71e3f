"""Turns a SchedulerOutput into one forward pass and sampled tokens.

Builds the flattened batch (ids, positions, AttentionMetadata) once per step, runs the model,
gathers the rows that sample, and collects teacher-forced prompt logits/logprobs on request.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvcap.attention.base import AttentionBackend
from kvcap.engine.input_batch import EagerInputs
from kvcap.engine.piecewise_graph import (
    PiecewiseGraphs,
    bucket_for,
    has_pieces,
    piecewise_disabled,
    piecewise_max_tokens,
    token_buckets,
)
from kvcap.engine.request import Request
from kvcap.engine.structured import NoContinuation
from kvcap.errors import ConfigError
from kvcap.kv_cache.pool import KVCachePool
from kvcap.models.llama import ForwardContext, KVObserverFn, LlamaModel
from kvcap.sampling.json_grammar import Grammar
from kvcap.sampling.json_grammar import State as GrammarState
from kvcap.sampling.penalties import PenaltyState, adjust_logits
from kvcap.sampling.reasoning_gate import ReasoningGate
from kvcap.sampling.reference import reference_sample
from kvcap.sampling.sampler import Sampler, SamplingBatch, logprob_dicts

PromptLogitsFn = Callable[[int, torch.Tensor, int], None]
# Teacher-forced logits are computed this many rows at a time: [rows, V] FP32 and its
# log_softmax must stay small beside the KV pool, which is sized from a warm-up that computes
# logits for max_num_seqs rows only (a 2,048-row prefill chunk of a 128K vocabulary would be
# 1 GiB each).
PROMPT_LOGITS_ROWS = 256
# Speculative decoding verifies drafts as graphed decode rows (ModelRunner._draft_rows) only
# while the chunk route's attention -- the chunked-prefill kernel, one program per drafted
# sequence and KV head, each walking its whole context -- would fill less than this fraction of
# the SMs, and the rows' K/V re-reads stay at most SPEC_ROWS_MAX_EXTRA_KV_VALUES K/V values.
# Measured on the H100 (132 SMs) with the Llama-3.1-8B shape (8 KV heads), K = 4, the chunk
# running in piecewise CUDA graphs (docs/benchmarks/verify-cost-2026-12-05-h100-8b-*.json,
# `kvcap bench verify_cost`): 1-8 drafted requests (8-64 programs) at 1K-16K, rows took
# 0.40-0.96 of the chunk's step time (up to 32 Gi values re-read), in BF16 and E4M3; 16
# requests (128 programs) 1.00-1.30 -- there the chunk's one pass wins. (Before the piecewise
# graphs the eager chunk paid 11-26 ms of launches, and rows won up to 32 Gi values whatever the
# batch: docs/benchmarks/verify-cost-2026-12-05-h200-*.json.)
SPEC_ROWS_MAX_CHUNK_FILL = 0.5
SPEC_ROWS_MAX_EXTRA_KV_VALUES = 32 << 30

logger = logging.getLogger(__name__)


@dataclass
class RequestExtras:
    """Per-request state the runner keeps beside the scheduler's Request."""

    seed: int
    want_prompt_logits: bool = False
    stream: bool = True  # an output every step; False: only the final one
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # CPU chunks [n, V]
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    penalties: PenaltyState | None = None  # token counts, for requests that adjust logits
    # structured output: the request's grammar (compiled once) and the output so far
    grammar: Grammar | None = None
    grammar_state: GrammarState | None = None
    reasoning_gate: ReasoningGate | None = None  # structured output after the thinking


@dataclass
class StepResult:
    sampled: dict[str, int]
    # Some row's token came from the host-side fallback (see `Sampler.sample`): the device
    # tokens a step scheduled ahead was fed differ from these, so that step must be dropped.
    host_fixed: bool = False
    # Requests that cannot go on (structured output with no token that fits): request id ->
    # why. The engine ends each alone, aborted with the reason as its error; their entries in
    # `sampled` are not used.
    failed: dict[str, str] = field(default_factory=dict)
    # Chunks with drafts: request id -> the drafts kept (`accept_draft`); `sampled` holds the
    # token after them.
    accepted: dict[str, list[int]] = field(default_factory=dict)


def accept_draft(draft: list[int], tokens: list[int]) -> tuple[list[int], int]:
    """Verify drafts against the tokens the model sampled at the draft chunk's rows (row i
    samples what follows the last token and drafts 1..i): keep drafts while each equals the
    token sampled before it, then take the first sampled token that differs (or the one after
    the last draft). Every row samples with its own step's random numbers, as one-token decode
    would, so the output is exactly what decoding without drafts produces from the same
    logits: greedy or sampled, with or without a seed. Returns (kept drafts, next token)."""
    a = 0
    while a < len(draft) and draft[a] == tokens[a]:
        a += 1
    return draft[:a], tokens[a]


@dataclass
class PendingStep:
    """A launched step whose tokens are still on the device (`ModelRunner.launch`)."""

    reqs: list[Request]  # the rows that sample, in order
    logits: torch.Tensor | None
    tokens: torch.Tensor | None  # int64 [S] on the device; -1 rows are left to `finish`
    batch: SamplingBatch | None  # None when every row is greedy
    # The model's logits where `logits` were adjusted (bias, penalties) for sampling:
    # logprobs report the raw ones.
    raw_logits: torch.Tensor | None = None
    # CUDA: the tokens' copy in pinned host memory and the event that marks it complete. A
    # plain .tolist() in `finish` would queue behind a step launched ahead since, and wait
    # for that step too.
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    # Speculative decoding: (first row, chunk) of each chunk with drafts; its rows are the
    # chunk's 1 + len(draft) rows, all sampling (None when no chunk has drafts).
    drafts: list[tuple[int, object]] | None = None

    def start_copy(self) -> PendingStep:
        if self.tokens is not None and self.tokens.is_cuda:
            self.host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self.host.copy_(self.tokens, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        return self

    def token_list(self) -> list[int]:
        if self.ready is None:
            return self.tokens.tolist()
        self.ready.synchronize()
        return self.host.tolist()



@dataclass
class StepPlan:
    """One step's flattened batch: what every tensor-parallel rank needs to run the model.

    Plain Python lists (picklable). Row r of the batch is token `ids[r]` at `positions[r]`;
    sequence i has `query_lens[i]` new rows, `seq_lens[i]` tokens after the step and block
    table `tables[i]`. `prompt_rows` lists (chunk index, first row, end row) whose logits are
    teacher-forced outputs; `sample_rows` the rows that sample. `use_graph` is decided once
    (on rank 0) so that every rank takes the same path and issues the same collectives.
    """

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    use_graph: bool = False
    prompt_rows: list[tuple[int, int, int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    # Scheduled ahead: the input ids are the in-flight step's sampled tokens, on the device
    # (`ids` holds placeholders); under tensor parallelism rank 0 broadcasts them.
    fed: bool = False


class ModelRunner:
    def __init__(self, model: LlamaModel, backend: AttentionBackend, pool: KVCachePool,
                 device: torch.device):
        self.model, self.backend, self.pool, self.device = model, backend, pool, device
        self.sampler = Sampler(device)
        self._eager = EagerInputs(device, pool.spec.block_size)
        self.kv_observer: KVObserverFn | None = None
        self.graphs = None  # DecodeGraphs, set by enable_cuda_graphs()
        self.piecewise = None  # PiecewiseGraphs, set by enable_cuda_graphs()
        self.context_classes: list[int] | None = None  # set_context_classes (CUDA)
        self.token_buckets: list[int] = []  # set_token_buckets (CUDA, triton backend)
        self.sm_count = (torch.cuda.get_device_properties(device).multi_processor_count
                         if device.type == "cuda" else None)  # the drafts' route (_draft_rows)
        self.timer = None  # kvcap.engine.timing.StepTimer while step timing is on (rank 0)
        self.eos_token_ids: set[int] = set()  # masked under a request's min_tokens (LLM sets)
        self.tokenizer = None  # for JSON mode's token bytes (LLM sets it on rank 0)
        self._structured = None  # kvcap.engine.structured.StructuredOutput, built on first use
        # How a draft chunk (speculative decoding) runs: as one chunk of 1 + K query rows
        # (the chunked-prefill route: eager, reads the sequence's K/V once) or as 1 + K
        # one-token decode rows over the same block table, row i attending up to its own
        # position (the decode kernels in a CUDA graph; but each row reads the K/V again).
        # Same tokens either way (tests/test_speculative). KVCAP_SPEC_VERIFY=chunk|rows picks
        # one; by default (`_draft_rows`) each step takes the rows where its rows fit the decode
        # graphs and re-read at most SPEC_ROWS_MAX_EXTRA_KV_VALUES: on the H100 the eager chunk
        # made the embedded model 2-10x slower than decoding without drafts, graphed rows up to
        # 2.5x faster (docs/benchmarks/speculative-2026-12-05*-h100-*.json), while at long
        # contexts the rows' K/V re-reads would outweigh the graph's launch savings.
        route = os.environ.get("KVCAP_SPEC_VERIFY", "auto")
        if route not in ("auto", "chunk", "rows"):
            raise ConfigError(f"KVCAP_SPEC_VERIFY must be auto, chunk or rows, got {route!r}")
        self.verify_route = route

    def set_context_classes(self, max_model_len: int) -> None:
        """Eager decode steps on CUDA report the graph context class as their max_seq_len (it
        only drives the split-K choice), whether or not graphs are captured: enforce_eager and
        graph runs then give the same greedy tokens."""
        from kvcap.engine.cuda_graph import context_classes

        if self.device.type == "cuda":
            self.context_classes = context_classes(max_model_len)

    def set_token_buckets(self, max_num_batched_tokens: int) -> None:
        """Eager steps on CUDA with the Triton backend pad their rows to the piecewise graphs'
        token buckets, whether or not those are captured: enforce_eager and graph runs then
        run the same kernels on the same rows (same greedy tokens)."""
        if self.device.type == "cuda" and self.backend.name == "triton":
            params = sum(p.numel() for p in self.model.parameters())
            self.token_buckets = token_buckets(max_num_batched_tokens,
                                               piecewise_max_tokens(params))

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int,
                           num_speculative_tokens: int = 0, piecewise: bool = True) -> None:
        """Capture the decode graphs; with speculative decoding, for the 1 + K decode rows per
        request its drafts are verified as (graph_rows bounds how far). `piecewise`: also the
        piecewise graphs of the other steps (kvcap.engine.piecewise_graph), where the model
        and backend allow them."""
        from kvcap.engine.cuda_graph import DecodeGraphs, graph_rows

        rows = graph_rows(max_num_seqs,
                          num_speculative_tokens if self.verify_route != "chunk" else 0)
        graphs = DecodeGraphs(self.model, self.backend, self.pool, self.device, rows,
                              max_model_len)
        graphs.capture()
        self.graphs = graphs
        if piecewise and self.token_buckets and not piecewise_disabled() \
                and has_pieces(self.model):
            pieces = PiecewiseGraphs(self.model, self.backend, self.pool, self.device,
                                     self.token_buckets, pool_handle=graphs.pool_handle)
            pieces.capture()
            self.piecewise = pieces

    def can_run_ahead(self) -> bool:
        """May the engine launch a step before the previous one's tokens are read? Not while
        anything records per-forward data (a calibration KV observer, a QSA probe or record):
        a step run ahead for a request that then stops would add rows nobody asked for."""
        be = self.backend
        return (self.kv_observer is None and getattr(be, "probe", None) is None
                and getattr(be, "record", None) is None)

    def make_plan(self, chunks, extras: dict[str, RequestExtras]) -> StepPlan:
        """Flatten the scheduler's chunks into the step every tensor-parallel rank runs."""
        plan = StepPlan()
        ids, positions, qlens, seq_lens, tables = (plan.ids, plan.positions, plan.query_lens,
                                                   plan.seq_lens, plan.tables)
        eager_only = drafted = False
        as_rows = None  # the drafts' route, decided at the first chunk with drafts
        for ch in chunks:
            req: Request = ch.request
            start, n = ch.start, ch.num_tokens
            # Only a chunk with prompt rows needs the eager path: a request in decode that
            # asked for prompt logprobs / logits has none, and used to keep the whole batch
            # off the decode graphs until it finished. (Checked before the draft rows' early
            # `continue`: drafts after a prompt's last token, verified as decode rows, lost
            # that token's row of the prompt logits.)
            if start < req.num_prompt_tokens and (
                    req.sampling_params.prompt_logprobs is not None
                    or extras[req.request_id].want_prompt_logits):
                eager_only = True
            if ch.ahead:  # the token is still on the device: `launch` feeds it there
                ids.append(0)
                positions.append(start)
            elif n == 1 or ch.draft:  # decode: the one token, without copying the sequence
                p = len(req.prompt_token_ids)
                ids.append(req.output_token_ids[start - p] if start >= p
                           else req.prompt_token_ids[start])
                if ch.draft:  # then the draft tokens it verifies
                    ids.extend(ch.draft)
                    positions.extend(range(start, start + n))
                    drafted = True
                    if as_rows is None:
                        as_rows = self._draft_rows(chunks)
                    if as_rows:  # one decode row per token (see __init__)
                        qlens.extend([1] * n)
                        seq_lens.extend(range(start + 1, start + n + 1))
                        tables.extend([req.block_ids] * n)
                        continue
                else:
                    positions.append(start)
            else:
                ids.extend(req.token_slice(start, start + n))
                positions.extend(range(start, start + n))
            qlens.append(n)
            seq_lens.append(start + n)
            tables.append(req.block_ids)
        max_q = max(qlens)
        plan.use_graph = (self.graphs is not None and not eager_only
                          and self.kv_observer is None and max_q == 1
                          and self.graphs.can_run(len(qlens), max(seq_lens)))
        if max_q == 1 and not drafted:  # row i is sequence i
            plan.sample_rows = [i for i, ch in enumerate(chunks) if ch.samples]
            ends = None
        else:
            ends = [0]  # each chunk's first row
            for ch in chunks:
                ends.append(ends[-1] + ch.num_tokens)
            # a chunk with drafts samples at every row (its last len(draft) + 1 rows)
            plan.sample_rows = [r for i, ch in enumerate(chunks) if ch.samples
                                for r in range(ends[i + 1] - 1 - len(ch.draft), ends[i + 1])]
        if eager_only and not plan.use_graph:  # teacher-forced logits need the eager path
            if ends is None:
                ends = list(range(len(chunks) + 1))
            for i, ch in enumerate(chunks):
                req = ch.request
                if ch.start >= req.num_prompt_tokens or (
                        not extras[req.request_id].want_prompt_logits
                        and req.sampling_params.prompt_logprobs is None):
                    continue  # (no prompt rows in this chunk)
                end = min(ch.start + ch.num_tokens, req.num_prompt_tokens)
                plan.prompt_rows.append((i, ends[i], ends[i] + end - ch.start))
        return plan

    def _draft_rows(self, chunks) -> bool:
        """Verify this step's drafts as decode rows (else as chunks; see __init__)?"""
        if self.verify_route != "auto":
            return self.verify_route == "rows"
        graphs = self.graphs
        if graphs is None:
            return False
        rows, extra, longest, drafted = 0, 0, 0, 0
        for ch in chunks:
            if ch.num_tokens > 1 and not ch.draft:
                return False  # a prefill chunk: the step runs eagerly whatever the drafts do
            rows += ch.num_tokens
            longest = max(longest, ch.start + ch.num_tokens)
            # rows 1..n-1 each read the context again: (n - 1) x (start + ~n/2) tokens
            extra += (ch.num_tokens - 1) * (ch.start + ch.num_tokens // 2)
            drafted += ch.num_tokens > 1
        spec = self.pool.spec
        if self.sm_count is not None and \
                drafted * spec.num_kv_heads >= SPEC_ROWS_MAX_CHUNK_FILL * self.sm_count:
            return False  # the chunk's attention fills the GPU: its single pass wins
        return (graphs.can_run(rows, longest)
                and extra * spec.values_per_token <= SPEC_ROWS_MAX_EXTRA_KV_VALUES)

    def broadcast_plan(self, plan: StepPlan) -> None:
        """Hook for tensor parallelism: rank 0 sends the plan to the other ranks here."""

    def _forward(self, plan: StepPlan, fed_ids: torch.Tensor | None = None):
        """Hidden states of every row, and the metadata (None on the graph path). `fed_ids`
        (int64 [rows] on the device) replaces the input ids of a step scheduled ahead."""
        t = self.timer
        if plan.use_graph:
            key = self.graphs.prepare(plan.ids, plan.positions, plan.tables)
            if fed_ids is not None:
                self.graphs.input_ids[: len(plan.ids)].copy_(fed_ids, non_blocking=True)
            if t is not None:
                t.mark("prepare")
                t.gpu_event("forward_start")
            return self.graphs.replay(key, len(plan.ids)), None
        n = len(plan.ids)
        # Decode-only steps mirror the decode graphs (batch buckets), so they stay unpadded.
        pad = (bucket_for(self.token_buckets, n)
               if self.token_buckets and max(plan.query_lens) > 1 else None)
        input_ids, pos, meta = self._eager.build(plan, pad_to=pad)
        if fed_ids is not None:
            input_ids[:n].copy_(fed_ids, non_blocking=True)
        if self.context_classes is not None and meta.is_decode_only:
            from kvcap.engine.cuda_graph import context_class

            meta.max_seq_len = context_class(self.context_classes, meta.max_seq_len)
        if t is not None:
            t.mark("prepare")
            t.gpu_event("forward_start")
        if self.piecewise is not None and pad is not None and self.kv_observer is None:
            return self.piecewise.run(input_ids, pos, meta, n), meta
        ctx = ForwardContext(self.backend, self.pool, meta, self.kv_observer)
        return self.model(input_ids, pos, ctx)[:n], meta

    def fed_ids(self, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Input ids of a step scheduled ahead: row i takes `tokens[rows[i]]` (device-side;
        a -1 left for the host becomes 0, and `StepResult.host_fixed` drops that step)."""
        if rows != list(range(tokens.shape[0])):
            src = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
            tokens = tokens.index_select(0, src)
        return tokens.clamp(min=0)

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan, on_prompt_logits: PromptLogitsFn | None = None,
                 fed_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward the plan on this rank. Each teacher-forced logits block [n, V] FP32 goes to
        `on_prompt_logits(chunk_index, logits, first_row)`, at most PROMPT_LOGITS_ROWS rows at
        a time (`first_row`: the block's first row within the chunk); returns the sampled rows'
        logits [S, V] FP32,
        or None when nothing samples (and on every rank but 0 under tensor parallelism, where
        `compute_logits` gathers the vocabulary shards on rank 0 only). A plan scheduled
        ahead (`plan.fed`) takes its input ids from `fed_ids`."""
        if plan.fed and fed_ids is None:
            raise ValueError("a step scheduled ahead needs its input ids on the device")
        hidden, _ = self._forward(plan, fed_ids if plan.fed else None)
        for i, lo, hi in plan.prompt_rows:
            for first in range(lo, hi, PROMPT_LOGITS_ROWS):
                last = min(hi, first + PROMPT_LOGITS_ROWS)
                logits = self.model.compute_logits(hidden[first:last])
                if on_prompt_logits is not None:
                    on_prompt_logits(i, logits, first - lo)
        logits = None
        if len(plan.sample_rows) == len(plan.ids):  # every row samples
            logits = self.model.compute_logits(hidden[: len(plan.ids)])
        elif plan.sample_rows:
            rows = torch.tensor(plan.sample_rows).to(self.device, non_blocking=True)
            logits = self.model.compute_logits(hidden[rows])
        t = self.timer
        if t is not None:
            t.gpu_event("forward_end")
            t.mark("forward")
        return logits

    @torch.inference_mode()
    def execute(self, chunks, extras: dict[str, RequestExtras]) -> StepResult:
        """chunks: the scheduler's ScheduledChunk list (request, start, num_tokens, samples)."""
        return self.finish(self.launch(chunks, extras), extras)

    @torch.inference_mode()
    def launch(self, chunks, extras: dict[str, RequestExtras],
               inflight: PendingStep | None = None) -> PendingStep:
        """Queue the step's forward and sampling without waiting for the device. Chunks
        scheduled `ahead` take their input token from `inflight`'s device tokens."""
        plan = self.make_plan(chunks, extras)
        fed = None
        if any(ch.ahead for ch in chunks):
            if inflight is None or inflight.tokens is None:
                raise ValueError("chunks scheduled ahead need the in-flight step's tokens")
            row_of = {id(r): i for i, r in enumerate(inflight.reqs)}
            fed = self.fed_ids(inflight.tokens, [row_of[id(ch.request)] for ch in chunks])
            plan.fed = True
        for i, _, _ in plan.prompt_rows:
            self._reset_prompt_outputs(chunks[i], extras)
        # Nothing between the broadcast and the forward: under tensor parallelism an exception
        # there (Ctrl-C) would leave the other ranks waiting in the forward's collectives.
        self.broadcast_plan(plan)
        logits = self.run_plan(
            plan, lambda i, lg, row: self._collect_prompt_outputs(chunks[i], extras, lg, row),
            fed)
        sampling = [ch for ch in chunks if ch.samples]
        reqs = [ch.request for ch in sampling]
        # the step index of each row: tokens sampled before it (one more in flight when ahead)
        steps, drafts, ahead_of = None, None, None
        if any(ch.draft for ch in sampling):  # a draft chunk's rows: one per token it samples
            reqs, steps, drafts, ahead_of = [], [], [], []
            for ch in sampling:
                first, base = len(reqs), len(ch.request.output_token_ids)
                reqs += [ch.request] * (1 + len(ch.draft))
                steps += range(base, base + 1 + len(ch.draft))
                ahead_of += [ch.draft[:i] for i in range(1 + len(ch.draft))]
                if ch.draft:
                    drafts.append((first, ch))
        if logits is None:
            return PendingStep(reqs, None, None, None)
        raw = None
        adjust = [j for j, r in enumerate(reqs)
                  if r.sampling_params.adjusts_logits_after(
                      len(r.output_token_ids) + (len(ahead_of[j]) if ahead_of else 0))]
        if adjust:
            raw, logits = logits, self._adjusted(
                logits, [reqs[j] for j in adjust], adjust, extras,
                [ahead_of[j] for j in adjust] if ahead_of else None)
        if all(r.sampling_params.greedy for r in reqs):
            return PendingStep(reqs, logits, self.sampler.sample_greedy(logits),
                               None, raw_logits=raw, drafts=drafts).start_copy()
        batch = SamplingBatch.from_params(
            [r.sampling_params for r in reqs],
            seeds=[extras[r.request_id].seed for r in reqs],
            steps=steps or [len(ch.request.output_token_ids) + ch.ahead for ch in sampling],
            device=self.device,
        )
        return PendingStep(reqs, logits, self.sampler.sample(logits, batch, resolve=False),
                           batch, raw_logits=raw, drafts=drafts).start_copy()

    def _adjusted(self, logits: torch.Tensor, reqs: list[Request], rows: list[int],
                  extras: dict[str, RequestExtras],
                  drafted: list[list[int]] | None = None) -> torch.Tensor:
        """Logits with the listed rows' bias and penalties applied (a copy). The engine does
        not launch ahead for such requests, so their outputs so far are all known. `drafted`:
        per row, the draft tokens before it in its chunk, counted as if already generated."""
        states = []
        for j, r in enumerate(reqs):
            ex = extras[r.request_id]
            if ex.penalties is None:
                sp = r.sampling_params
                ex.penalties = PenaltyState(stops=sorted(set(sp.stop_token_ids) | (
                    set() if sp.ignore_eos else self.eos_token_ids)))
            ex.penalties.update(r.prompt_token_ids, r.output_token_ids)
            states.append(ex.penalties.then(drafted[j]) if drafted and drafted[j]
                          else ex.penalties)
        return adjust_logits(logits, rows, [r.sampling_params for r in reqs], states)

    @torch.inference_mode()
    def finish(self, step: PendingStep, extras: dict[str, RequestExtras]) -> StepResult:
        """Wait for the step's tokens (the one device->host sync) and collect logprobs."""
        if step.tokens is None:
            return StepResult({})
        tokens = step.token_list()
        fixed = False
        if step.batch is not None and min(tokens) < 0:
            rows = [i for i, tok in enumerate(tokens) if tok < 0]
            for i, tok in zip(rows, self.sampler.resolve(step.logits, step.batch, rows),
                              strict=True):
                tokens[i] = tok
            fixed = True
        grammar_rows = [j for j, r in enumerate(step.reqs) if r.sampling_params.structured]
        failed: dict[str, str] = {}
        if grammar_rows and self._constrain(step, extras, tokens, grammar_rows, failed):
            fixed = True
        raw = step.raw_logits if step.raw_logits is not None else step.logits
        self._collect_logprobs(step.reqs, extras, raw, tokens)
        if self.timer is not None:
            self.timer.mark("sample")
        result = StepResult({r.request_id: t for r, t in zip(step.reqs, tokens, strict=True)},
                            host_fixed=fixed, failed=failed)
        for first, ch in step.drafts or ():
            rid = ch.request.request_id
            kept, result.sampled[rid] = accept_draft(
                ch.draft, tokens[first:first + 1 + len(ch.draft)])
            result.accepted[rid] = kept
            if ch.request.sampling_params.logprobs is not None and len(kept) < len(ch.draft):
                del extras[rid].logprobs[len(kept) - len(ch.draft):]  # the rejected rows'
        return result

    def _constrain(self, step: PendingStep, extras: dict[str, RequestExtras],
                   tokens: list[int], rows: list[int], failed: dict[str, str]) -> bool:
        """Structured output's rows: each token that does not continue its request's grammar
        is replaced (kvcap/engine/structured.py); True when any was. A row that nothing
        continues goes into `failed` instead of failing the whole step."""
        if self._structured is None:
            from kvcap.engine.structured import StructuredOutput
            from kvcap.engine.token_bytes import TokenTexts

            self._structured = StructuredOutput(
                TokenTexts(self.tokenizer), self.model.spec.vocab_size, self.eos_token_ids)
        changed = False
        drafts = dict(step.drafts or ())  # first row -> its draft chunk
        past = -1  # rows of a draft chunk already done
        for j in rows:
            if j < past:
                continue
            ex = extras[step.reqs[j].request_id]
            sp = step.reqs[j].sampling_params
            if ex.grammar is None:
                ex.grammar = sp.grammar()
                ex.grammar_state = ex.grammar.start
                if sp.reasoning is not None:
                    ex.reasoning_gate = ReasoningGate(sp.reasoning)
            ch = drafts.get(j)
            past = j + (1 if ch is None else 1 + len(ch.draft))
            try:
                changed |= self._constrain_rows(step, ex, j, ch.draft if ch else [], tokens)
            except NoContinuation as e:
                rid = step.reqs[j].request_id
                logger.error("request %s ended: %s", rid, e)
                failed[rid] = str(e)
        return changed

    def _constrain_rows(self, step: PendingStep, ex: RequestExtras, first: int,
                        draft: list[int], tokens: list[int]) -> bool:
        """One request's rows from `first`: each token chosen from the grammar state (and read
        by the reasoning gate in the state) the tokens before it lead to, as long as they
        follow the draft (the rows after the first that does not are never used, nor read
        by the gate). A token the gate still counts as thinking is free text."""
        changed, state, gate = False, ex.grammar_state, ex.reasoning_gate
        for i in range(len(draft) + 1):
            j = first + i
            if gate is None or gate.admit(bytes(self._structured.texts(tokens[j])[1])):
                tok, state = self._structured.choose(
                    ex.grammar, state, tokens[j], step.logits[j],
                    lambda row, j=j: self._resample(step, j, row))
                changed |= tok != tokens[j]
                tokens[j] = tok
            if i == len(draft) or tokens[j] != draft[i]:
                break
        ex.grammar_state = state
        return changed

    @staticmethod
    def _resample(step: PendingStep, j: int, row: torch.Tensor) -> int:
        """Row j's token from `row` (its logits with some tokens masked) under its own
        sampling parameters and random numbers."""
        b = step.batch
        if b is None or step.reqs[j].sampling_params.greedy:
            return int(Sampler.sample_greedy(row[None])[0])
        sl = slice(j, j + 1)
        return int(reference_sample(row[None], b.temperature[sl], b.top_k[sl], b.top_p[sl],
                                    b.min_p[sl], b.rng[sl], compact=True)[0])

    @staticmethod
    def _reset_prompt_outputs(ch, extras: dict[str, RequestExtras]) -> None:
        if ch.start == 0:  # (re)started from scratch, e.g. after preemption
            ex = extras[ch.request.request_id]
            ex.prompt_logits.clear()
            ex.prompt_logprobs = [None]

    def _collect_prompt_outputs(self, ch, extras: dict[str, RequestExtras],
                                logits: torch.Tensor, first_row: int = 0) -> None:
        """Teacher-forced logits [n, V] of a chunk's prompt rows from `first_row` on, as its
        request asked."""
        req: Request = ch.request
        ex = extras[req.request_id]
        n_lp = req.sampling_params.prompt_logprobs
        start = ch.start + first_row
        end = start + logits.shape[0]
        if ex.want_prompt_logits:
            ex.prompt_logits.append(logits.cpu())
        if n_lp is not None:
            # logits at position p predict prompt token p+1
            nxt = req.prompt_token_ids[start + 1:end + 1]
            ex.prompt_logprobs += logprob_dicts(logits[: len(nxt)], nxt, [n_lp] * len(nxt))

    def _collect_logprobs(self, reqs, extras, logits, tokens) -> None:
        want = [(j, r) for j, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
        if not want:
            return
        rows = [j for j, _ in want]
        sel = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
        dicts = logprob_dicts(logits.index_select(0, sel), [tokens[j] for j in rows],
                              [r.sampling_params.logprobs for _, r in want])
        for (_, r), d in zip(want, dicts, strict=True):
            extras[r.request_id].logprobs.append(d)
