"""Every on/off KVCAP_* switch reads its value as config.env_flag does: KVCAP_DISABLE_OVERLAP and
KVCAP_DISABLE_FUSED_SAMPLER took "false" for on, KVCAP_ENFORCE_EAGER ignored "true" / "yes"."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcap.engine.cuda_graph import graphs_disabled
from kvcap.sampling.sampler import fused_sampler_enabled

CUDA = SimpleNamespace(type="cuda")  # the sampler's switch is read before any CUDA call


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("yes", True),
                                       ("0", False), ("false", False), ("no", False),
                                       ("", False), (None, False)])
def test_switches_read_as_env_flag(monkeypatch, value, on):
    for name in ("KVCAP_ENFORCE_EAGER", "KVCAP_DISABLE_FUSED_SAMPLER"):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert graphs_disabled() is on
    pytest.importorskip("triton")
    assert fused_sampler_enabled(CUDA) is not on


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("false", False),
                                       ("0", False)])
def test_overlap_switch_reads_as_env_flag(monkeypatch, value, on):
    from kvcap.engine.engine import Engine

    monkeypatch.setenv("KVCAP_DISABLE_OVERLAP", value)
    # the constructor only stores its collaborators; the overlap needs a CUDA runner
    engine = Engine(SimpleNamespace(device=CUDA), None, None, None, max_model_len=16)
    assert engine.overlap is not on
