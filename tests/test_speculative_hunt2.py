"""Speculative decoding by prompt lookup: bugs found by a second hunt (options, validation)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcap.config import EngineConfig
from kvcap.errors import ConfigError


def test_disable_by_batch_size_refuses_a_bool_before_the_model_loads():
    """True is an int to Python: it was taken as a limit of 1 running request (the other
    counts refuse bools), and LLM(...) went on to load the model."""
    from kvcap import LLM

    with pytest.raises(ConfigError, match="speculative_disable_by_batch_size"):
        EngineConfig(num_speculative_tokens=4, speculative_disable_by_batch_size=True).validate()
    # refused before anything is read: the model path does not exist
    with pytest.raises(ConfigError, match="speculative_disable_by_batch_size"):
        LLM(model="/nonexistent/model", device="cpu", num_speculative_tokens=4,
            speculative_disable_by_batch_size=True)


def test_disable_by_batch_size_takes_numpy_integers():
    """Every other count takes numpy's integers; this one refused np.int64(2) with "must be an
    integer >= 1 ..., got 2"."""
    from kvcap.engine.block_manager import BlockManager
    from kvcap.engine.ngram import NgramProposer
    from kvcap.engine.scheduler import Scheduler

    cfg = EngineConfig(max_model_len=64, num_speculative_tokens=4,
                       speculative_disable_by_batch_size=np.int64(2))
    cfg.validate()
    s = Scheduler(cfg, BlockManager(8, cfg.block_size), proposer=NgramProposer(4))
    assert s.draft_max_batch == 2
