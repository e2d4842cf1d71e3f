"""Continuous-batching scheduler with chunked prefill and preemption by recompute. Pure Python.

Every `schedule()` call fills one step under a token budget (`max_num_batched_tokens`):

1. Running requests, oldest arrival first. A request in decode gets 1 token; one still in
   prefill (or recomputing after preemption) gets its next chunk, `min(remaining, budget)`.
   If its blocks cannot be allocated, the NEWEST running request is preempted by recompute
   (blocks freed, `num_computed_tokens = 0`, status PREEMPTED, front of the waiting queue) until
   they can; if the newest is the request itself, it is preempted and the loop moves on. A
   request that cannot fit even with the whole pool to itself is finished (`finished_early`).
2. If nothing was preempted this step: admit waiting requests FCFS while the budget and
   `max_num_seqs` allow and, while other requests run, the new request's whole prompt fits in
   the free blocks with a watermark to spare (1% of the pool, at least one block per running
   request): starting a prefill that the running decodes would soon preempt only burns
   compute (recompute churn on small pools). With nothing running, a request may use the whole
   pool. Admission looks up the prefix cache (cached full blocks are shared and
   not recomputed; at least one token is always computed so the model yields logits; requests
   asking for prompt_logprobs skip the lookup) and schedules the first chunk, clipped to the
   budget and to the free blocks. A request whose tokens need more blocks than the whole pool
   is finished with an error reason instead.

Speculative decoding (a `proposer`, kvcap/engine/ngram.py): a running request in decode whose
sampling allows it gets draft tokens after its last one, as many as the proposer finds and the
budget, max_tokens, max_model_len and the free blocks (beyond one per running request) leave
room for. Drafts come last (`_add_drafts`): from the budget that the running requests' next
tokens and the admitted prompts left, so they never delay a running request or an admission,
and never cause a preemption. Its chunk is the last token plus the drafts, and
`update_from_output` takes the drafts the model kept plus one sampled token.

A chunk covers `request.all_token_ids[start:start + num_tokens]` at positions
`start .. start + num_tokens - 1`, with `request.block_ids` as its block table; `samples` is True
when the chunk ends at the last known token, so the model's last-row logits sample a new token.

`update_from_output(output, sampled)` advances `num_computed_tokens`, appends sampled tokens,
applies stop conditions (stop_token_ids, EOS unless ignore_eos, max_tokens, max_model_len),
registers newly full blocks in the prefix cache, releases (with a model whose every layer slides)
the blocks behind the next query's window, frees finished requests and returns them. With such a
window a request needs at most `BlockManager.peak_blocks` blocks, not its whole length, to be
admitted or to fit the pool. Stop
strings need detokenized text: the engine calls `finish_request(req, status, reason)` for those.
Never-fit requests finish with status FINISHED_ABORTED and `stop_reason` starting "error: ".
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvcap.engine.block_manager import BlockManager
from kvcap.engine.ngram import NgramProposer
from kvcap.engine.request import Request, RequestStatus
from kvcap.errors import ConfigError
from kvcap.kv_cache.spec import admission_watermark

logger = logging.getLogger(__name__)


class SchedulerConfig(Protocol):
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    block_size: int


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # == request.num_computed_tokens when scheduled
    num_tokens: int
    samples: bool  # chunk reaches the last known token: sample from its last row
    # Scheduled ahead (`Scheduler.schedule_ahead`): the chunk's one token is the one the step
    # still in flight samples, so it is not in `request.output_token_ids` yet.
    ahead: bool = False
    # Speculative decoding: tokens proposed to follow the request's last one (not in its
    # outputs yet). The chunk is that last token plus these, `num_tokens == 1 + len(draft)`,
    # and every row samples: the model keeps the drafts it would have produced itself.
    draft: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished_early: list[Request] = field(default_factory=list)  # never fits in the pool

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_ids: Iterable[int] = (), proposer: NgramProposer | None = None):
        if config.max_model_len is None:
            raise ConfigError("max_model_len must be resolved before building the Scheduler")
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if config.block_size != block_manager.block_size:
            raise ConfigError(f"block_size {config.block_size} differs from the block "
                              f"manager's {block_manager.block_size}")
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len: int = config.max_model_len
        self.block_manager = block_manager
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival order
        self._order: dict[str, int] = {}  # request_id -> arrival sequence number
        self._next_order = 0
        # Speculative decoding (None: off; swapping it turns drafting on or off). The engine
        # clears `speculate` while something records per forward (calibration, QSA probes):
        # drafts would add rows to it.
        self.proposer = proposer
        self.speculate = True
        self.draft_max_batch = getattr(config, "speculative_disable_by_batch_size", None)

    # ----------------------------------------------------------------- queues
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, req: Request) -> None:
        if req.request_id in self._order:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.num_prompt_tokens < 1:
            raise ConfigError(f"request {req.request_id}: the prompt is empty")
        if req.num_tokens > self.max_model_len:
            raise ConfigError(f"request {req.request_id}: prompt of {req.num_tokens} tokens is "
                              f"longer than max_model_len={self.max_model_len}")
        req.status = RequestStatus.WAITING
        self._order[req.request_id] = self._next_order
        self._next_order += 1
        self.waiting.append(req)

    def _find(self, request_id: str) -> Request | None:
        for req in self.running:
            if req.request_id == request_id:
                return req
        for req in self.waiting:
            if req.request_id == request_id:
                return req
        return None

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request; False if unknown or already finished."""
        req = self._find(request_id)
        if req is None:
            return False
        self.finish_request(req, RequestStatus.FINISHED_ABORTED, "abort")
        return True

    def finish_request(self, req: Request, status: RequestStatus,
                       reason: str | int | None = None) -> None:
        """Finish `req` (stop string, abort, error): leave the queues and free its blocks."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        if req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)
        req.status = status
        req.stop_reason = reason
        self._order.pop(req.request_id, None)
        if self.proposer is not None:
            self.proposer.forget(req.request_id)

    # ----------------------------------------------------------------- scheduling
    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        logger.info("preempted request %s (recompute; %d tokens)", req.request_id, req.num_tokens)

    def _peak_blocks(self, req: Request) -> int:
        return self.block_manager.peak_blocks(req.num_tokens, self.max_num_batched_tokens)

    def _never_fits(self, req: Request, out: SchedulerOutput) -> None:
        bm = self.block_manager
        reason = (f"error: request needs {self._peak_blocks(req)} KV blocks for "
                  f"{req.num_tokens} tokens but the pool has {bm.num_total_blocks}")
        logger.warning("finishing request %s: %s", req.request_id, reason)
        self.finish_request(req, RequestStatus.FINISHED_ABORTED, reason)
        out.finished_early.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        i = 0
        bs = bm.block_size
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            computed, total = req.num_computed_tokens, req.num_tokens
            n = min(total - computed, budget)
            assert n >= 1, f"running request {req.request_id} has nothing to compute"
            # (the common decode case: the new tokens fit the blocks already held)
            while computed + n > len(req.block_ids) * bs and not bm.ensure_slots(req, n):
                victim = self.running[-1]
                if victim is not req:
                    self._preempt(victim, out)
                elif i == 0:  # alone with the whole pool and still too big
                    self._never_fits(req, out)
                    break
                else:
                    self._preempt(req, out)
                    break
            else:
                out.chunks.append(ScheduledChunk(req, computed, n, computed + n == total))
                budget -= n
                i += 1
        if not out.preempted:
            budget = self._admit(out, budget)
        if self.proposer is not None and self.speculate and budget > 0 and (
                self.draft_max_batch is None or len(self.running) <= self.draft_max_batch):
            self._add_drafts(out, budget)
        return out

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Drafts come last, from what every running request's next tokens and the admitted
        prompts left of the budget: speculative work never delays real work. Each chunk that
        ends at its request's last token and computes only that one gets the drafts found."""
        for ch in out.chunks:
            if budget <= 0:
                return
            if ch.num_tokens == 1 and ch.samples:
                draft = self._draft(ch.request, budget + 1)  # (its own token is counted)
                if draft:
                    ch.draft = draft
                    ch.num_tokens += len(draft)
                    budget -= len(draft)

    def _draft(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a request in decode, with the blocks to verify them taken, or none:
        only as many as `budget` (this request's share of the step's tokens), max_tokens and
        max_model_len leave room for if all are accepted, and never at the cost of preempting
        anything: drafts take only free blocks beyond one per running request (each may need
        one for its next token)."""
        sp = req.sampling_params
        out = len(req.output_token_ids)
        bm = self.block_manager
        spare = max(0, bm.num_free_blocks - len(self.running))
        fits = (len(req.block_ids) + spare) * bm.block_size - req.num_computed_tokens - 1
        room = min(budget - 1, sp.max_tokens - out - 1, self.max_model_len - req.num_tokens - 1,
                   fits)
        draft = self.proposer.propose(req, room) if room > 0 else []
        if draft and not bm.ensure_slots(req, 1 + len(draft)):
            raise AssertionError(f"request {req.request_id}: free blocks vanished")
        return draft

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests FCFS (see the module doc); returns the budget left."""
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self._peak_blocks(req) > bm.num_total_blocks:
                self._never_fits(req, out)
                continue
            # Prompt logprobs need logits at every prompt position: no prefix-cache skipping.
            use_cache = not req.needs_all_prompt_rows
            if self.running and not self._leaves_headroom(req, use_cache):
                break  # it waits for blocks to free up
            if not bm.allocate_prompt(req, use_cache):
                break
            bm.release_behind(req)  # (a cached prefix longer than the window)
            start = req.num_computed_tokens
            fits = (len(req.block_ids) + bm.num_free_blocks) * bm.block_size - start
            n = min(req.num_tokens - start, budget, fits)
            # (not inside an assert: `python -O` strips asserts, and the chunk had no blocks)
            if n < 1 or not bm.ensure_slots(req, n):
                raise AssertionError(f"request {req.request_id}: free blocks vanished")
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            keys = [self._order[r.request_id] for r in self.running]
            self.running.insert(bisect.bisect(keys, self._order[req.request_id]), req)
            out.chunks.append(ScheduledChunk(req, start, n, start + n == req.num_tokens))
            budget -= n
        return budget

    def _leaves_headroom(self, req: Request, use_prefix_cache: bool) -> bool:
        """Once `req` took blocks for its whole prompt, would the watermark (1% of the pool,
        at least one block per running request) stay free?"""
        bm = self.block_manager
        watermark = admission_watermark(bm.num_total_blocks, len(self.running))
        need = bm.blocks_to_admit(req, use_prefix_cache, self.max_num_batched_tokens)
        return bm.num_free_blocks - need >= watermark

    def schedule_ahead(self, inflight: SchedulerOutput) -> SchedulerOutput | None:
        """The next step, scheduled while `inflight` still runs (its tokens are unknown), or
        None when it cannot be planned without them.

        Only the steady decode state qualifies: every running request sampled in `inflight`
        and nothing waiting could be admitted instead (the queue is empty or `max_num_seqs` is
        reached), so the result is what `schedule()` would return after the update, less the
        requests that surely finish by length. Each chunk is one `ahead` token at position
        `start + num_tokens` of its in-flight chunk; a request that stops on that sampled
        token (EOS, stop token or string, abort) has its ahead chunk skipped by
        `update_from_output`. Needs no preemption: if a new block is not free, returns None.
        """
        if inflight.preempted or inflight.finished_early:
            return None
        if self.waiting and len(self.running) < self.max_num_seqs:
            return None
        if len(inflight.chunks) != len(self.running) or not all(
                c.samples and not c.draft for c in inflight.chunks):
            return None
        bm, bs = self.block_manager, self.block_manager.block_size
        chunks: list[ScheduledChunk] = []
        grow: list[tuple[Request, int]] = []  # (request, new tokens its blocks must cover)
        for c in inflight.chunks:
            req = c.request
            if req.is_finished or req.num_computed_tokens != c.start:
                return None
            after = req.num_tokens + 1  # tokens once the in-flight step's sample is appended
            if (len(req.output_token_ids) + 1 >= req.sampling_params.max_tokens
                    or after >= self.max_model_len):
                continue  # finishes by length on the in-flight token
            pos = c.start + c.num_tokens
            if pos + 1 > len(req.block_ids) * bs:
                grow.append((req, c.num_tokens + 1))
            chunks.append(ScheduledChunk(req, pos, 1, True, ahead=True))
        if not chunks or len(chunks) > self.max_num_batched_tokens:
            return None
        if len(grow) > bm.num_free_blocks:  # each needs one block at most
            return None
        for req, n in grow:
            if not bm.ensure_slots(req, n):
                raise AssertionError(f"request {req.request_id}: free block vanished")
        return SchedulerOutput(chunks=chunks)

    # ----------------------------------------------------------------- results
    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int],
                           accepted: dict[str, list[int]] | None = None) -> list[Request]:
        """Apply one executed step; return the requests that finished in it. `accepted`: for
        chunks with drafts, the drafts the model kept (a prefix of them, maybe empty); the
        sampled token follows them."""
        finished: list[Request] = []
        for chunk in output.chunks:
            req = chunk.request
            if req.is_finished:  # aborted while the step ran
                continue
            assert req.num_computed_tokens == chunk.start, "chunk applied twice or out of order"
            if chunk.draft:
                if self._apply_draft(req, chunk, sampled, accepted or {}):
                    finished.append(req)
                continue
            req.num_computed_tokens += chunk.num_tokens
            if chunk.samples:
                if req.request_id not in sampled:
                    raise ValueError(f"no sampled token for request {req.request_id}")
                req.output_token_ids.append(int(sampled[req.request_id]))
            self.block_manager.commit_full_blocks(req)
            self.block_manager.release_behind(req)
            if chunk.samples:
                stop = self._check_stop(req)
                if stop is not None:
                    self.finish_request(req, *stop)
                    finished.append(req)
        return finished

    def _apply_draft(self, req: Request, chunk: ScheduledChunk, sampled: dict[str, int],
                     accepted: dict[str, list[int]]) -> bool:
        """A verified draft chunk: the kept drafts then the sampled token join the output, one
        at a time with the stop checks (a stop drops the tokens after it). Only the fed token
        and the kept drafts have valid K/V: the rejected drafts' rows in the cache are
        overwritten later. True when the request finished."""
        rid = req.request_id
        if rid not in sampled:
            raise ValueError(f"no sampled token for request {rid}")
        kept = accepted.get(rid, [])
        if kept != chunk.draft[:len(kept)]:
            raise ValueError(f"request {rid}: accepted tokens are not a prefix of its draft")
        req.num_computed_tokens += 1 + len(kept)
        stop = None
        for tok in (*kept, int(sampled[rid])):
            req.output_token_ids.append(int(tok))
            stop = self._check_stop(req)
            if stop is not None:
                break
        # (after a stop the last token's K/V is not needed, as on the one-token path)
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        self.block_manager.commit_full_blocks(req)
        self.block_manager.release_behind(req)
        if stop is not None:
            self.finish_request(req, *stop)
            return True
        return False

    def _check_stop(self, req: Request) -> tuple[RequestStatus, str | int | None] | None:
        params = req.sampling_params
        token = req.output_token_ids[-1]
        may_stop = len(req.output_token_ids) > params.min_tokens  # (masked below it)
        if may_stop and token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if len(req.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None
