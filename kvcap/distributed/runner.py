"""Rank 0's model runner: the single-process runner plus one broadcast per step.

`execute` is unchanged (plan -> run -> sample); the plan is sent to the other ranks before the
forward, with the observer's current shard name so worker observers attribute their rows
alike. A step scheduled ahead of its tokens (engine overlap) also broadcasts its input ids on
the device: only rank 0 samples. Any exception between the broadcast and the end of the
forward leaves the ranks out of step, so it stops the whole group (`TPDriver.fail`) and every
later call fails fast.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from kvcap.distributed.launch import TPDriver
from kvcap.distributed.protocol import OBSERVER, STATS, STEP, merge_rank_stats, observer_config
from kvcap.engine.model_runner import ModelRunner, PromptLogitsFn, StepPlan


class DriverRunner(ModelRunner):
    def __init__(self, *args, driver: TPDriver, **kwargs):
        super().__init__(*args, **kwargs)
        self.driver = driver
        self.observer = None  # rank 0's KVStatsObserver (the last one attached)

    def broadcast_plan(self, plan: StepPlan) -> None:
        self.driver.check_alive()
        shard = self.observer.shard if self.observer is not None and self.kv_observer else None
        self.driver.step_open = True  # until run_plan returns (TPDriver.shutdown)
        try:
            self.driver.send((STEP, plan, shard))
        except BaseException as e:
            self._fatal(e)

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan, on_prompt_logits: PromptLogitsFn | None = None,
                 fed_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        try:
            if plan.fed:  # only rank 0 sampled the tokens this step runs on
                fed_ids = self.driver.comm.broadcast_ids(fed_ids, len(plan.ids))
            out = super().run_plan(plan, on_prompt_logits, fed_ids)
        except BaseException as e:
            self._fatal(e)
        self.driver.step_open = False
        return out

    def _fatal(self, e: BaseException) -> NoReturn:
        err = self.driver.fail(e)
        if err is e:
            raise e
        raise err from e

    def set_observer(self, obs) -> None:
        """Attach `obs` (a KVStatsObserver) here and a fresh one like it on every rank."""
        cfg = observer_config(obs) if obs is not None else None
        try:
            self.driver.send((OBSERVER, cfg))
        except BaseException as e:
            self._fatal(e)
        if obs is not None:
            self.observer = obs
        self.kv_observer = obs.observe if obs is not None else None

    def collect_stats(self, per_rank: bool = False):
        """K/V statistics of every rank's observer: merged, or a list in rank order."""
        try:
            self.driver.send((STATS,))
            stats = self.driver.gather()
        except BaseException as e:
            self._fatal(e)
        stats[0] = self.observer.stats() if self.observer is not None else None
        return stats if per_rank else merge_rank_stats(stats)
