"""Rank 0 side: stop the group when Ctrl-C arrives while a step is wedged in native code.

Python raises KeyboardInterrupt only when the main thread returns to the interpreter. If it
is blocked inside a collective that never completes, rank 0 neither stops nor kills its
workers, and the group hangs until the data timeout (a clean-clone CI run, 2026-12-02: a
worker still alive 40 s after SIGINT, rank 0 silent). The C-level signal handler still runs,
in whatever thread the kernel picks, and writes the signal number to the wakeup fd; a thread
here reads it and, if the step that was running then is still running `grace_s` later, calls
`on_stuck` (TPDriver kills the workers, so the blocked collective fails and the main thread
returns). A Ctrl-C between steps changes nothing here: the KeyboardInterrupt lands at once.

The process has one wakeup fd; this takes it only where nobody else holds it (an asyncio
loop's signal handling does) and only from the main thread (where Python allows setting it).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable

from kvcap.distributed.comm import env_seconds

logger = logging.getLogger(__name__)
GRACE_ENV = "KVCAP_TP_INTERRUPT_GRACE_S"
_WATCHED = {signal.SIGINT, signal.SIGTERM}


class InterruptWatch:
    def __init__(self, on_stuck: Callable[[], None], grace_s: float | None = None):
        self.on_stuck = on_stuck
        self.grace_s = env_seconds(GRACE_ENV, 10) if grace_s is None else grace_s
        self.step = 0  # steps begun: a timer acts only if its step is still the one running
        self.active = False
        self.armed = False
        self._pair: tuple[socket.socket, socket.socket] | None = None
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = socket.socketpair()
        w.setblocking(False)
        try:
            old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            r.close()
            w.close()
            return
        if old != -1:  # somebody else reads the wakeup fd: leave it to them
            signal.set_wakeup_fd(old)
            r.close()
            w.close()
            return
        self._pair = (r, w)
        self.armed = True
        threading.Thread(target=self._read, args=(r,), name="kvcap-tp-interrupt",
                         daemon=True).start()

    def begin_step(self) -> None:
        self.step += 1
        self.active = True

    def end_step(self) -> None:
        self.active = False

    def _read(self, r: socket.socket) -> None:
        while True:
            try:
                data = r.recv(64)
            except OSError:
                return
            if not data:
                return
            if self.active and any(b in _WATCHED for b in data):
                threading.Timer(self.grace_s, self._check, (self.step,)).start()

    def _check(self, step: int) -> None:
        if self.active and self.step == step:
            logger.error("interrupted, and rank 0's step did not return within %.0f s: "
                         "stopping every rank", self.grace_s)
            self.on_stuck()

    def close(self) -> None:
        """Give the wakeup fd back (main thread only; elsewhere it stays ours, harmlessly)."""
        if self._pair is None or threading.current_thread() is not threading.main_thread():
            return
        r, w = self._pair
        current = signal.set_wakeup_fd(-1)
        if current != w.fileno():  # replaced since: not ours to clear, nor to close
            signal.set_wakeup_fd(current)
            return
        self._pair = None
        self.armed = False
        w.close()
        r.close()
