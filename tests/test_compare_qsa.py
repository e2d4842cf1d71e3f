"""`kvcap compare --qsa PRESET`: the QSA section (selection overlap, attention-output agreement,
dense-mass recall) on a tiny random-weight Llama with a 16-token budget, its controls, the
report rendering and the CLI plumbing."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvcap.errors import ConfigError
from kvcap.eval import qsa_quality, report_md, runner

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
PRESET = "all-but-1:16"  # QSA on layers 1-3, 4 groups of 4 tokens: rows from position 19 choose
LEN = 96
RECORDS = [torch.randint(0, 320, (LEN,), generator=torch.Generator().manual_seed(s)).tolist()
           for s in (1, 2)]
SPARSE = 2 * (LEN - 19)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("compare_qsa") / "config.json"
    path.write_text(json.dumps(TINY))
    return f"dummy:{path}"


def _llm(model: str, kv: str = "fp16", qsa: str | None = PRESET):
    from kvcap.llm import LLM

    scales = None
    if kv == "fp8_e4m3":  # from the FP16 arm's K/V magnitudes of these records (max 2-3)
        scales = {f"model.layers.{i}.self_attn.{t}_scale": 3.5 / 448 for i in range(4)
                  for t in "kv"}
    return LLM(model=model, device="cpu", kv_cache_dtype=kv, kv_scales=scales, num_blocks=32,
               block_size=16, max_num_batched_tokens=32, enable_prefix_caching=False, seed=3,
               qsa=qsa)


@pytest.fixture(scope="module")
def fp16(tiny_model):
    return _llm(tiny_model)


def test_fp16_vs_e4m3_section(tiny_model, fp16):
    q = qsa_quality.run_qsa_quality({"reference": fp16, "e4m3": _llm(tiny_model, "fp8_e4m3")},
                                    "reference", RECORDS, PRESET)
    assert q["config"]["layers"] == [1, 2, 3] and q["config"]["token_budget"] == 16
    assert q["sparse_rows"] == SPARSE and q["tokens"] == 2 * LEN
    arm = q["arms"]["e4m3"]
    assert [p["layer"] for p in arm["per_layer"]] == [1, 2, 3]
    assert arm["overall"]["rows"] == 3 * SPARSE
    for p in arm["per_layer"] + [arm["overall"]]:
        assert p["selection_rows"] == 2 * p["rows"]  # two KV heads
        assert 0.5 < p["jaccard"] <= p["recall"] <= 1.0 and 0.0 <= p["exact_rows"] <= 1.0
        assert 0.95 < p["cosine"] < 1.0 and p["cosine_min"] <= p["cosine"]
        assert 0.0 < p["rel_l2"] < 0.3
    goals = {g["metric"]: g for g in arm["goals"]}
    assert goals["jaccard"]["target"] == ">= 0.99" and goals["cosine"]["target"] == ">= 0.999"
    for g in goals.values():
        assert g["per_layer_min"] <= g["per_layer_mean"]
        if g["target"]:
            assert g["met"] == (g["overall"] >= float(g["target"].split()[1]))
    mass = q["dense_mass_recall"]
    assert set(mass["per_layer"]) == {"1", "2", "3"} and mass["arm"] == "reference"
    assert 0.3 < mass["per_layer_min"] <= mass["overall"] < 1.0
    assert mass["rows_x_heads"] == SPARSE * 6 * 3
    assert mass["overall"] < mass["all_rows"]["overall"] <= 1.0
    md = "\n".join(report_md._qsa(json.loads(json.dumps(q))))
    assert "## QSA quality (preset `all-but-1:16`)" in md and "layers 1..3" in md
    assert sum(md.count(f"| {s} |") for s in ("MET", "MISSED")) == 3  # one arm, 3 targets
    rows = qsa_quality.summary_rows(q)
    assert [r[-1] for r in rows[:3]] == ["MET" if goals[k]["met"] else "MISSED"
                                          for k in ("jaccard", "recall", "cosine")]


def test_identical_arms_control(fp16):
    """The FP16 arm against itself: same selections, same outputs."""
    q = qsa_quality.run_qsa_quality({"reference": fp16, "same": fp16}, "reference", RECORDS[:1])
    o = q["arms"]["same"]["overall"]
    assert o["rows"] == SPARSE // 2 * 3
    assert o["jaccard"] == o["recall"] == o["exact_rows"] == 1.0
    assert o["cosine"] == pytest.approx(1.0, abs=1e-12) and o["rel_l2"] == 0.0
    assert all(g["met"] for g in q["arms"]["same"]["goals"] if g["target"])


def test_budget_covering_context_is_dense(tiny_model):
    """A 128-token budget over 96-token records: every row selects every token, so the
    selection holds all of the dense attention mass and no row counts as sparse."""
    llm = _llm(tiny_model, qsa="all-but-1:128")
    q = qsa_quality.run_qsa_quality({"reference": llm, "same": llm}, "reference", RECORDS[:1])
    mass = q["dense_mass_recall"]
    assert mass["all_rows"]["overall"] == pytest.approx(1.0, abs=1e-6)
    assert all(v == pytest.approx(1.0, abs=1e-6) for v in mass["all_rows"]["per_layer"].values())
    assert q["sparse_rows"] == 0 and mass["overall"] is None
    assert [g["met"] for g in q["arms"]["same"]["goals"]] == [None] * 6
    assert {r[-1] for r in qsa_quality.summary_rows(q)[:3]} == {"n/a"}


def test_dense_llm_refused(tiny_model, fp16):
    with pytest.raises(ConfigError, match="qsa="):
        qsa_quality.run_qsa_quality({"reference": _llm(tiny_model, qsa=None), "x": fp16},
                                    "reference", RECORDS[:1])
    with pytest.raises(ConfigError, match="another QSA configuration"):
        qsa_quality.run_qsa_quality({"reference": fp16, "x": _llm(tiny_model, qsa="every2:16")},
                                    "reference", RECORDS[:1])


def test_cli_and_runner_plumbing(monkeypatch, tmp_path):
    from kvcap.commands import compare

    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    args = p.parse_args(["--overlay", str(tmp_path), "--qsa", "all-but-3:256",
                         "--qsa-context", "1024", "--qsa-records", "2", "--tasks", "heldout"])
    assert compare.overrides(args) == {"qsa_context": 1024, "qsa_records": 2}
    assert runner.parse_tasks("heldout,qsa") == ("heldout", "qsa")
    seen = {}

    def fake_run(cfg):
        seen["cfg"] = cfg
        raise SystemExit(0)

    monkeypatch.setattr(runner, "run_compare", fake_run)
    with pytest.raises(SystemExit):
        compare.run(args)
    assert seen["cfg"].qsa == "all-but-3:256" and seen["cfg"].tasks == ("heldout",)
    # without --qsa: no qsa task, and asking for it alone is refused before any load
    dflt = p.parse_args(["--overlay", str(tmp_path)])
    assert dflt.qsa is None and compare.overrides(dflt) == {}
    with pytest.raises(ConfigError, match="needs a QSA preset"):
        runner._resolve(runner.CompareConfig(overlay=tmp_path, tasks=("qsa",)))
    with pytest.raises(ConfigError, match="bad QSA preset"):
        runner._resolve(runner.CompareConfig(overlay=tmp_path, tasks=("qsa",), qsa="some"))
    _, _, budget = runner._resolve(runner.CompareConfig(overlay=tmp_path, qsa="all-but-3:256",
                                                        tasks=("qsa",), quick=True))
    assert (budget.qsa_context, budget.qsa_records) == (512, 1)  # twice the budget
    with pytest.raises(ConfigError, match="exceeds the window"):
        runner._resolve(runner.CompareConfig(overlay=tmp_path, qsa="all-but-3", tasks=("qsa",),
                                             overrides={"qsa_context": 10**6}))
    settings = runner._settings(runner.CompareConfig(), runner.QUICK)
    assert "qsa" not in settings and "qsa_context" not in settings["budget"]


@pytest.mark.slow
def test_compare_qsa_end_to_end(default_model_dir, tmp_path):
    """Embedded model: calibrate -> overlay -> compare --qsa (QSA task only, 64-token budget,
    160-token record)."""
    from kvcap.commands import calibrate, overlay

    def parse(module, argv):
        ap = argparse.ArgumentParser()
        module.add_arguments(ap)
        return ap.parse_args(argv)

    cal, pack, out = tmp_path / "cal", tmp_path / "pack", tmp_path / "cmp"
    calibrate.run(parse(calibrate, ["--out", str(cal), "--max-tokens", "640",
                                    "--record-tokens", "64", "--device", "cpu"]))
    overlay.run(parse(overlay, ["--model", "default", "--report", str(cal), "--out", str(pack)]))
    cfg = runner.CompareConfig(overlay=pack, out=out, device="cpu", tasks=("qsa",), quick=True,
                               no_control=True, qsa="all-but-3:64",
                               overrides={"qsa_context": 160, "qsa_records": 1})
    _, paths = runner.run_compare(cfg)
    data = json.loads(paths["json"].read_text())
    q = data["results"]["qsa"]
    assert q["config"]["layers"] == list(range(3, 30)) and q["sparse_rows"] == 160 - 67
    o = q["arms"]["e4m3"]["overall"]
    assert 0.8 < o["jaccard"] <= 1.0 and 0.99 < o["cosine"] <= 1.0
    assert 0.5 < q["dense_mass_recall"]["overall"] <= 1.0
    assert data["settings"]["qsa"] == "all-but-3:64"
    assert data["arms"][0]["label"].endswith("QSA all-but-3:64")
    assert "## QSA quality" in paths["md"].read_text()
