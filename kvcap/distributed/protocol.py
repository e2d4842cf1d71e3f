"""What the ranks say to each other after start-up, and the agreement they reach during it.

Rank 0 runs the scheduler. For every step it broadcasts, on the control group, one message
`("step", StepPlan, observer shard | None)`; every rank (rank 0 included) then runs the same
forward on its shard, issuing the same all-reduces in the same order, and the same logits
gathers, which land on rank 0 only; rank 0 samples. Other messages: `("observer", cfg | None)`
(attach a per-rank KVStatsObserver, or detach it), `("stats",)` (every rank sends its observer's
statistics to rank 0), `("shutdown",)`.

Start-up agreement (`agree`): every rank runs a check (the scale gate) on its own copy and the
results are all-gathered, so a refusal on any rank stops every rank with that rank's message.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kvcap import errors
from kvcap.errors import CalibrationError, KvcapError

if TYPE_CHECKING:
    from kvcap.distributed.comm import Communicator
    from kvcap.scales.stats import KVStats

logger = logging.getLogger(__name__)

T = TypeVar("T")

STEP, OBSERVER, STATS, SHUTDOWN = "step", "observer", "stats", "shutdown"


class TensorParallelError(KvcapError):
    """A tensor-parallel rank died, timed out or failed; the whole group is stopped."""


def _error_class(name: str) -> type[KvcapError]:
    cls = getattr(errors, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, KvcapError) else TensorParallelError


def agree(comm: Communicator, fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; if it raised a KvcapError on any rank, raise on every rank the
    lowest failing rank's error (same type and message, plus which ranks refused)."""
    status: tuple[str, str] | None = None
    result: Any = None
    try:
        result = fn()
    except KvcapError as e:
        status = (type(e).__name__, str(e))
    statuses = comm.all_gather_object(status)
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if failed:
        name, message = failed[0][1]
        ranks = [r for r, _ in failed]
        who = (f"rank {ranks[0]}" if len(ranks) == 1
               else "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}")
        err = _error_class(name)(f"{message} (refused on tensor-parallel {who} of {comm.world})")
        err.tp_agreed = True  # type: ignore[attr-defined]  # every rank knows: exit quietly
        raise err
    return result


def observer_config(obs: Any) -> dict[str, Any]:
    """What a worker needs to build the same kind of observer as rank 0's."""
    from kvcap.scales.observer import KVStatsObserver

    if not isinstance(obs, KVStatsObserver):
        raise errors.ConfigError("under tensor parallelism kv_observer must be a "
                                 "KVStatsObserver: every rank records its own KV heads")
    return {"num_layers": obs.num_layers, "bins": obs.bins, "log2_lo": obs.log2_lo,
            "log2_hi": obs.log2_hi, "shard": obs.shard}


def merge_rank_stats(per_rank: list[KVStats | None]) -> KVStats:
    """One KVStats over all ranks: histograms and counts summed, max_abs maxed (SYSTEM.md §2).

    Every rank sees every token (with different KV heads), so `rows` are checked equal across
    ranks and kept once instead of summed; replicas of a replicated KV head send None.
    """
    present = [s for s in per_rank if s is not None]
    if not present:
        raise CalibrationError("no tensor-parallel rank recorded K/V statistics")
    merged = present[0]
    for s in present[1:]:
        merged = merged.merge(s)
    for name, shard in list(merged.shards.items()):
        rows = [s.shards[name].rows for s in present if name in s.shards]
        if any((r != rows[0]).any() for r in rows[1:]):
            raise CalibrationError(f"shard {name!r}: tensor-parallel ranks saw different token "
                                   "counts; statistics cannot be merged")
        merged.shards[name] = dataclasses.replace(shard, rows=rows[0].copy())
    return merged


def serve(llm: Any) -> None:
    """A worker rank's loop: follow rank 0's messages until told to shut down."""
    from kvcap.scales.observer import KVStatsObserver

    comm, shard = llm.tp.comm, llm.model.shard
    observer: KVStatsObserver | None = None
    while True:
        msg = comm.broadcast_object()
        kind = msg[0]
        if kind == STEP:
            _, plan, obs_shard = msg
            if observer is not None and obs_shard is not None:
                observer.set_shard(obs_shard)
            fed = comm.broadcast_ids(None, len(plan.ids)) if plan.fed else None
            llm.runner.run_plan(plan, fed_ids=fed)
        elif kind == OBSERVER:  # None detaches; the last observer stays for ("stats",)
            cfg = msg[1]
            attach = cfg is not None and shard.kv_primary  # replicas: the first copy counts
            if attach:
                observer = KVStatsObserver(cfg["num_layers"], rank=comm.rank, bins=cfg["bins"],
                                           log2_lo=cfg["log2_lo"], log2_hi=cfg["log2_hi"])
                observer.set_shard(cfg["shard"])
            elif cfg is not None:
                observer = None
            llm.runner.kv_observer = observer.observe if attach and observer else None
        elif kind == STATS:
            comm.gather_object(observer.stats() if observer is not None else None)
        elif kind == SHUTDOWN:
            logger.debug("rank %d: shutdown", comm.rank)
            return
        else:
            raise TensorParallelError(f"rank {comm.rank}: unknown message {kind!r} from rank 0")
