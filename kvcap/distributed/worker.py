"""`python -m kvcap.distributed.worker RANK WORLD PORT`: one tensor-parallel rank > 0.

Started by rank 0 (kvcap.distributed.launch). Reads its config from rank 0's TCPStore, joins
the process group, builds the same LLM as rank 0 (its own shard, KV pool and scale gate), then
follows rank 0's step messages until told to stop. Any failure is logged, posted to the store
for rank 0 to report, and ends the process; a refusal every rank agreed on (the gate) exits
quietly with code 2 because rank 0 reports it.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from kvcap.distributed.launch import (
    KEY,
    TPRuntime,
    exit_deadline,
    lifeline_watch,
    set_worker_runtime,
)

logger = logging.getLogger("kvcap.distributed.worker")


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 handles Ctrl-C and stops us
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # exit_deadline relies on the default action
    rank, world, port = int(argv[0]), int(argv[1]), int(argv[2])
    stopping = threading.Event()
    lifeline_watch(rank, stopping)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=timedelta(seconds=120))
    cfg = pickle.loads(store.get(f"{KEY}/config"))
    logging.basicConfig(level=cfg["log_level"],
                        format=f"%(levelname)s [rank {rank}] %(name)s: %(message)s")
    try:
        from kvcap.distributed.launch import rank_device
        from kvcap.llm import LLM

        base = torch.device(cfg["base_device"])
        device = rank_device(base, world, rank)
        if device.type == "cpu":
            torch.set_num_threads(cfg["threads"])
        rt = TPRuntime(rank, world, device)
        store.set(f"{KEY}/ready/{rank}", b"1")
        rt.comm.init(store)
        set_worker_runtime(rt)
        llm = LLM(**cfg["llm_kwargs"], device=device, tensor_parallel_size=world)
        from kvcap.distributed.protocol import serve

        serve(llm)
        stopping.set()
        return 0
    except BaseException as e:
        stopping.set()
        exit_deadline(5)  # the error report below talks to a rank 0 that may be gone or stuck
        if getattr(e, "tp_agreed", False):
            logger.debug("stopping after an agreed refusal: %s", e)
            return 2
        logger.error("rank %d failed: %s: %s", rank, type(e).__name__, e,
                     exc_info=not isinstance(e, Exception) or "kvcap" not in type(e).__module__)
        try:
            store.set(f"{KEY}/error/{rank}", pickle.dumps((type(e).__name__, str(e))))
        except Exception:  # rank 0 (the store) is gone already
            pass
        return 1


if __name__ == "__main__":
    code = main(sys.argv[1:])
    exit_deadline(5)  # logging.shutdown can block on a handler lock (see exit_deadline)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown of a possibly broken process group
