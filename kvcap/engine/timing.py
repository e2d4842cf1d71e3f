"""Optional per-phase timing of `Engine.step()` (off by default: `engine.timer is None`).

Attach a `StepTimer` with `engine.set_timer(StepTimer(...))`; every step then records the host
time spent in each phase, measured with `time.perf_counter()` between consecutive marks:

    schedule   Scheduler.schedule()
    prepare    flatten the chunks into the step plan, build ids/positions/metadata, H2D copies
    forward    the model forward (a graph replay or eager layers) and the sampled rows' logits
    sample     the sampling batch, the sampler, the device->host copy of the tokens, logprobs
    update     Scheduler.update_from_output (append tokens, stop checks, prefix-cache commits)
    output     stop strings, detokenization, RequestOutput objects

On CUDA the forward is asynchronous: by default the `forward` phase is only its launch time and
the wait for the GPU shows up in `sample` (the tokens' copy to the host is the step's one sync).
`sync=True` puts `torch.cuda.synchronize()` at every phase boundary so each phase is
attributable (and the step no longer overlaps host work with the GPU). Without `sync`, CUDA
events around the forward give its GPU time (`gpu_forward`), read when `records` is read so
that timing never waits for the GPU. With the engine's overlap on, a step() call launches the
*next* step's forward (prepare/forward phases and gpu_forward belong to it) and finishes the
current one (sample/update/output). When the timer is off the engine pays one `is None` test
per phase boundary.
"""

from __future__ import annotations

import time

import torch

PHASES = ("schedule", "prepare", "forward", "sample", "update", "output")


class StepTimer:
    def __init__(self, device: torch.device | str | None = None, sync: bool = False):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.sync = sync and self.cuda
        self._records: list[dict] = []
        self._unresolved: list[tuple[dict, torch.cuda.Event, torch.cuda.Event]] = []
        self._cur: dict[str, float] = {}
        self._t = 0.0
        self._t0 = 0.0
        self._events: dict[str, torch.cuda.Event] = {}

    def begin(self) -> None:
        if self.sync:
            torch.cuda.synchronize(self.device)
        self._cur = {}
        self._events = {}
        self._t0 = self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark (or `begin`) to `phase`."""
        if self.sync:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self._cur[phase] = self._cur.get(phase, 0.0) + now - self._t
        self._t = now

    def gpu_event(self, name: str) -> None:
        """Record a CUDA event (no sync) on the current stream; used around the forward."""
        if self.cuda and not self.sync:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events[name] = ev

    def end(self, **info) -> dict:
        """Close the step: the record holds each phase (seconds), `step` and `info`."""
        now = time.perf_counter()
        rec = dict(self._cur)
        rec["step"] = now - self._t0
        start, stop = self._events.get("forward_start"), self._events.get("forward_end")
        if start is not None and stop is not None:
            self._unresolved.append((rec, start, stop))  # `gpu_forward` once it has run
        rec.update(info)
        self._records.append(rec)
        return rec

    @property
    def records(self) -> list[dict]:
        """Every step's record, `gpu_forward` (seconds) filled in (waits for the GPU)."""
        for rec, start, stop in self._unresolved:
            stop.synchronize()
            rec["gpu_forward"] = start.elapsed_time(stop) / 1e3
        self._unresolved.clear()
        return self._records
