"""Start, watch and stop a tensor-parallel group (one host).

Rank 0 is the user's process (it runs the scheduler and samples); ranks 1..N-1 are
`python -m kvcap.distributed.worker` processes in their own session (Ctrl-C reaches rank 0
only, which then stops them). Rank 0 hosts the TCPStore that carries the workers' config,
their readiness and any error message they die with.

Liveness, both ways, in bounded time:
- each worker's stdin is a pipe whose write end only rank 0 holds: when rank 0 dies for any
  reason, even SIGKILL, the worker reads EOF and exits at once;
- rank 0 polls its workers; when one exits unexpectedly it records why (exit code or signal,
  plus the worker's own error message), kills the others and fails every later call; while
  the group forms, rank 0's rendezvous gives up as soon as a worker has exited. A
  collective that was waiting on the dead rank fails immediately on gloo (connection closed);
  on NCCL the group is aborted, and `KVCAP_TP_TIMEOUT_S` bounds it in any case.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from kvcap.config import ModelSpec
from kvcap.distributed.comm import (
    TIMEOUT_ENV,
    Communicator,
    WatchedStore,
    data_timeout,
    set_nccl_env,
)
from kvcap.distributed.layers import ModelParallel
from kvcap.distributed.partition import plan_shard
from kvcap.distributed.protocol import SHUTDOWN, TensorParallelError, agree
from kvcap.errors import ConfigError, KvcapError

logger = logging.getLogger(__name__)

T = TypeVar("T")
KEY = "kvcap/tp"
SHUTDOWN_SEND_TIMEOUT = timedelta(seconds=15)  # as long as a clean shutdown's grace
_CURRENT_WORKER: TPRuntime | None = None  # set in worker processes before they build an LLM


def exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def posted_error(store: Any, rank: int) -> str | None:
    key = f"{KEY}/error/{rank}"
    try:
        if store.check([key]):
            name, message = pickle.loads(store.get(key))
            return f"{name}: {message}"
    except Exception:  # the store itself is gone: nothing to add
        return None
    return None


def worker_log_level(level: int) -> int:
    """Workers repeat rank 0's INFO lines; they show warnings and errors unless debugging."""
    return level if level <= logging.DEBUG else max(level, logging.WARNING)


class TPRuntime:
    """This process's place in a tensor-parallel group."""

    is_driver = False

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        self.comm = Communicator(rank, world, device)

    def model_parallel(self, spec: ModelSpec) -> ModelParallel:
        return ModelParallel(plan_shard(spec, self.world, self.rank), self.comm)

    def agree(self, fn: Callable[[], T]) -> T:
        return agree(self.comm, fn)


def set_worker_runtime(rt: TPRuntime) -> None:
    global _CURRENT_WORKER
    _CURRENT_WORKER = rt


def in_worker_process() -> bool:
    return _CURRENT_WORKER is not None


def rank_device(device: torch.device, world: int, rank: int) -> torch.device:
    """Rank r runs on the r-th GPU after the one asked for (cuda -> cuda:0), or on the CPU."""
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"tensor parallelism runs on cpu or cuda, not {device.type}")
    base = device.index or 0
    if base + world > torch.cuda.device_count():
        raise ConfigError(f"tensor_parallel_size {world} from {device} needs GPUs {base}.."
                          f"{base + world - 1}; {torch.cuda.device_count()} visible")
    return torch.device("cuda", base + rank)


class TPDriver(TPRuntime):
    """Rank 0: launches the workers and owns their lifetime."""

    is_driver = True

    def __init__(self, world: int, device: torch.device, worker_config: dict[str, Any]):
        if dist.is_initialized():
            raise ConfigError("a torch.distributed process group already exists in this "
                              "process: shut the other tensor-parallel LLM down first")
        super().__init__(0, world, rank_device(device, world, 0))
        set_nccl_env()  # before any NCCL use; the workers inherit it
        timeout = data_timeout()
        self.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True,
                                   wait_for_workers=False, timeout=timeout)
        self.store.set(f"{KEY}/config", pickle.dumps({
            **worker_config, "base_device": str(device),
            "log_level": worker_log_level(logging.getLogger("kvcap").getEffectiveLevel()),
            "threads": max(1, torch.get_num_threads() // world)}))
        self.failure: str | None = None
        self.closed = False
        self.step_open = False  # DriverRunner: a step's plan is out, its forward not done
        self._stopping = threading.Event()
        self.procs: list[subprocess.Popen] = []
        atexit.register(self.shutdown)
        # Workers import the same kvcap as this process, wherever it came from.
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])}
        try:
            for r in range(1, world):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kvcap.distributed.worker", str(r), str(world),
                     str(self.store.port)],
                    stdin=subprocess.PIPE, env=env, start_new_session=True))
            logger.info("tensor parallel: %d ranks; workers %s", world,
                        [p.pid for p in self.procs])
            self._wait_ready(time.monotonic() + timeout.total_seconds())
            procs = self.procs
            # A worker dying now would leave torch's rendezvous waiting out the timeout. On
            # NCCL the store stays under the data group for its life (its watchdog reads it
            # from C++ threads): test_watched_store_carries_an_nccl_group (H100, 2026-12-06).
            # A worker alive but wedged before a group formed: no wait beyond the data timeout.
            store = WatchedStore(self.store, lambda: any(p.poll() is not None for p in procs),
                                 limit=timeout)
            try:
                self.comm.init(store)
            except Exception:
                _forget_failed_group()
                dead = self._dead_worker()  # say why: a worker that died joining the group
                if dead:
                    raise TensorParallelError(f"{dead} while joining the process group"
                                              ) from None
                if store.timed_out:
                    raise TensorParallelError(
                        f"a tensor-parallel rank did not join the process group in "
                        f"{timeout.total_seconds():g} s ({TIMEOUT_ENV}): a worker is wedged or "
                        "stopped") from None
                raise
            store.limit = None  # formed: later reads (NCCL's, from C++) keep their timeouts
        except BaseException:
            self.shutdown(abort=True)
            raise
        threading.Thread(target=self._watch, name="kvcap-tp-watchdog", daemon=True).start()

    # --- liveness ----------------------------------------------------------------------------
    def _dead_worker(self) -> str | None:
        for r, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                msg = f"tensor-parallel rank {r} (pid {p.pid}) exited ({exit_reason(code)})"
                err = posted_error(self.store, r)
                return f"{msg}: {err}" if err else msg
        return None

    def _wait_ready(self, deadline: float) -> None:
        keys = [f"{KEY}/ready/{r}" for r in range(1, self.world)]
        while not self.store.check(keys):
            dead = self._dead_worker()
            if dead:
                raise TensorParallelError(f"{dead} during start-up")
            if time.monotonic() > deadline:
                raise TensorParallelError("tensor-parallel workers did not start in time")
            time.sleep(0.05)

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            dead = self._dead_worker()
            if dead and not self._stopping.is_set():
                self.failure = f"{dead}; all ranks stopped"
                logger.error("%s", self.failure)
                self._kill_workers(grace=0.0)
                return

    def check_alive(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if self.closed:
            raise TensorParallelError("this tensor-parallel LLM was shut down")

    def fail(self, exc: BaseException) -> BaseException:
        """Rank 0 raised in the middle of a step: the group is out of step and must stop.
        Returns the error to raise (the dead worker's story when there is one)."""
        if not isinstance(exc, KeyboardInterrupt | KvcapError):  # rank 0's own errors: no wait
            deadline = time.monotonic() + 2.0  # gloo reports a closed pipe before poll() does
            while self.failure is None and time.monotonic() < deadline:
                dead = self._dead_worker()
                if dead:
                    self.failure = f"{dead}; all ranks stopped"
                    break
                time.sleep(0.05)
        reason = self.failure
        self.shutdown(abort=True)
        if reason is not None and not isinstance(exc, KeyboardInterrupt | KvcapError):
            return TensorParallelError(reason)
        return exc

    # --- messages ---------------------------------------------------------------------------
    def send(self, msg: tuple) -> None:
        self.check_alive()
        try:
            self.comm.broadcast_object(msg)
        except TensorParallelError as e:  # a wedged worker: every later call says so too
            self.failure = f"{e}; all ranks stopped"
            raise

    def gather(self) -> list[Any]:
        """Every rank's reply to the message just sent (rank 0's own slot is None)."""
        try:
            out = self.comm.gather_object(None)
        except TensorParallelError as e:  # a wedged worker, as in send()
            self.failure = f"{e}; all ranks stopped"
            raise
        assert out is not None  # rank 0 receives
        return out

    # --- shutdown ---------------------------------------------------------------------------
    def _kill_workers(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        for p in self.procs:
            p.wait()
            if p.stdin is not None:
                p.stdin.close()

    def shutdown(self, abort: bool = False) -> None:
        """Stop every rank and release the process group; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._stopping.set()
        # A step was broadcast and its forward never finished here (Ctrl-C between the two):
        # the workers are inside that forward, where a shutdown message would wait forever.
        abort = abort or self.step_open
        if not abort and self.failure is None and self.comm.ctrl_group is not None:
            try:
                # (bounded: a wedged or stopped worker is killed after the grace below)
                self.comm.broadcast_object((SHUTDOWN,), timeout=min(
                    self.comm.send_timeout, SHUTDOWN_SEND_TIMEOUT))
            except Exception as e:
                logger.warning("tensor-parallel shutdown message failed: %s", e)
                abort = True
        self._kill_workers(grace=0.5 if abort else 15.0)
        try:
            self.comm.destroy()
        except Exception as e:  # a broken group may refuse to tear down cleanly
            logger.warning("destroying the tensor-parallel process group: %s", e)
        atexit.unregister(self.shutdown)
        logger.info("tensor parallel: all %d ranks stopped", self.world)


def attach(world: int, device: torch.device, worker_config: dict[str, Any]) -> TPRuntime:
    """The runtime for an LLM built with tensor_parallel_size=world: in a worker process the
    one it was started with, otherwise a new driver that launches the workers."""
    if _CURRENT_WORKER is not None:
        if _CURRENT_WORKER.world != world:
            raise ConfigError(f"worker of a size-{_CURRENT_WORKER.world} group asked for {world}")
        return _CURRENT_WORKER
    return TPDriver(world, device, worker_config)


def exit_deadline(seconds: int) -> None:
    """Worker side: have the kernel end this process in `seconds` (SIGALRM, default action)
    whatever Python is doing by then. Clean-clone CI runs saw a worker log rank 0's death and
    then live on for 40 s: a Python-level exit (a timer thread calling os._exit, logging's
    shutdown, posting the error to rank 0's store) needs the GIL and locks that a thread stuck
    in the broken group may hold; the alarm needs neither. Callable from any thread."""
    signal.alarm(seconds)


def _forget_failed_group() -> None:
    """torch names the default group from a counter it raises before the rendezvous and resets
    only in destroy_process_group: after a failed init_process_group the next TP LLM of this
    process would wait on other store keys than its fresh workers (a stall for the whole data
    timeout). Private torch state, hence the guards."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count") and not dist.is_initialized():
        world.group_count = 0


def lifeline_watch(rank: int, stopping: threading.Event) -> None:
    """Worker side: exit as soon as rank 0 is gone (EOF on the stdin pipe it holds)."""

    parent = os.getppid()

    def run() -> None:
        try:
            sys.stdin.buffer.read()
        except Exception:  # closed or unreadable stdin: treat like EOF
            pass
        if not stopping.is_set():
            exit_deadline(2)
            logger.error("rank %d: rank 0 (pid %d) is gone; stopping", rank, parent)
            logging.shutdown()
            os._exit(3)

    threading.Thread(target=run, name="kvcap-tp-lifeline", daemon=True).start()


def attach_llm(world: int, device: torch.device, spec: ModelSpec, model_dir: Path | None,
               llm_args: dict[str, Any]) -> TPRuntime:
    """`attach` for LLM(tensor_parallel_size=world): refuses an impossible split before
    starting anything, and sends workers the resolved model path (never 'default', so that
    only rank 0 ever converts the embedded model) and picklable scales."""
    shards = [plan_shard(spec, world, r) for r in range(world)]
    logger.info("tensor parallel over %d ranks: %s", world, "; ".join(
        f"rank {s.rank}: query heads {s.q_heads}, KV heads {s.kv_heads}, MLP {s.inter}, vocab "
        f"{s.vocab}" for s in shards))
    args = dict(llm_args)
    if model_dir is not None:
        args["model"] = str(model_dir)
    scales = args.get("kv_scales")
    if isinstance(scales, Mapping):
        args["kv_scales"] = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                             for k, v in scales.items()}
    elif scales is not None:
        args["kv_scales"] = str(scales)
    return attach(world, device, {"llm_kwargs": args})
