"""An asyncio facade over the synchronous Engine.

One background thread owns the Engine: it applies queued commands (add / abort) between steps,
runs `engine.step()` while work exists, and hands each output to the request's asyncio queue on
the event loop (`call_soon_threadsafe`). Nothing else touches the Engine, so aborts never land
in the middle of a step.

Guarantees:
- admission is bounded: more than `max_pending` unfinished requests -> ServerBusy (HTTP 429);
  after shutdown began or if the loop died -> ServiceUnavailable (HTTP 503);
- every submitted request ends with exactly one final item: a finished RequestOutput
  (finish_reason "stop" or "length") or a RequestFailed (engine-side validation, abort,
  engine error, shutdown);
- an exception in `engine.step()` fails the requests that were running, not the server; after
  `max_consecutive_errors` failing steps in a row every queued request is failed too.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from kvcap.engine.engine import Engine, RequestOutput
from kvcap.errors import KvcapError
from kvcap.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ServerBusy(Exception):
    """Admission queue full (HTTP 429)."""


class ServiceUnavailable(Exception):
    """Shutting down, or the engine loop is gone (HTTP 503)."""


class RequestFailed(Exception):
    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.message, self.status = message, status


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot published by the engine thread after every loop iteration."""

    waiting: int = 0  # in the scheduler's waiting queue + submitted but not yet added
    running: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    steps: int = 0
    step_errors: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # stop/length/abort/error
    prompt_tokens: int = 0
    generation_tokens: int = 0
    draft_tokens: int = 0  # speculative decoding: drafts verified and kept
    accepted_tokens: int = 0


class RequestStream:
    """Outputs of one request, in order; consumed on the event loop."""

    def __init__(self, request_id: str, owner: AsyncEngine):
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._q: asyncio.Queue[RequestOutput | RequestFailed] = asyncio.Queue()

    def _put(self, item: RequestOutput | RequestFailed) -> None:
        self._q.put_nowait(item)

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        """The newest output (outputs are cumulative, so older queued ones are skipped).

        None on timeout; raises RequestFailed for a failed request."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id} already finished")
        try:
            item = await asyncio.wait_for(self._q.get(), timeout)
        except TimeoutError:
            return None
        while not self._q.empty() and isinstance(item, RequestOutput) and not item.finished:
            item = self._q.get_nowait()
        if isinstance(item, RequestFailed):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Abort if still running (the client went away); the final item is then dropped."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: Engine, max_pending: int = 256, max_consecutive_errors: int = 3):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.engine = engine
        self.max_pending = max_pending
        self.max_consecutive_errors = max_consecutive_errors
        self._cmds: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._stop = False
        self._dead: str | None = None
        self._needs_cleanup = False  # aborted requests wait for a step() to be reported
        self._steps = self._step_errors = self._consecutive_errors = 0
        self._finished: Counter[str] = Counter()
        self._tokens = [0, 0]  # prompt, generation
        self._stats = EngineStats()
        self._outbox: list[tuple[RequestStream, RequestOutput | RequestFailed]] = []
        self._unadded = 0  # submitted, not yet handed to the engine

    # ----------------------------------------------------------------- event-loop side
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvcap-engine", daemon=True)
        self._thread.start()
        self._publish()

    @property
    def healthy(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and not self._closing
            and self._dead is None
        )

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def stats(self) -> EngineStats:
        return self._stats

    def submit(self, requests: list[tuple[list[int], SamplingParams]], stream: bool = True
               ) -> list[RequestStream]:
        """Queue requests all-or-nothing; raises ServerBusy / ServiceUnavailable. stream=False:
        only each request's final output comes (a reply sent whole)."""
        if not self.healthy:
            raise ServiceUnavailable(self._dead or "the server is shutting down")
        with self._lock:
            if len(self._streams) + len(requests) > self.max_pending:
                raise ServerBusy(
                    f"server overloaded: {len(self._streams)} requests in flight "
                    f"(limit {self.max_pending}); retry later"
                )
            streams = [RequestStream(f"srv-{uuid.uuid4().hex[:16]}", self) for _ in requests]
            for s in streams:
                self._streams[s.request_id] = s
            self._unadded += len(streams)
        for s, (ids, params) in zip(streams, requests, strict=True):
            self._cmds.put(("add", s.request_id, ids, params, stream))
        self._wake.set()
        return streams

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))
        self._wake.set()

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Refuse new work, let in-flight requests finish for `grace_s`, then abort the rest."""
        self._closing = True
        deadline = time.monotonic() + grace_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            logger.warning("shutdown: aborting %d unfinished requests", self.in_flight)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 60.0)
        await asyncio.sleep(0)  # deliver the last callbacks
        logger.info("engine loop stopped")

    # ----------------------------------------------------------------- engine thread
    # Each iteration collects what to hand out in `_outbox` and sends it only after the stats
    # are published, so /metrics is never behind what a client has already received.
    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                self._apply_commands()
                stopping = self._stop
                if stopping:
                    self._fail_all("the server is shutting down", 503)
                elif self.engine.has_unfinished() or self._needs_cleanup:
                    self._step()
                self._flush()
                if stopping:
                    break
                if not (self.engine.has_unfinished() or self._needs_cleanup):
                    self._wake.wait(0.5)
        except BaseException as e:  # the loop itself broke: fail everyone, report unhealthy
            logger.exception("engine loop crashed")
            self._dead = f"engine loop crashed: {e}"
            self._fail_all(self._dead, 500)
        finally:
            self._flush()

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "abort":
                if self.engine.abort_request(cmd[1]):
                    self._needs_cleanup = True
                continue
            _, rid, ids, params, stream = cmd
            with self._lock:
                self._unadded -= 1
            try:
                self.engine.add_request(rid, ids, params, stream=stream)
            except KvcapError as e:
                self._finish(rid, RequestFailed(str(e), 400), "error")
            except Exception as e:
                logger.exception("add_request failed for %s", rid)
                self._finish(rid, RequestFailed(f"engine error: {e}", 500), "error")

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._on_step_error(e)
            return
        self._steps += 1
        self._consecutive_errors = 0
        self._needs_cleanup = False
        for out in outputs:
            rid = out.request_id
            if not out.finished:
                stream = self._streams.get(rid)
                if stream is not None:
                    self._outbox.append((stream, out))
            elif out.error:
                self._finish(rid, RequestFailed(out.error, 400), "error", out)
            elif out.finish_reason == "abort":
                self._finish(rid, RequestFailed("the request was aborted", 503), "abort", out)
            else:
                self._finish(rid, out, out.finish_reason or "stop", out)

    def _on_step_error(self, exc: Exception) -> None:
        self._step_errors += 1
        self._consecutive_errors += 1
        sched = self.engine.scheduler
        victims = [r.request_id for r in sched.running]
        if self._consecutive_errors >= self.max_consecutive_errors or not victims:
            victims += [r.request_id for r in sched.waiting]
        logger.error("engine step failed; failing %d request(s)", len(victims), exc_info=exc)
        for rid in victims:
            self.engine.abort_request(rid)
            self._finish(rid, RequestFailed(f"engine error: {exc}", 500), "error")
        self._needs_cleanup = True

    def _fail_all(self, message: str, status: int) -> None:
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            try:
                self.engine.abort_request(rid)
            except Exception:  # the engine may be broken; the client still gets an answer
                logger.exception("abort of %s failed", rid)
            self._finish(rid, RequestFailed(message, status), "abort")
        try:
            self.engine.step()  # report (and forget) the aborted requests
        except Exception:
            logger.exception("cleanup step failed")

    def _finish(
        self,
        rid: str,
        item: RequestOutput | RequestFailed,
        reason: str,
        out: RequestOutput | None = None,
    ) -> None:
        """The request's last item: stop tracking it, count it, queue the item for sending."""
        with self._lock:
            stream = self._streams.pop(rid, None)
        if stream is None:
            return
        self._outbox.append((stream, item))
        self._finished[reason] += 1
        if out is not None:
            self._tokens[0] += len(out.prompt_token_ids)
            self._tokens[1] += len(out.token_ids)

    def _flush(self) -> None:
        """Publish the stats snapshot, then hand the queued items to the event loop."""
        self._publish()
        outbox, self._outbox = self._outbox, []
        if self._loop is None:
            return
        for stream, item in outbox:
            try:
                self._loop.call_soon_threadsafe(stream._put, item)
            except RuntimeError:  # event loop closed: nobody is listening any more
                return

    def _publish(self) -> None:
        bm, sched = self.engine.block_manager, self.engine.scheduler
        self._stats = EngineStats(
            waiting=sched.num_waiting + max(0, self._unadded),
            running=sched.num_running,
            kv_blocks_total=bm.num_total_blocks,
            kv_blocks_free=bm.num_free_blocks,
            steps=self._steps,
            step_errors=self._step_errors,
            finished=dict(self._finished),
            prompt_tokens=self._tokens[0],
            generation_tokens=self._tokens[1],
            draft_tokens=self.engine.num_draft_tokens,
            accepted_tokens=self.engine.num_accepted_tokens,
        )
