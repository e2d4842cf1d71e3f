"""The throughput matrix's README table and PNG (kvcap.bench.throughput_report), from synthetic
JSONs and from the committed H200 runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcap.bench import throughput_report as tr
from kvcap.bench.throughput import write_table_and_png

BENCH = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
C_RUNS = [BENCH / f"throughput-2026-11-29c-h200-{ctx}.json" for ctx in ("1k", "16k")]
SHAPE = "llama-3.1-8b"


def _cell(kv, conc, ctx, tok_s, roofline=0.7, **kw):
    return {"shape": SHAPE, "kv": kv, "concurrency": conc, "context": ctx, "ttft_s": 0.4,
            "prefill_tok_s": 40000.0, "decode_tok_s": tok_s, "decode_steps": 63,
            "roofline_fraction": roofline, "fits_only_in_e4m3": False, **kw}


def _report(cells, commit="abc1234", capacity=True):
    return {"date": "2026-12-01", "gpu": "Test GPU", "commit": commit, "read_ceiling_tbs": 4.5,
            "cells": cells, "hf_baseline": [], "complete": True,
            "capacity": [{"shape": SHAPE, "kv": "fp16", "tokens": 879472,
                          "bytes_per_token": 131072}] if capacity else []}


def _write(tmp_path, name, report) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(report))
    return path


@pytest.fixture
def runs(tmp_path):
    """A 1K run (two concurrencies) and a 16K run whose FP16 64 x 16K cell did not fit."""
    short = _report([_cell("fp16", 16, 1024, 2955.67), _cell("fp16", 64, 1024, 8780.59),
                     _cell("fp8", 16, 1024, 3104.07), _cell("fp8", 64, 1024, 9270.44),
                     _cell("fp8-software", 16, 1024, 3022.51),
                     _cell("fp8-software", 64, 1024, 9710.43)], commit="aaa1111")
    skip = {"shape": SHAPE, "kv": "fp16", "concurrency": 64, "context": 16384,
            "skip": "needs 65536 KV blocks, pool has 54967", "fits_only_in_e4m3": False}
    long = _report([_cell("fp16", 16, 16384, 1271.36, roofline=0.88), skip,
                    _cell("fp8", 16, 16384, 1370.58), _cell("fp8", 64, 16384, 140.0,
                                                            fits_only_in_e4m3=True)],
                   commit="bbb2222")
    return [_write(tmp_path, "t-16k.json", long), _write(tmp_path, "t-1k.json", short)]


def test_table_rows_values_ratios_and_sources(runs):
    cells = tr.load_cells(runs)
    assert {(c["source"], c["commit"], c["gpu"]) for c in cells} == {
        ("t-16k.json", "bbb2222", "Test GPU"), ("t-1k.json", "aaa1111", "Test GPU")}
    lines = tr.markdown_table(cells).splitlines()
    assert lines[0] == "| concurrency x context | FP16 KV | E4M3 (native) | E4M3 (software) |"
    assert lines[1] == "| --- | --- | --- | --- |"
    # Sorted by context, then concurrency, whatever the file order.
    assert lines[2:6] == [
        "| 16 x 1K | 2,956 | 3,104 (1.05x) | 3,023 (1.02x) |",
        "| 64 x 1K | 8,781 | 9,270 (1.06x) | 9,710 (1.11x) |",
        "| 16 x 16K | 1,271 | 1,371 (1.08x) | not run |",
        "| 64 x 16K | does not fit (879K-token pool) | 140 (FP16 does not fit) | not run |",
    ]
    assert lines[6] == ""
    assert lines[7].startswith(f"{SHAPE} (FP16 weights) decode tok/s")
    assert lines[7].endswith("source: `t-16k.json` (commit bbb2222), `t-1k.json` (commit aaa1111)")
    assert len(lines) == 8


def test_skip_pool_size_from_the_skip_reason_without_capacity(tmp_path):
    skip = {"shape": SHAPE, "kv": "fp16", "concurrency": 64, "context": 16384,
            "skip": "needs 65536 KV blocks, pool has 54954"}
    path = _write(tmp_path, "p.json", _report([skip, _cell("fp8", 64, 16384, 2137.1)],
                                              capacity=False))
    table = tr.markdown_table(tr.load_cells([path]))
    # 54954 blocks x 16 tokens (1024 blocks for 16384 tokens) = 879,264 tokens.
    assert "| 64 x 16K | does not fit (879K-token pool) | 2,137 (FP16 does not fit) | not run |" \
        in table


def test_plot_writes_a_png(runs, tmp_path):
    out = tmp_path / "figs" / "t.png"
    assert tr.plot(tr.load_cells(runs), out) == out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert [p.name for p in out.parent.iterdir()] == ["t.png"]  # no temporary left behind


def test_the_benchmark_prints_the_table_and_writes_the_png_next_to_its_json(runs, capsys,
                                                                              monkeypatch,
                                                                              caplog):
    report = json.loads(runs[0].read_text())
    assert write_table_and_png(report, runs[0]) == [runs[0].with_suffix(".png")]
    assert runs[0].with_suffix(".png").stat().st_size > 0
    assert "| 16 x 16K | 1,271 | 1,371 (1.08x) | not run |" in capsys.readouterr().out
    # Without matplotlib: the table, a warning, no PNG and no failure.
    runs[0].with_suffix(".png").unlink()
    for name in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    assert write_table_and_png(report, runs[0]) == []
    assert not runs[0].with_suffix(".png").exists()
    assert "matplotlib" in caplog.text
    assert "| 16 x 16K |" in capsys.readouterr().out


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvcap.bench.throughput_report", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_prints_the_table_and_writes_the_png(runs, tmp_path):
    out = tmp_path / "cli.png"
    r = _cli(*map(str, runs), "--png", str(out))
    assert r.returncode == 0, r.stderr
    assert "| 64 x 1K | 8,781 | 9,270 (1.06x) | 9,710 (1.11x) |" in r.stdout
    assert out.stat().st_size > 0


@pytest.mark.parametrize("kind", ["missing", "invalid", "not-a-report", "no-such-shape"])
def test_cli_errors_are_one_line_exit_2(tmp_path, runs, kind):
    bad = tmp_path / "bad.json"
    if kind == "invalid":
        bad.write_text("{not json")
    elif kind == "not-a-report":
        bad.write_text('{"rows": []}')
    args = [str(runs[0]), "--shape", "nope"] if kind == "no-such-shape" else [str(bad)]
    r = _cli(*args)
    assert r.returncode == 2
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: ")
    if kind == "missing":
        assert "bad.json" in r.stderr


def test_committed_h200_runs():
    table = tr.markdown_table(tr.load_cells(C_RUNS))
    assert "| 16 x 1K | 2,956 | 3,104 (1.05x) | 3,023 (1.02x) |" in table
    assert "| 16 x 16K | 1,271 |" in table
    assert "(commit b195e08)" in table


def test_model_dtype_labels_and_no_mixing(tmp_path):
    """A BF16-weight run is labelled BF16 (its unquantized arm's KV is BF16), and FP16- and
    BF16-weight runs are never merged into one table."""
    bf16 = _report([_cell("fp16", 16, 1024, 3000.0), _cell("fp8", 16, 1024, 3100.0),
                    {"shape": SHAPE, "kv": "fp16", "concurrency": 64, "context": 16384,
                     "skip": "needs 65536 KV blocks, pool has 54967"},
                    _cell("fp8", 64, 16384, 2800.0, fits_only_in_e4m3=True)])
    bf16["args"] = {"dtype": "bfloat16"}
    path = _write(tmp_path, "bf16.json", bf16)
    table = tr.markdown_table(tr.load_cells([path]))
    assert table.splitlines()[0].startswith("| concurrency x context | BF16 KV | E4M3 (native)")
    assert "| 16 x 1K | 3,000 | 3,100 (1.03x) |" in table
    assert "2,800 (BF16 does not fit)" in table
    assert "(BF16 weights) decode tok/s (E4M3/BF16 in parentheses)" in table
    for cell in bf16["cells"]:  # the same run with an FP8 checkpoint's linears kept FP8
        cell["fp8_weights"] = True
    table = tr.markdown_table(tr.load_cells([_write(tmp_path, "fp8w.json", bf16)]))
    assert "(FP8 weights) decode tok/s (E4M3/BF16 in parentheses)" in table
    fp16 = _write(tmp_path, "fp16.json", _report([_cell("fp16", 16, 1024, 2900.0)]))
    with pytest.raises(tr.ReportError, match="mix model dtypes"):
        tr.markdown_table(tr.load_cells([path, fp16]))


def test_ratios_across_runs_are_marked(tmp_path):
    """A ratio whose E4M3 and unquantized cells come from two files carries a dagger and the
    table says what it means; ratios within one file carry none."""
    old = _write(tmp_path, "old.json", _report([_cell("fp16", 16, 1024, 3000.0),
                                                _cell("fp8-software", 16, 1024, 3060.0)]))
    new = _write(tmp_path, "new.json", _report([_cell("fp16", 16, 1024, 3100.0),
                                                _cell("fp8", 16, 1024, 3200.0)]))
    table = tr.markdown_table(tr.load_cells([old, new]))
    assert f"| 16 x 1K | 3,100 | 3,200 (1.03x) | 3,060 (0.99x{tr.CROSS_RUN}) |" in table
    assert table.endswith("(kvcap bench throughput_targets compares arms of one run only)")
    assert tr.CROSS_RUN not in tr.markdown_table(tr.load_cells([new]))


@pytest.mark.parametrize("change,what", [
    (lambda r: r.update(args="--dtype bfloat16"), "'args' is not an object"),
    (lambda r: r.update(args={"dtype": ["bfloat16"]}), "args.dtype is not a string"),
    (lambda r: r.update(capacity=3), "'capacity' is not a list"),
    (lambda r: r["capacity"][0].update(shape=[SHAPE]), "'capacity' is not a list"),
    (lambda r: r["cells"][0].update(kv={"name": "fp16"}), "shape and kv must be strings"),
    (lambda r: r["cells"][0].update(roofline_fraction="0.7"), "roofline_fraction is not"),
    (lambda r: r["cells"][1].update(decode_tok_s=True), "neither 'decode_tok_s'")])
def test_foreign_fields_are_one_line_errors(tmp_path, capsys, change, what):
    """Fields another program writes differently ('args' a string, a list where a name goes,
    a roofline as text) were AttributeError / TypeError tracebacks from inside the table and
    the PNG (unhashable names, "Unknown format code 'f'"): one line naming the file."""
    report = _report([_cell("fp16", 16, 1024, 2955.67), _cell("fp8", 16, 1024, 3104.07)])
    change(report)
    path = _write(tmp_path, "foreign.json", report)
    assert tr.main([str(path), "--png", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: foreign.json: ") and what in err
    assert not (tmp_path / "t.png").exists()


def test_a_zero_unquantized_rate_is_no_ratio_not_a_division_error(tmp_path, capsys):
    """An unquantized cell with decode_tok_s 0 (and a skipped cell whose capacity record's
    tokens are text) was a ZeroDivisionError / TypeError: the ratio is nan, as one to a NaN
    rate, and the pool comes from the skip reason."""
    skip = {"shape": SHAPE, "kv": "fp16", "concurrency": 64, "context": 16384,
            "skip": "needs 65536 KV blocks, pool has 54967"}
    report = _report([_cell("fp16", 16, 1024, 0.0), _cell("fp8", 16, 1024, 3104.07), skip])
    report["capacity"][0]["tokens"] = "879472"
    assert tr.main([str(_write(tmp_path, "zero.json", report))]) == 0
    out = capsys.readouterr().out
    assert "| 16 x 1K | 0 | 3,104 (nanx) |" in out
    assert "| 64 x 16K | does not fit (879K-token pool) |" in out
