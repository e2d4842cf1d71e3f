"""The step-overhead tool runs the real engine on CPU with tiny sizes and reports every phase;
the engine's step timer is off by default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("argv,message", [
    (["--concurrency", "0"], "argument --concurrency:"),
    (["--concurrency", "2048"], "--concurrency 2048: at most 2047"),
    (["--context", "-5"], "argument --context:"),
    (["--steps", "0"], "argument --steps:"),
    (["--warmup", "-1"], "argument --warmup:"),
    (["--block-size", "24"], "argument --block-size:"),
    (["--threads", "-1"], "argument --threads:"),
    (["--read-gbps", "0"], "argument --read-gbps:")])
def test_meaningless_arguments_are_usage_errors(capsys, argv, message):
    """The numbers were plain ints: --concurrency 2048 divided by zero, --steps 0 and a
    negative --warmup timed no step (RuntimeError after the whole run), a negative context or
    thread count were torch tracebacks and 0 requests the engine's max_num_seqs error."""
    with pytest.raises(SystemExit) as e:
        step_overhead.main(["--device", "cpu", "--context", "24", "--steps", "2", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_tiny_config_is_replaced_whole_never_rewritten_in_place(tmp_path, monkeypatch):
    """The shared tiny config (one path in the temporary directory for every process, e.g.
    two pytest workers) was rewritten in place, so a process reading it meanwhile could see
    it truncated; it is staged and renamed: a reader keeps the file it opened, whole."""
    monkeypatch.setattr(step_overhead.tempfile, "gettempdir", lambda: str(tmp_path))
    stale = tmp_path / "kvcap-step-overhead-tiny.json"
    stale.write_text('{"stale": true}')
    with open(stale) as reader:  # opened before the file is brought up to date
        path = step_overhead.tiny_config_path()
        assert json.loads(reader.read()) == {"stale": True}
    assert json.loads(Path(path).read_text()) == step_overhead.TINY_CONFIG
