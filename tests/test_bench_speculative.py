"""The speculative-decoding benchmark: its agreement bookkeeping, and a tiny run on the CPU."""

import json

import pytest

from kvcap.bench import speculative


def test_agreement_counts_equal_requests_and_first_difference():
    ref = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6]]
    got = [[1, 2, 3, 4], [1, 2, 9, 4], [5, 6, 7]]
    assert speculative._agreement(got, ref) == {"requests_equal": 1, "first_difference": 2}
    assert speculative._agreement(ref, ref) == {"requests_equal": 3, "first_difference": None}


def test_tiny_exact_run_records_agreement(tmp_path):
    assert speculative.main(["--device", "cpu", "--dtype", "float32", "--exact", "--k", "0,2",
                             "--concurrency", "1,2", "--max-tokens", "6", "--threads", "2",
                             "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("speculative-*.json")
    result = json.loads(path.read_text())
    assert result["dtype"] == "float32" and result["exact"] is True
    rows = result["rows"]
    assert {(r["k"], r["concurrency"]) for r in rows} == {(0, 1), (0, 2), (2, 1), (2, 2)}
    for r in rows:
        assert r["requests_equal"] == r["concurrency"] and r["first_difference"] is None
        assert r["requests_equal_alone"] == r["concurrency"]


@pytest.mark.parametrize("argv,flag", [(["--repeats", "0"], "--repeats"),
                                       (["--k", "0,two"], "--k"),
                                       (["--concurrency", "1,0"], "--concurrency"),
                                       (["--max-tokens", "0"], "--max-tokens"),
                                       (["--threads", "-2"], "--threads")])
def test_meaningless_arguments_are_usage_errors(capsys, argv, flag):
    """--repeats 0 loaded the model and divided by zero at its first row; the comma lists
    were int() tracebacks; 0 tokens or requests, or a negative thread count, were errors from
    deep inside the engine or torch."""
    with pytest.raises(SystemExit) as e:
        speculative.main(["--device", "cpu", "--k", "0,2", "--max-tokens", "4", *argv])
    assert e.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err
