"""Process groups and the few collectives tensor parallelism needs, over torch.distributed.

Two groups per rank: the *data* group (NCCL on CUDA, gloo on CPU) carries the all-reduces of
the row-parallel layers and the logits gather; the *control* group (always gloo, CPU objects)
carries rank 0's step messages and start-up agreements. The control group has a very long
timeout because workers legitimately wait there while rank 0 is idle; liveness is enforced by
the watchdogs in kvcap.distributed.launch instead. Data-group collectives, rank 0's messages
on the control group (`broadcast_object`: workers wait for them indefinitely) and the replies
it gathers (`gather_object`), and rank 0's rendezvous while the groups form (WatchedStore's
limit) time out after `KVCAP_TP_TIMEOUT_S` seconds (default 300).

All-reduce switch `KVCAP_ALLREDUCE`: `nccl` (default: the data group's own all-reduce) or
`symm` (torch's symmetric-memory one-shot all-reduce for messages up to 1 MiB on CUDA, the data
group's all-reduce above that and everywhere else; see kvcap.distributed.symm).
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import AllgatherOptions

from kvcap.errors import ConfigError

logger = logging.getLogger(__name__)

# Multicast/NVLS stays off on the lent machines (DEVICE.md, "Several GPUs").
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
ALLREDUCE_ENV = "KVCAP_ALLREDUCE"
ALLREDUCE_MODES = ("nccl", "symm")
TIMEOUT_ENV = "KVCAP_TP_TIMEOUT_S"
CONTROL_TIMEOUT = timedelta(days=365)


def set_nccl_env() -> None:
    """Pin the multicast switches before any NCCL / symmetric-memory initialisation."""
    for key, value in NCCL_ENV.items():
        if os.environ.get(key, value) != value:
            logger.warning("overriding %s=%s with %s (NVLink multicast stays off)", key,
                           os.environ[key], value)
        os.environ[key] = value


def allreduce_mode() -> str:
    mode = os.environ.get(ALLREDUCE_ENV, "nccl").strip().lower()
    if mode not in ALLREDUCE_MODES:
        raise ConfigError(f"{ALLREDUCE_ENV}={mode!r} is not one of {', '.join(ALLREDUCE_MODES)}")
    return mode


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable `name` (else `default`)."""
    raw = os.environ.get(name, str(default))
    try:
        seconds = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ConfigError(f"{name} must be positive, got {raw}")
    return seconds


def data_timeout() -> timedelta:
    return timedelta(seconds=env_seconds(TIMEOUT_ENV, 300))


class WatchedStore(dist.Store):
    """Rank 0's view of its TCPStore while the group forms. torch's rendezvous blocks in the
    store until the other ranks post their keys, for the whole data timeout: a TCPStore wait
    cannot be interrupted, so a worker that died joining left rank 0 waiting minutes. Here the
    blocking reads poll instead and fail as soon as `dead()` is true. While `limit` is set, no
    read waits longer: the control group's rendezvous asks for its year-long timeout, so a
    worker alive but wedged before joining it held rank 0 for good (`timed_out` then says
    why it failed). Everything else is passed through. torch keeps only the C++ side of a
    Python store: the Python object must outlive the groups (Communicator.store holds it)."""

    def __init__(self, store: dist.Store, dead: Callable[[], bool],
                 limit: timedelta | None = None):
        super().__init__()
        self.store, self.dead, self.limit = store, dead, limit
        self.timed_out = False

    def _await(self, keys: list[str], timeout: timedelta | None) -> None:
        wait = timeout or self.store.timeout
        if self.limit is not None:
            wait = min(wait, self.limit)
        deadline = time.monotonic() + wait.total_seconds()
        while not self.store.check(keys):
            if self.dead():
                raise dist.DistStoreError(f"a rank died while rank 0 waited for {keys}")
            if time.monotonic() > deadline:
                self.timed_out = True
                raise dist.DistStoreError(f"wait timeout for {keys}")
            time.sleep(0.02)

    def get(self, key: str) -> bytes:
        self._await([key], None)
        return self.store.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._await(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._await(keys, None)
        return self.store.multi_get(keys)

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def add(self, key: str, value: int) -> int:
        return self.store.add(key, value)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self.store.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def append(self, key: str, value: bytes) -> None:
        self.store.append(key, value)

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self.store.multi_set(keys, values)

    def has_extended_api(self) -> bool:
        return self.store.has_extended_api()


class Communicator:
    """One rank's view of its tensor-parallel group (rank 0 drives, the others follow)."""

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        self.data_group: Any = None
        self.ctrl_group: Any = None
        self.symm: Any = None  # SymmAllReduce when KVCAP_ALLREDUCE=symm took effect
        self.store: dist.Store | None = None  # kept alive for the groups (see WatchedStore)
        # rank 0's messages and the replies it gathers (broadcast_object, gather_object); init
        # sets it
        self.send_timeout = CONTROL_TIMEOUT

    # --- set-up / tear-down ---------------------------------------------------------------
    def init(self, store: dist.Store) -> None:
        """Join the group (collective). Rank 0 and the workers call it with the same store."""
        self.store = store
        self.send_timeout = data_timeout()
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world,
                                timeout=data_timeout())
        self.data_group = dist.group.WORLD
        self.ctrl_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        logger.info("tensor-parallel rank %d/%d joined (%s data group on %s, gloo control)",
                    self.rank, self.world, backend, self.device)

    def setup_allreduce(self, dtype: torch.dtype) -> None:
        """Choose the all-reduce implementation (collective: every rank calls it)."""
        mode = allreduce_mode()
        if mode == "nccl":
            return
        if self.device.type != "cuda":
            if self.rank == 0:
                logger.info("%s=symm needs CUDA; all-reduce stays on the %s group",
                            ALLREDUCE_ENV, dist.get_backend(self.data_group))
            return
        from kvcap.distributed.symm import SymmAllReduce

        self.symm = SymmAllReduce.create(self, dtype)

    def destroy(self, wait_s: float = 10.0) -> None:
        """Tear the groups down. NCCL teardown after graph capture has hung once (DEVICE.md):
        it runs in a daemon thread and is abandoned, with a warning, after `wait_s`."""
        self.data_group = self.ctrl_group = self.symm = None
        if not dist.is_initialized():
            return
        t = threading.Thread(target=dist.destroy_process_group, name="kvcap-tp-destroy",
                             daemon=True)
        t.start()
        t.join(wait_s)
        if t.is_alive():
            logger.warning("destroying the process group did not finish in %.0f s; left "
                           "behind (a new tensor-parallel LLM in this process may fail)", wait_s)

    # --- tensors (data group) -------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (in place on the NCCL/gloo path; may return a new tensor)."""
        if self.symm is not None and self.symm.fits(x):
            return self.symm(x)
        dist.all_reduce(x, group=self.data_group)
        return x

    def gather_columns(self, local: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Concatenate each rank's [n, widths[r]] block along dim 1 on rank 0 (None elsewhere)."""
        pad = max(widths)
        x = F.pad(local, (0, pad - local.shape[1])) if local.shape[1] < pad else local
        x = x.contiguous()
        if self.rank != 0:
            dist.gather(x, None, dst=0, group=self.data_group)
            return None
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.gather(x, parts, dst=0, group=self.data_group)
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)

    def broadcast_ids(self, ids: torch.Tensor | None, n: int) -> torch.Tensor:
        """Rank 0's int64 [n] device tensor on every rank (the input ids of a step scheduled
        ahead of its tokens, which only rank 0 samples)."""
        if self.rank == 0:
            assert ids is not None and ids.shape == (n,)
        else:
            ids = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.broadcast(ids, src=0, group=self.data_group)
        return ids

    # --- Python objects (control group) -----------------------------------------------------
    def broadcast_object(self, obj: Any = None, timeout: timedelta | None = None) -> Any:
        """Rank 0's `obj` on every rank. Workers wait for it indefinitely (they idle here
        between requests); rank 0 gives up after `timeout` (default `send_timeout`): a gloo
        send waits for the receiver to post its buffer, so a worker that is alive but wedged
        or stopped (where the watchdog sees no exit) held rank 0 -- a step, or even
        shutdown() -- forever, and Ctrl-C cannot interrupt the wait."""
        size = torch.empty(1, dtype=torch.int64)
        if self.rank != 0:
            dist.broadcast(size, src=0, group=self.ctrl_group)
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self.ctrl_group)
            return pickle.loads(data.numpy().tobytes())
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size[0] = data.numel()
        limit = timeout or self.send_timeout
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, limit

        def send() -> None:
            for t in (size, data):
                self.ctrl_group.broadcast([t], opts).wait()

        _within(limit, send, "take rank 0's message")
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl_group)
        return out

    def gather_object(self, obj: Any, timeout: timedelta | None = None) -> list[Any] | None:
        """Every rank's `obj` on rank 0, in rank order (None elsewhere). Every rank gives up
        after `timeout` (default `send_timeout`), as rank 0 does in broadcast_object: rank 0
        asks for the replies just before (the `("stats",)` message), and a worker wedged
        before it sent its own held rank 0 on the control group's year-long timeout."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        limit = timeout or self.send_timeout
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.world)]
        parts: list[torch.Tensor] = []

        def gather() -> None:
            opts = AllgatherOptions()
            opts.timeout = limit
            self.ctrl_group.allgather([sizes], [torch.tensor([data.numel()])], opts).wait()
            buf = torch.zeros(max(int(n) for n in sizes), dtype=torch.uint8)
            buf[:data.numel()] = data
            if self.rank == 0:
                parts.extend(torch.empty_like(buf) for _ in range(self.world))
            gopts = dist.GatherOptions()
            gopts.rootRank, gopts.timeout = 0, limit
            self.ctrl_group.gather([parts] if self.rank == 0 else [], [buf], gopts).wait()

        if self.rank != 0:
            gather()
            return None
        _within(limit, gather, "send rank 0 its reply")
        return [pickle.loads(p[:int(n)].numpy().tobytes()) for p, n in zip(parts, sizes,
                                                                             strict=True)]

    def min_int(self, value: int) -> int:
        return min(int(v) for v in self.all_gather_object(int(value)))


def _within(limit: timedelta, wait: Callable[[], None], what: str) -> None:
    """Rank 0's side of a control-group collective bounded by `limit` (gloo's own timeout):
    its timeout becomes a TensorParallelError that says a worker did not `what`."""
    start = time.monotonic()
    try:
        wait()
    except RuntimeError:
        if time.monotonic() - start < 0.99 * limit.total_seconds():
            raise  # not the timeout (a dead worker: the caller tells its story)
        from kvcap.distributed.protocol import TensorParallelError

        raise TensorParallelError(
            f"a tensor-parallel rank did not {what} in {limit.total_seconds():g} s "
            f"({TIMEOUT_ENV}): a worker is wedged or stopped") from None
