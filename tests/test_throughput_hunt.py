"""Bugs found in the throughput benchmark (kvcap.bench.throughput), its README table
(throughput_report) and its target verdicts (throughput_targets), each shown by a test that
failed before its fix. The benchmark's main() runs here on the CPU: the GPU-only pieces (the
CUDA check, the read ceiling, the device name) are stubbed, and every arm is a tiny
random-weight model with a pool of a chosen number of blocks."""

from __future__ import annotations

import json

import pytest

import kvcap
from kvcap.bench import step_overhead
from kvcap.bench import throughput as tp

REAL_LLM = kvcap.LLM


def _stub_gpu(monkeypatch, llm_factory) -> None:
    """main() on the CPU: LLM built by `llm_factory`, no CUDA check, a fixed read ceiling and
    device name, and the tiny random model as shape "tiny"."""
    monkeypatch.setattr(kvcap, "LLM", llm_factory)
    monkeypatch.setattr(tp, "require_cuda", lambda *a, **k: None)
    monkeypatch.setattr(tp, "read_ceiling_tbs", lambda dev: 1.0)
    monkeypatch.setattr(tp.torch.cuda, "get_device_name", lambda dev=None: "Test CPU")
    monkeypatch.setitem(tp.SHAPES, "tiny", f"dummy:{step_overhead.tiny_config_path()}")


def _run_main(monkeypatch, tmp_path, num_blocks: int, argv: list[str]) -> dict:
    """kvcap.bench.throughput.main on the CPU over a tiny model whose every arm's KV pool
    has `num_blocks` blocks; returns the report it wrote."""
    def cpu_llm(**kw):
        kw.pop("kv_cache_memory_gib", None)
        kw.update(device="cpu", dtype="float32", num_blocks=num_blocks)
        return REAL_LLM(**kw)

    _stub_gpu(monkeypatch, cpu_llm)
    out = tmp_path / "run.json"
    assert tp.main(["--shapes", "tiny", "--kv", "fp16", "--out", str(out), *argv]) == 0
    return json.loads(out.read_text())


def test_a_cell_the_scheduler_cannot_admit_at_once_is_a_skip_not_a_measurement(
        monkeypatch, tmp_path):
    """4 x 80 tokens of 16-token blocks need 20 blocks; a pool of 22 passed the benchmark's
    fit check (20 <= 22), but the scheduler admits a request next to running ones only with
    a watermark of free blocks to spare (max(1% of the pool, one per running request)): the
    fourth 74-token prompt (5 blocks) waits while three decode (22 - 15 - 5 = 2 < 3), so the
    cell ran 3 + 1 sequences, not 4 in lockstep, and was reported as a 4 x 80 measurement
    (decode_steps 1.25 instead of 5). It is a skip with its reason; a 23-block pool runs."""
    argv = ["--concurrency", "4", "--context", "80", "--out-tokens", "6", "--repeats", "1"]
    cell, = _run_main(monkeypatch, tmp_path, 22, argv)["cells"]
    assert "decode_tok_s" not in cell, cell
    assert "needs 20 KV blocks, pool has 22" in cell["skip"]
    assert "watermark" in cell["skip"]
    cell, = _run_main(monkeypatch, tmp_path, 23, argv)["cells"]
    assert "skip" not in cell and cell["decode_steps"] == 5


def _report_file(path, cells, dtype="bfloat16"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"date": "2026-12-07", "gpu": "Test GPU", "commit": "abc1234",
                                "args": {"dtype": dtype}, "cells": cells, "capacity": []}))
    return path


def _cell(kv, conc, ctx, tok_s, roofline=0.85, shape="llama-3.1-8b"):
    return {"shape": shape, "kv": kv, "concurrency": conc, "context": ctx,
            "decode_tok_s": tok_s, "roofline_fraction": roofline}


def test_two_runs_of_one_file_name_are_never_compared(tmp_path):
    """Cells are grouped into runs by file name, and that name was the base name: two runs
    both called throughput-DATE.json (the benchmark's default name, on two machines) in two
    directories were one run, so throughput_targets judged the E4M3 arm of one against the
    unquantized arm of the other (met, 1.03x) and the README table left that cross-run ratio
    unmarked."""
    from kvcap.bench import throughput_report as tr
    from kvcap.bench import throughput_targets as tt

    a = _report_file(tmp_path / "h100" / "throughput-2026-12-07.json",
                     [_cell("fp16", 16, 1024, 3000.0)])
    b = _report_file(tmp_path / "h200" / "throughput-2026-12-07.json",
                     [_cell("fp8", 16, 1024, 3100.0)])
    verdicts = tt.judge_reports(tr.load_reports([a, b]), "llama-3.1-8b")
    assert [v for v in verdicts if v.target == tt.T_E4M3] == []
    table = tr.markdown_table(tr.load_cells([a, b]))
    assert f"3,100 (1.03x{tr.CROSS_RUN})" in table
    # files of distinct base names (or one file given twice) keep their base names
    c = _report_file(tmp_path / "h200" / "other.json", [_cell("fp16", 16, 1024, 3000.0)])
    assert [name for name, _ in tr.load_reports([b, c, b])] == [
        "throughput-2026-12-07.json", "other.json", "throughput-2026-12-07.json"]


def test_a_block_larger_than_the_step_budget_is_a_usage_error(monkeypatch, tmp_path, capsys):
    """Every arm runs with max_num_batched_tokens=8192, and the engine refuses a block larger
    than a step's tokens; --block-size 16384 (a power of two) passed the argument checks and
    failed each run after the read ceiling and the calibration, a ConfigError traceback from
    the first LLM(...). A usage error (exit 2) now, before any GPU work."""
    with pytest.raises(SystemExit) as e:
        _run_main(monkeypatch, tmp_path, 8, ["--context", "32768", "--block-size", "16384"])
    assert e.value.code == 2
    assert "--block-size 16384" in capsys.readouterr().err


def test_an_infinite_rate_or_fraction_is_not_met(tmp_path):
    """A value the JSON holds as Infinity (json writes float('inf') so; another program's or
    a hand-edited file) was judged met: an E4M3 rate of inf over a finite unquantized one is
    an infinite ratio, and an infinite roofline fraction passed as it was. Like NaN, it is
    no usable value: not met."""
    from kvcap.bench import throughput_report as tr
    from kvcap.bench import throughput_targets as tt

    run = _report_file(tmp_path / "run.json", [
        _cell("fp16", 16, 1024, 3000.0, roofline=float("inf")),
        _cell("fp8", 16, 1024, float("inf"), roofline=0.9)])
    verdicts = tt.judge_reports(tr.load_reports([run]), "llama-3.1-8b")
    got = {(v.target, v.cell): v.met for v in verdicts}
    assert got[(tt.T_E4M3, "16 x 1K")] is False
    assert got[(tt.T_ROOFLINE, "16 x 1K, unquantized")] is False
    assert got[(tt.T_ROOFLINE, "16 x 1K, E4M3 (native)")] is True


def test_a_run_started_while_another_calibrates_never_takes_its_file(monkeypatch, tmp_path):
    """--out DIR names the run throughput-DATE.json, or -2, -3 ... when that exists, "an
    earlier run is never overwritten"; but the file appeared only with the first cell, after
    the read ceiling, the calibration and the first engine (minutes on a GPU), so a second
    run started meanwhile (another GPU of the host, the same --out) took the same name and
    each cell either saved replaced the other run's whole report. The name is taken when the
    run starts."""
    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--kv", "fp16", "--concurrency", "1", "--context", "80",
            "--out-tokens", "6", "--repeats", "1", "--out", str(out)]
    started = []

    def cpu_llm(**kw):
        if not started:  # the first run builds its first engine: a second run starts
            started.append(True)
            assert tp.main([*argv, "--concurrency", "2"]) == 0
        kw.pop("kv_cache_memory_gib", None)
        kw.update(device="cpu", dtype="float32", num_blocks=32)
        return REAL_LLM(**kw)

    _stub_gpu(monkeypatch, cpu_llm)
    assert tp.main(argv) == 0
    reports = sorted(out.glob("*.json"))
    assert len(reports) == 2, reports
    concurrencies = sorted(c["concurrency"] for p in reports
                           for c in json.loads(p.read_text())["cells"])
    assert concurrencies == [1, 2]


def test_an_hf_only_run_calibrates_nothing(monkeypatch, tmp_path):
    """--hf-only runs no kvcap arm, yet with the default --kv (E4M3 arms among them) it first
    calibrated E4M3 scales through a kvcap engine: minutes of prefill for nothing, and for the
    embedded model a CalibrationError (no built-in corpora on the machine) ended a run that
    needs no scales."""
    calls = []
    monkeypatch.setattr(tp, "calibrated_scales", lambda *a, **k: calls.append(a) or {})
    monkeypatch.setattr(tp, "hf_baseline", lambda model, b, ctx, out: {
        "batch": b, "context": ctx, "out_tokens": out, "e2e_s": 1.0, "tok_s": 1.0,
        "prefill_plus_one_s": 0.1, "decode_tok_s": 1.0})
    monkeypatch.setattr(tp, "require_cuda", lambda *a, **k: None)
    monkeypatch.setattr(tp, "read_ceiling_tbs", lambda dev: 1.0)
    monkeypatch.setattr(tp.torch.cuda, "get_device_name", lambda dev=None: "Test CPU")
    out = tmp_path / "hf.json"
    assert tp.main(["--hf-only", "--out", str(out)]) == 0
    assert calls == []
    assert [h["batch"] for h in json.loads(out.read_text())["hf_baseline"]] == [1, 16]
