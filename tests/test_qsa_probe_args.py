"""The QSA probes' command lines (python -m kvcap.qsa.needle / recall): bad arguments are
usage errors before any model loads (the probes themselves are slow: tests/test_qsa_needle.py)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("module", ["needle", "recall"])
@pytest.mark.parametrize("argv,message", [
    (["--depths", "50,x"], "argument --depths: '50,x': expected comma-separated integers 0-100"),
    (["--depths", "150"], "expected comma-separated integers 0-100"),
    (["--every", "0"], "argument --every: '0': expected an integer >= 1"),
    (["--context", "-5"], "argument --context: '-5': expected an integer >= 1"),
])
def test_probe_arguments_refused_before_any_model_loads(monkeypatch, capsys, module, argv,
                                                        message):
    """A bad --depths was a ValueError traceback after the models had loaded."""
    import importlib

    mod = importlib.import_module(f"kvcap.qsa.{module}")
    monkeypatch.setattr("kvcap.LLM", lambda *a, **kw: pytest.fail("a model loaded"))
    if hasattr(mod, "build_pair"):
        monkeypatch.setattr(mod, "build_pair", lambda *a, **kw: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_needle_refuses_an_unknown_summary_before_loading(monkeypatch, capsys):
    from kvcap.qsa import needle

    monkeypatch.setattr(needle, "build_pair", lambda *a, **kw: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as e:
        needle.main(["--summary", "median"])
    assert e.value.code == 2 and "QSA summary 'median' is not one of" in capsys.readouterr().err
