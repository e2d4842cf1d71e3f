"""The step-overhead tool runs the real engine on CPU with tiny sizes and reports every phase;
the engine's step timer is off by default."""

from __future__ import annotations

import json

from kvcap.bench import step_overhead
from kvcap.engine.timing import PHASES, StepTimer
from kvcap.sampling_params import SamplingParams


def test_tool_reports_all_phases(tmp_path, capsys):
    out = tmp_path / "so.json"
    rc = step_overhead.main(["--device", "cpu", "--concurrency", "1", "4", "--context", "24",
                             "--steps", "3", "--warmup", "1", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    for ph in PHASES:
        assert ph in printed
    doc = json.loads(out.read_text())
    assert [r["concurrency"] for r in doc["results"]] == [1, 4]
    for r in doc["results"]:
        assert r["steps"] == 3
        for ph in (*PHASES, "step", "overhead"):
            assert r[ph]["mean_ms"] >= 0.0
        assert r["step"]["mean_ms"] >= r["forward"]["mean_ms"] > 0.0
        parts = sum(r[ph]["mean_ms"] for ph in PHASES)
        assert parts <= r["step"]["mean_ms"] * 1.0001


def test_timer_is_off_by_default_and_detaches():
    llm = step_overhead.build_llm(step_overhead.tiny_config_path(), "cpu", 2, 64, 16, "auto",
                                  False)
    eng = llm.engine
    assert eng.timer is None and eng.runner.timer is None
    timer = StepTimer("cpu")
    eng.set_timer(timer)
    eng.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3,
                                                   ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    eng.set_timer(None)
    assert eng.runner.timer is None
    assert len(timer.records) == 3
    assert [r["decode_only"] for r in timer.records] == [False, True, True]
    assert all(set(PHASES) <= set(r) for r in timer.records)
