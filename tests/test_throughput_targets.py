"""The end-to-end decode targets judged cell by cell (kvcap.bench.throughput_targets), from
synthetic throughput JSONs and from the committed H200 runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcap.bench import throughput_targets as tt
from kvcap.bench.throughput_report import ReportError, load_cells, load_reports

BENCH = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
SHAPE = "llama-3.1-8b"


def _cell(kv, conc, ctx, tok_s, roofline=0.85, **kw):
    return {"shape": SHAPE, "kv": kv, "concurrency": conc, "context": ctx,
            "decode_tok_s": tok_s, "roofline_fraction": roofline, **kw}


def _write(tmp_path, name, cells, pools=(879472, 1758192), dtype="bfloat16") -> Path:
    report = {"date": "2026-12-03", "gpu": "Test GPU", "commit": name[:7], "cells": cells,
              "args": {"dtype": dtype},
              "capacity": [{"shape": SHAPE, "kv": kv, "tokens": n}
                           for kv, n in zip(("fp16", "fp8"), pools, strict=True) if n]}
    path = tmp_path / name
    path.write_text(json.dumps(report))
    return path


def _judge(paths):
    return tt.judge(load_cells(paths), SHAPE, tt.capacity_ratios(load_reports(paths), SHAPE))


def _by(verdicts, target_prefix):
    return {v.cell: v for v in verdicts if v.target.startswith(target_prefix)}


def test_every_target_on_every_cell(tmp_path):
    run = _write(tmp_path, "run.json", [
        _cell("fp16", 1, 1024, 200.0, roofline=0.74), _cell("fp8", 1, 1024, 199.0),
        _cell("fp8-software", 1, 1024, 193.0),  # 0.965x: more than 3% slower
        _cell("fp16", 16, 16384, 1000.0, roofline=0.87), _cell("fp8", 16, 16384, 1290.0,
                                                               roofline=0.79),
        _cell("fp8-software", 16, 16384, 1250.0, roofline=0.80)])
    verdicts = _judge([run])
    cap = _by(verdicts, "KV capacity")["pool"]
    assert cap.met and cap.value == pytest.approx(1758192 / 879472)
    e4m3 = _by(verdicts, "E4M3 >= unquantized")
    assert not e4m3["1 x 1K"].met and e4m3["1 x 1K"].value == pytest.approx(0.995)
    assert e4m3["16 x 16K"].met
    long = _by(verdicts, "E4M3 >= 1.3x")
    assert list(long) == ["16 x 16K"] and not long["16 x 16K"].met  # 1.29x; 1 x 1K not judged
    sw = _by(verdicts, "software")
    assert not sw["1 x 1K"].met and sw["16 x 16K"].met
    roof = _by(verdicts, "roofline")  # concurrency >= 16 only, every arm
    assert set(roof) == {"16 x 16K, unquantized", "16 x 16K, E4M3 (native)",
                         "16 x 16K, E4M3 (software)"}
    assert [roof[k].met for k in sorted(roof)] == [False, True, True]  # native, software, 16-bit
    assert [v.target for v in verdicts][0].startswith("KV capacity")


def test_ratios_never_cross_files_and_later_files_win(tmp_path):
    only16 = _write(tmp_path, "a-16bit.json", [_cell("fp16", 16, 1024, 3000.0)])
    only8 = _write(tmp_path, "b-e4m3.json", [_cell("fp8", 16, 1024, 2000.0)], pools=(0, 0))
    assert _by(_judge([only16, only8]), "E4M3 >=") == {}  # 0.67x across runs: not judged
    old = _write(tmp_path, "c-old.json", [_cell("fp16", 16, 1024, 3000.0),
                                          _cell("fp8", 16, 1024, 2900.0)])
    new = _write(tmp_path, "d-new.json", [_cell("fp16", 16, 1024, 3000.0),
                                          _cell("fp8", 16, 1024, 3100.0)], pools=(100, 150))
    verdicts = _judge([old, new])
    v = _by(verdicts, "E4M3 >= unquantized")["16 x 1K"]
    assert v.met and v.source == "d-new.json"
    cap = _by(verdicts, "KV capacity")["pool"]
    assert cap.source == "d-new.json" and not cap.met  # 1.5x
    assert _by(_judge([new, old]), "E4M3 >= unquantized")["16 x 1K"].source == "c-old.json"


def test_cells_that_did_not_fit_are_not_judged(tmp_path):
    skip = {"shape": SHAPE, "kv": "fp16", "concurrency": 64, "context": 16384,
            "skip": "needs 65536 KV blocks, pool has 54967"}
    run = _write(tmp_path, "run.json", [skip, _cell("fp8", 64, 16384, 2884.0, roofline=0.81)])
    verdicts = _judge([run])
    assert _by(verdicts, "E4M3 >=") == {}
    assert _by(verdicts, "roofline")["64 x 16K, E4M3 (native)"].met


def test_mixed_model_dtypes_are_refused(tmp_path):
    a = _write(tmp_path, "a.json", [_cell("fp16", 16, 1024, 1.0)], dtype="float16")
    b = _write(tmp_path, "b.json", [_cell("fp16", 16, 1024, 1.0)])
    with pytest.raises(ReportError, match="mix model dtypes"):
        _judge([a, b])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvcap.bench.throughput_targets", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_table_summary_and_errors(tmp_path):
    run = _write(tmp_path, "run.json", [_cell("fp16", 16, 1024, 3000.0, roofline=0.73),
                                        _cell("fp8", 16, 1024, 3090.0, roofline=0.70)])
    r = _cli(str(run))
    assert r.returncode == 0, r.stderr
    assert "| E4M3 >= unquantized decode | 16 x 1K | 1.030x | yes | `run.json` |" in r.stdout
    assert ("- roofline >= 0.80 at c >= 16: met in 0 of 2 cell(s); not met: 16 x 1K, "
            "E4M3 (native); 16 x 1K, unquantized") in r.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = _cli(str(bad))
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1


def test_committed_h200_runs():
    """The README's BF16 table files: capacity 2.00x met; every E4M3 cell judged within one
    run; roofline verdicts only at concurrency >= 16."""
    paths = sorted(BENCH.glob("throughput-2026-12-03i-h200-*-bf16*.json"))
    assert paths
    verdicts = _judge(paths)
    assert _by(verdicts, "KV capacity")["pool"].value == pytest.approx(2.0, abs=1e-3)
    assert all(int(v.cell.split(" x ")[0]) >= 16 for v in _by(verdicts, "roofline").values())
    assert "16 x 16K" in _by(verdicts, "E4M3 >= 1.3x")


def test_roofline_is_judged_on_the_8b_shape_only(tmp_path):
    cells = [dict(_cell("fp16", 16, 1024, 3000.0, roofline=0.7), shape="gqa6-d256"),
             dict(_cell("fp8", 16, 1024, 3100.0, roofline=0.7), shape="gqa6-d256")]
    run = _write(tmp_path, "gqa6.json", cells)
    verdicts = tt.judge(load_cells([run]), "gqa6-d256")
    assert _by(verdicts, "roofline") == {}
    assert _by(verdicts, "E4M3 >= unquantized")["16 x 1K"].met
