"""Shared fixtures: the embedded model is converted once per machine and loaded once per run."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(max(1, torch.get_num_threads()))


@pytest.fixture(scope="session")
def default_model_dir():
    from kvcap.models.loader import resolve_model_dir

    return resolve_model_dir("default")


@pytest.fixture(scope="session")
def hf_default_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir),
                                                dtype=torch.float32).eval()
