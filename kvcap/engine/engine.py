"""The engine loop: schedule -> run the model -> sample -> update, one `step()` at a time.

Overlap (on by default on CUDA, `KVCAP_DISABLE_OVERLAP=1` turns it off): in the steady decode
state the next step is scheduled and queued on the GPU *before* the current step's tokens are
read back (`Scheduler.schedule_ahead`; its input ids are copied on the device from the tokens
being sampled), so the host's update, detokenization, scheduling and input preparation run
while the GPU computes instead of between steps. A request that stops on a token the GPU has
already run ahead of costs one discarded row. Outputs are identical to the serial loop.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch

from kvcap.config import env_flag, is_integral
from kvcap.engine.block_manager import BlockManager
from kvcap.engine.detokenizer import IncrementalDetokenizer
from kvcap.engine.model_runner import ModelRunner, PendingStep, RequestExtras
from kvcap.engine.prefix_view import PrefixView
from kvcap.engine.request import Request, RequestStatus
from kvcap.engine.scheduler import Scheduler, SchedulerOutput
from kvcap.errors import ConfigError
from kvcap.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Speculative decoding: the most steps run ahead in a row while the proposer finds no drafts.
MAX_AHEAD_WITHOUT_DRAFTS = 8


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # lists in a final output; read-only views (PrefixView: len, index, slice, iterate, ==)
    # in the outputs of a streamed request that is still running
    token_ids: list[int] | PrefixView
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, float]] | PrefixView | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logits: torch.Tensor | None = None  # [num_prompt_tokens, V] when asked for
    error: str | None = None


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer, block_manager: BlockManager,
                 scheduler: Scheduler, max_model_len: int, seed: int = 0):
        self.runner, self.tokenizer = runner, tokenizer
        self.block_manager, self.scheduler = block_manager, scheduler
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.extras: dict[str, RequestExtras] = {}
        self._rng = random.Random(seed)
        self._truncated: dict[str, str] = {}  # text cut at a stop string
        self._stop_scanned: dict[str, int] = {}  # text length already searched for stops
        # text length under min_tokens: a stop string must end past it (vLLM passes that text over)
        self._stop_floor: dict[str, int] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.timer = None  # kvcap.engine.timing.StepTimer while step timing is on
        # Queue the next decode step before reading this one's tokens (see the module doc), when
        # nothing records per forward (`ModelRunner.can_run_ahead`); under tensor parallelism
        # rank 0 broadcasts the fed ids. On CPU the ops are synchronous, so it would only cost.
        # Speculative decoding plans drafts from the tokens of the step before, so a step with
        # drafts is never run ahead of; and a step run ahead cannot draft. While the proposer
        # finds nothing (free text), that would lose the overlap for nothing (0.7x on the H100,
        # docs/benchmarks/speculative-2026-12-05b-h100-rows.json), so after a scheduled step
        # without drafts up to `_ahead_limit` steps run ahead before the proposer looks again:
        # 1, 2, 4 ... MAX_AHEAD_WITHOUT_DRAFTS while it keeps finding nothing, 0 once it finds.
        self.overlap = runner.device.type == "cuda" and not env_flag("KVCAP_DISABLE_OVERLAP")
        self._ahead: tuple[SchedulerOutput, PendingStep] | None = None
        self._ahead_limit = 0  # speculative decoding: steps that may run ahead in a row ...
        self._ahead_run = 0  # ... and those that did since the proposer last looked
        self.num_steps_ahead = 0  # steps launched ahead of their input tokens
        self._attention_mode: str | None = None  # the backend's, at the last step (QSA)
        self.num_ahead_dropped = 0  # of which dropped (a host-sampled token fed them)
        self.num_draft_tokens = 0  # speculative decoding: drafts verified ...
        self.num_accepted_tokens = 0  # ... and kept

    def set_timer(self, timer) -> None:
        """Attach (or with None detach) a StepTimer that records each step's phases."""
        self.timer = timer
        self.runner.timer = timer

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, want_prompt_logits: bool = False,
                    stream: bool = True) -> None:
        """Queue a request. `stream`: `step()` returns its output after every step it takes
        part in; False, only once it has finished (no per-step copy of a long output and no
        detokenizing along the way: what a caller that waits for the end wants)."""
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):  # (an AttributeError further down)
            raise ConfigError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt_token_ids, list):
            # a tuple or a numpy array of ids: `not array` below raised numpy's "truth value
            # of an array is ambiguous"
            try:
                prompt_token_ids = list(prompt_token_ids)
            except TypeError:
                raise ConfigError(f"prompt token ids must be a list of integers, got "
                                  f"{type(prompt_token_ids).__name__}") from None
        if not prompt_token_ids:
            raise ConfigError("the prompt is empty")
        # Integers only (numpy's too): 3.0 and True pass the range check below, and a float
        # then crashed every later step inside the prefix-cache hashing (the request stayed at
        # the head of the queue); True was read as token 1.
        if not all(type(t) is int for t in prompt_token_ids):  # (plain ints: one pass)
            if not all(is_integral(t) for t in prompt_token_ids):
                raise ConfigError("prompt token ids must be integers")
            prompt_token_ids = [int(t) for t in prompt_token_ids]
        vocab = self.runner.model.spec.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ConfigError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.logit_bias or {}):
            raise ConfigError(f"logit_bias token ids must be in [0, {vocab})")
        # (masked by index under min_tokens: one past the vocabulary would fail the step)
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ConfigError(f"stop_token_ids must be in [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ConfigError(
                f"prompt of {len(prompt_token_ids)} tokens does not fit the context: "
                f"max_model_len is {self.max_model_len} (prompt + at least 1 new token)"
            )
        params.validate()
        if params.structured and self.tokenizer is None:
            raise ConfigError("structured output (json_object, json_schema, choice) needs the "
                              "model's tokenizer (dummy weights have none)")
        req = Request(request_id, list(prompt_token_ids), params,
                      needs_all_prompt_rows=want_prompt_logits)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        self.extras[request_id] = RequestExtras(seed=seed, want_prompt_logits=want_prompt_logits,
                                                stream=stream)
        self.requests[request_id] = req
        self.scheduler.add_request(req)

    def abort_request(self, request_id: str) -> bool:
        ok = self.scheduler.abort_request(request_id)
        if self._ahead is not None and all(c.request.is_finished for c in self._ahead[0].chunks):
            # nothing left to read it for: with no request unfinished the loop goes idle, and
            # the stale step would hold back the next request's first step by one
            self._drop_ahead()
        return ok

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    # --- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return outputs of requests that progressed or finished."""
        timer = self.timer
        if timer is not None:
            timer.begin()
        self._follow_attention_mode()
        stale: set[int] = set()  # requests that stopped after this step was launched ahead
        if self._ahead is not None:  # scheduled and launched by the previous call
            out, pending = self._ahead
            self._ahead = None
            stale = {id(c.request) for c in out.chunks if c.request.is_finished}
        else:
            if self.scheduler.proposer is not None:  # no drafts while forwards are recorded
                self.scheduler.speculate = self.runner.can_run_ahead()
            out = self.scheduler.schedule()
            pending = None
            if self.scheduler.proposer is not None:
                self._ahead_run = 0
                self._ahead_limit = (0 if any(c.draft for c in out.chunks)
                                     else min(max(1, 2 * self._ahead_limit),
                                              MAX_AHEAD_WITHOUT_DRAFTS))
        if timer is not None:
            timer.mark("schedule")
        finished: list[Request] = list(getattr(out, "finished_early", []))
        touched: list[Request] = []
        if out.chunks:
            # Exceptions propagate: calibration aborts (non-finite activations) and tensor-
            # parallel failures must stop the caller; the server fails the affected requests.
            try:
                if pending is None:
                    pending = self.runner.launch(out.chunks, self.extras)
                if self._may_look_ahead(out):
                    nxt = self.scheduler.schedule_ahead(out)
                    if nxt is not None:
                        self._ahead = (nxt, self.runner.launch(nxt.chunks, self.extras, pending))
                        self.num_steps_ahead += 1
                        self._ahead_run += 1
                result = self.runner.finish(pending, self.extras)
            except BaseException:
                self._drop_ahead()  # planned on this step's tokens, which never arrived
                raise
            if result.host_fixed and self._ahead is not None:
                self._drop_ahead()  # it was fed a placeholder for a host-sampled token
                self.num_ahead_dropped += 1
            for rid, why in result.failed.items():  # ended alone, with the reason as error
                req = self.requests[rid]  # (update_from_output passes over them)
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED,
                                              f"error: {why}")
                finished.append(req)
            finished += self.scheduler.update_from_output(out, result.sampled, result.accepted)
            if timer is not None:
                timer.mark("update")
            touched = [ch.request for ch in out.chunks
                       if ch.samples and id(ch.request) not in stale]
        drafted: dict[str, int] = {}  # requests that took drafts: output length before
        for ch in out.chunks if self.scheduler.proposer is not None else ():
            if ch.draft:
                self.num_draft_tokens += len(ch.draft)
                self.num_accepted_tokens += len(result.accepted.get(ch.request.request_id, ()))
                drafted[ch.request.request_id] = ch.start + 1 - ch.request.num_prompt_tokens
        for req in touched:
            # One that max_tokens or max_model_len ended on this step's token is searched too:
            # a stop string that token completes is a stop, as on any earlier token (vLLM
            # checks stop strings before the length limit). It is in `finished` already. So is
            # one that a stop token among this step's kept drafts ended: a stop string an
            # earlier token of the step completes ends it there, as one-token steps would.
            if not req.is_finished or req.status == RequestStatus.FINISHED_LENGTH or (
                    req.status == RequestStatus.FINISHED_STOPPED
                    and req.request_id in drafted):
                was_finished = req.is_finished
                self._check_stop_strings(req, drafted.get(req.request_id))
                if req.is_finished and not was_finished:
                    finished.append(req)
        if self._ahead is not None and all(c.request.is_finished for c in self._ahead[0].chunks):
            self._drop_ahead()  # every request it ran ahead for has stopped
        outputs = {r.request_id: self._output(r) for r in touched
                   if r.is_finished or self.extras[r.request_id].stream}
        for r in finished:
            if r.request_id not in outputs:  # touched ones were output in their final state
                outputs[r.request_id] = self._output(r)
            self._forget(r)
        for rid in self._aborted_ids():
            r = self.requests.get(rid)
            if r is not None:
                outputs[rid] = self._output(r)
                self._forget(r)
        if timer is not None:
            timer.mark("output")
            timer.end(num_seqs=len(out.chunks),
                      decode_only=bool(out.chunks) and all(c.num_tokens == 1 for c in out.chunks),
                      context_tokens=sum(c.start + c.num_tokens for c in out.chunks))
        return list(outputs.values())

    def _may_look_ahead(self, out: SchedulerOutput) -> bool:
        # Logprobs are read back after this step's tokens, and that read would queue behind a
        # step launched ahead, waiting for it; penalties count every token generated before
        # the step, which a step launched ahead does not know yet (min_tokens only needs the
        # count, but is kept simple), and structured output may replace a token on the host: no
        # overlap while a request asks for any of them.
        # (a step with drafts left the limit at 0: none runs ahead of it)
        # min_tokens: the step ahead is launched before this step's token is appended, so the
        # runner decides whether to mask stop tokens from the output count known now, one
        # short of the real one: look ahead only where that count masks nothing (else the
        # token at index min_tokens, which may stop, was masked once more).
        if self.scheduler.proposer is not None and self._ahead_run >= self._ahead_limit:
            return False  # the proposer looks at the next step's tokens first
        # A step run ahead is dropped and run again when a row of this one comes back to the
        # host sampler (the fused sampler does so only in batches with top-p); QSA's min/max
        # bounds keep the keys the dropped step wrote (its placeholder token's among them), so
        # under such a backend no look-ahead while a request samples with top-p.
        folds = getattr(self.runner.backend, "folds_every_key", False)
        return (self.overlap and self.runner.can_run_ahead() and not any(
            c.request.sampling_params.logprobs is not None
            or c.request.sampling_params.structured
            or c.request.sampling_params.adjusts_logits_after(len(c.request.output_token_ids))
            or (folds and c.request.sampling_params.top_p < 1.0)
            for c in out.chunks))

    def _drop_ahead(self) -> None:
        """Forget the step launched ahead: its device work finishes unread (stream order keeps
        it before anything that reuses its blocks); the scheduler plans that token again."""
        self._ahead = None

    def _aborted_ids(self) -> list[str]:
        return [rid for rid, r in self.requests.items()
                if r.status == RequestStatus.FINISHED_ABORTED]

    def _check_stop_strings(self, req: Request, before: int | None = None) -> None:
        """Finish `req` at the first stop string in its text. `before`: its output length
        before this step when the step added several tokens (kept drafts): the output stops
        where one-token steps would have stopped it, and the tokens after are dropped, as
        one-token steps never made them."""
        stops = req.sampling_params.stop
        if not stops:
            return
        text = self._decode(req)
        # Search only text that can hold a stop string not seen before: from where the last
        # search ended, less the longest stop string (it may straddle the boundary) and a few
        # characters the detokenizer may still rewrite. Linear in the output's length; text
        # generated under min_tokens is passed over, as vLLM does: a stop string must end past
        # it (the look-back above found one that lay wholly in it once min_tokens was reached).
        rid = req.request_id
        longest = max(map(len, stops))
        start = max(0, self._stop_scanned.get(rid, 0) - longest - 3)
        self._stop_scanned[rid] = len(text)
        # Kept drafts: when the step's last token ends mid-character the detokenizer keeps all
        # of the step's text back, where one-token steps released each earlier token's: `text`
        # may then lack a stop string (the next step found it, the tokens after it kept) or
        # part of the text under min_tokens. Such a step is searched token by token too.
        detok = self._detok.get(rid)
        held = (before is not None and not req.is_finished and detok is not None
                and detok.pending(req.output_token_ids))
        under = len(req.output_token_ids) < req.sampling_params.min_tokens
        if under and not held:
            # (never less than a step of kept drafts found: its kept-back text may still lag
            # behind the text one-token steps had released by now)
            self._stop_floor[rid] = max(self._stop_floor.get(rid, 0), len(text))
            return
        floor = self._stop_floor.get(rid, 0)
        hits = [] if under else _stop_hits(text, stops, start, floor)
        if not hits and not held:
            return
        found = None
        # (no stop in the step's text and none of it kept back: none in any shorter text)
        if before is not None:
            found, start, m, floor = self._stop_before_last(req, before, start, longest)
            # the text the step's tokens under min_tokens made: later searches pass it over
            # too (left stale, the next step's look-back stopped on a string inside it)
            self._stop_floor[rid] = floor
            if found is not None:
                self._drop_after_stop(req, m)
                # the text it was found in (the step's `text` may be kept back: see above)
                text = detok.decode(req.output_token_ids)
            elif req.status == RequestStatus.FINISHED_STOPPED:
                return  # a stop token ended it before a one-token step's last search
            else:  # the step's last token searched as a one-token step would, from `start`
                hits = [] if under else _stop_hits(text, stops, start, floor)
                if not hits:
                    return
        idx, s = found if found is not None else min(hits)
        keep = len(s) if req.sampling_params.include_stop_str_in_output else 0
        self._truncated[rid] = text[:idx + keep]
        if req.is_finished:  # ended by length or a stop token: its blocks are freed already
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, s
        else:
            self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED, s)

    def _follow_attention_mode(self) -> None:
        """Prefix-cached blocks hold K/V computed under one attention: when the backend's
        mode changes between steps (QSA's rollback switch, KVCAP_DISABLE_QSA), forget them, so
        no later request reuses K/V of the other mode through a prefix hit."""
        mode_of = getattr(getattr(self.runner, "backend", None), "attention_mode", None)
        if mode_of is None:
            return
        mode = mode_of()
        if self._attention_mode is not None and mode != self._attention_mode:
            self.block_manager.reset_prefix_cache()
        self._attention_mode = mode

    def _stop_before_last(self, req: Request, before: int, start: int, longest: int
                          ) -> tuple[tuple[int, str] | None, int, int, int]:
        """The searches one-token steps would have made after each of this step's tokens but
        the last (each from where the one before ended, none under min_tokens): the first
        stop string found, (offset, string), where it starts its search, the output length
        m it was found at and the text length under min_tokens; else None, where the last
        token's search starts, len(output) and that length.
        One decode per new token, only in steps whose text holds a stop string."""
        ids = req.output_token_ids
        sp = req.sampling_params
        rid = req.request_id
        detok = self._detok[rid]  # (made by the _decode that gave the step's text)
        floor = self._stop_floor.get(rid, 0)
        for m in range(before + 1, len(ids)):
            # as the detokenizer renders the output: offsets are into that text (a plain
            # decode drops a SentencePiece output's first space, one character off)
            text = detok.decode(ids[:m])
            if detok.holds_back(ids[:m], text):
                # a one-token step kept this text back (it ends mid-character): it searched
                # nothing new here, and found a stop string this token completed one token later
                continue
            if m < sp.min_tokens:
                floor = len(text)
            elif hits := _stop_hits(text, sp.stop, start, floor):
                return min(hits), start, m, floor
            start = max(0, len(text) - longest - 3)
        return None, start, len(ids), floor

    def _drop_after_stop(self, req: Request, m: int) -> None:
        """Cut the output after its m-th token (the one that completed a stop string): one-
        token steps never made the tokens after it."""
        del req.output_token_ids[m:]

    def _decode(self, req: Request) -> str:
        if self.tokenizer is None:  # token ids only: the text stays empty
            return ""
        p = req.sampling_params
        detok = self._detok.get(req.request_id)
        if detok is None:
            detok = self._detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=p.skip_special_tokens)
        if req.is_finished:
            ids = req.output_token_ids
            # a stop token (EOS or stop_token_ids) ends the output without its text, as a stop
            # string does, unless asked for (as vLLM does; OpenAI's stop never shows)
            stopped_by_token = (req.status == RequestStatus.FINISHED_STOPPED
                                and not isinstance(req.stop_reason, str))
            if stopped_by_token and not p.include_stop_str_in_output:
                ids = ids[:-1]
            return detok.finish(ids)
        return detok.update(req.output_token_ids)

    def _output(self, req: Request) -> RequestOutput:
        ex = self.extras[req.request_id]
        text = self._truncated.get(req.request_id)
        if text is None:
            text = self._decode(req)
        p = req.sampling_params
        done = req.is_finished
        reason = req.stop_reason
        err = reason if done and isinstance(reason, str) and reason.startswith("error:") \
            else None
        # while running, views of the request's own lists (O(1) per step; see prefix_view);
        # logprobs as many as tokens (a stop among kept drafts may have cut the tokens)
        n = len(req.output_token_ids)
        lps = None
        if p.logprobs is not None:
            lps = ex.logprobs[:n] if done else PrefixView(ex.logprobs, min(n, len(ex.logprobs)))
        own = list if done else PrefixView
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=own(req.output_token_ids),
            text=text,
            finished=done,
            finish_reason=req.status.value if done else None,
            logprobs=lps,
            prompt_logprobs=list(ex.prompt_logprobs) if p.prompt_logprobs is not None else None,
            prompt_logits=(torch.cat(ex.prompt_logits) if ex.want_prompt_logits
                           and ex.prompt_logits else None),
            error=err,
        )

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self.extras.pop(req.request_id, None)
        self._truncated.pop(req.request_id, None)
        self._stop_scanned.pop(req.request_id, None)
        self._stop_floor.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)

    def sync(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)


def _stop_hits(text: str, stops: list[str], start: int, floor: int) -> list[tuple[int, str]]:
    """(offset, string) of each stop string's first match in `text` that starts at `start` or
    later and ends past `floor` (the text made under min_tokens, which vLLM passes over)."""
    return [(i, s) for s in stops if (i := text.find(s, max(start, floor - len(s) + 1))) >= 0]
