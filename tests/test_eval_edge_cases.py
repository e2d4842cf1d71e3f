"""Edge cases of the A/B harness: masked and NaN logits, no data, undecodable paths, partial
writes and bad inputs. Each test pins a defect that was observed before its fix."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kvscale_helpers import make_checkpoint, make_report

from kvcap.commands import compare
from kvcap.errors import ConfigError
from kvcap.eval import ab, corpora, disjoint, heldout, metrics, report, report_md, runner
from kvcap.eval.corpora import Shard
from kvcap.eval.internals import LayerErrors

INF = math.inf
V = 32


class _FakeLLM:
    """`prompt_logits` from a function of the prompt; enough for run_heldout(internals=False)."""

    def __init__(self, fn):
        self.fn = fn
        self.spec = SimpleNamespace(num_layers=2)

    def prompt_logits(self, prompts):
        return [self.fn(p) for p in prompts]


def _logits(ids: list[int]) -> torch.Tensor:
    return torch.randn(len(ids), V, generator=torch.Generator().manual_seed(len(ids)))


def _goals(results: dict) -> dict:
    return {g["goal"]: g for g in report.evaluate_goals(results, "e4m3", None)}


def test_kl_ignores_tokens_masked_in_both():
    ref = torch.tensor([[2.0, 1.0, -INF], [0.5, 0.0, -INF]])
    arm = torch.tensor([[2.0, 1.5, -INF], [0.5, 0.0, 3.0]])
    kl = metrics.kl_per_position(ref, arm)
    # by hand over the reference's support (a token it masks contributes 0 * log 0 = 0)
    p, q = torch.softmax(ref[0, :2].double(), -1), torch.softmax(arm[0, :2].double(), -1)
    assert kl[0].item() == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-12)
    p, q = torch.softmax(ref[1, :2].double(), -1), torch.softmax(arm[1].double(), -1)[:2]
    assert kl[1].item() == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-12)
    assert metrics.kl_per_position(arm, ref)[1].item() == INF  # arm mass where ref has none
    assert math.isnan(metrics.kl_per_position(ref, torch.full((2, 3), math.nan))[0].item())


def test_top1_nan_rows_never_agree():
    ref = torch.tensor([[math.nan, 0.0], [1.0, 0.0], [1.0, 0.0]])
    arm = torch.tensor([[math.nan, 0.0], [math.nan, 0.0], [2.0, 0.0]])
    assert metrics.top1_agreement(ref, arm).tolist() == [False, False, True]


def test_nan_logits_are_missed_not_not_run():
    def broken(ids):
        x = _logits(ids)
        x[3, 5] = math.nan  # one stray NaN, as from an unmasked 0x7F byte
        return x

    llms = {"reference": _FakeLLM(_logits), "e4m3": _FakeLLM(broken)}
    shards = [Shard("prose", [list(range(20))], [{}])]
    summary, _ = heldout.run_heldout(llms, "reference", shards, internals=False)
    arm = summary["arms"]["e4m3"]
    assert math.isnan(arm["kl_mean"]) and sum(arm["kl_histogram"]) == arm["positions"] == 20
    assert arm["kl_histogram"][-1] == 1  # the NaN position is counted in the worst bin
    goals = _goals({"heldout": summary})
    assert goals["kl_mean"]["met"] is False
    assert goals["ppl_delta_pct"]["met"] is False


def test_layer_min_cosine_propagates_nan():
    err = LayerErrors(2)
    good = torch.ones(4, 3)
    err.add([good, good], [good, torch.full((4, 3), math.nan)])
    s = err.summary()
    assert math.isnan(s["min_cosine"]) and math.isnan(s["mean_cosine"])
    assert math.isnan(s["max_rel_l2"])


def test_no_heldout_records_is_not_run():
    llms = {"reference": _FakeLLM(_logits), "e4m3": _FakeLLM(_logits)}
    summary, _ = heldout.run_heldout(llms, "reference", [Shard("prose")], internals=True)
    arm = summary["arms"]["e4m3"]
    assert arm["top1_agreement"] is None and arm["kl_mean"] is None
    assert arm["internals"]["mean_cosine"] is None
    goals = _goals({"heldout": summary})
    for key in ("top1_agreement", "kl_mean", "ppl_delta_pct", "attn_mean_cosine",
                "attn_mean_cosine_e2e"):
        assert goals[key]["met"] is None, key  # not a perfect 1.0 cosine nor a 0.0 top-1
    assert math.isnan(metrics.ErrorAccumulator().result().cosine)


def test_retrieval_without_cases_is_not_run():
    empty = {"correct": [], "score": 0, "n": 0, "outputs": []}
    results = {"retrieval": {"cases": [], "arms": {
        "reference": empty, "e4m3": {**empty, "regressions": [], "improvements": []}}}}
    goals = _goals(results)
    assert goals["retrieval_regressions"]["met"] is None
    assert goals["retrieval_score_delta"]["met"] is None


def _meta(command: str) -> dict:
    env = dict.fromkeys(("kvcap", "torch", "transformers", "python", "device", "created"), "x")
    return {"environment": {**env, "command": command},
            "model": {"path": "/m", "fingerprint": {"scheme": "s", "sha256": "ab"}},
            "arms": [], "settings": {}, "goals": [], "timings": {"total": 1.0},
            "data": {"disjointness": {"summary": "ok"}, "eval_manifest": None, "sources": "x"}}


def test_report_with_undecodable_argv(tmp_path: Path):
    # `kvcap compare --out $'\xff'` puts a lone surrogate into sys.argv
    command = "kvcap compare --out \udcff"
    paths = report.write_report(tmp_path, _meta(command), {}, [])
    assert json.loads(paths["json"].read_text("utf-8"))["environment"]["command"] == command
    assert "\\udcff" in paths["md"].read_text("utf-8")


def test_failed_render_keeps_previous_report(tmp_path: Path, monkeypatch):
    report.write_report(tmp_path, _meta("first"), {}, [])
    before = (tmp_path / "report.json").read_bytes()

    def boom(_report):
        raise RuntimeError("render failed")

    monkeypatch.setattr(report_md, "render", boom)
    with pytest.raises(RuntimeError):
        report.write_report(tmp_path, _meta("second"), {}, [])
    assert (tmp_path / "report.json").read_bytes() == before  # still a matching pair
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_manifest_with_undecodable_file_path(tmp_path: Path):
    tok = SimpleNamespace(get_vocab=lambda: {"a": 0}, chat_template=None)
    name = f"file:{tmp_path}/\udcff.txt"
    shard = Shard(name, [[1] * 16], [{"source": "file", "path": name[5:]}])
    path = corpora.write_manifest(tmp_path / "m.json", [shard], tok, "calibration")
    data = json.loads(path.read_text("utf-8"))
    assert data["shards"][0]["name"] == name
    assert corpora.manifest_hashes(path) == {corpora.record_hash([1] * 16)}


@pytest.mark.parametrize("text", ["[1, 2]", '"x"',
                                  '{"schema": "kvcap-corpus-manifest/1", "split": '
                                  '"calibration", "shards": [{"record_hashes": []}, 3]}'])
def test_malformed_calibration_manifest_is_one_line(tmp_path: Path, monkeypatch, text):
    monkeypatch.setattr(disjoint, "tokenizer_fingerprint", lambda tok: None)
    path = tmp_path / "cal.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="cal.json"):
        disjoint.load_calibration_hashes(path, None)


def test_retrieval_tasks_with_trailing_comma():
    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    args = p.parse_args(["--overlay", "x", "--retrieval-tasks", "passkey, "])
    assert compare.overrides(args)["retrieval_tasks"] == ("passkey",)


def test_empty_retrieval_task_list_refused(default_model_dir, tmp_path: Path):
    cfg = runner.CompareConfig(overlay=tmp_path, out=tmp_path / "o",
                               overrides={"retrieval_tasks": ()})
    with pytest.raises(ConfigError, match="no retrieval task"):
        runner.run_compare(cfg)
    assert not (tmp_path / "o").exists()


def test_bad_baseline_kv_writes_nothing(default_model_dir, tmp_path: Path):
    from kvcap.scales.overlay import write_overlay

    pack = write_overlay(default_model_dir, tmp_path / "pack", None, negative_control=True)
    cfg = runner.CompareConfig(overlay=pack, out=tmp_path / "o", baseline_kv="fp8")
    with pytest.raises(ConfigError, match="baseline KV dtype"):
        runner.run_compare(cfg)
    assert not (tmp_path / "o").exists()


def test_out_inside_the_overlay_pack_is_refused_before_any_write(default_model_dir,
                                                                 tmp_path: Path):
    """--out in the overlay pack put the unit-scale control pack and the corpus manifest into
    it; --out in the base checkpoint would have written into the checkpoint."""
    from kvcap.scales.overlay import write_overlay

    pack = write_overlay(default_model_dir, tmp_path / "pack", None, negative_control=True)
    before = sorted(p.name for p in pack.iterdir())
    for out in (pack, pack / "cmp"):
        with pytest.raises(ConfigError, match="lies inside the overlay pack"):
            runner.run_compare(runner.CompareConfig(overlay=pack, out=out))
    assert sorted(p.name for p in pack.iterdir()) == before


def test_records_as_long_as_the_window_are_refused_up_front(default_model_dir):
    """A record of the model's whole position limit passed the check (> only) and failed after
    both arms had loaded ("prompt of N tokens does not fit"): one scored position follows
    each record."""
    from kvcap.models import loader

    limit = loader.read_spec(default_model_dir).position_limit
    with pytest.raises(ConfigError, match="--record-tokens"):
        runner._resolve(runner.CompareConfig(overlay=default_model_dir,
                                             overrides={"record_tokens": limit}))


@pytest.mark.parametrize("overrides, flag", [({"record_tokens": 8}, "--record-tokens 8"),
                                             ({"heldout_tokens": 10}, "--heldout-tokens 10"),
                                             ({"qsa_context": 8}, "--qsa-context 8")])
def test_records_below_the_shortest_are_refused_up_front(default_model_dir, overrides, flag):
    """--record-tokens / --qsa-context under 16 passed validation and failed in build_shards
    after every arm had loaded; --heldout-tokens under 16 built no record at all and reported
    the held-out goals as "not run"."""
    qsa = "every4:1024" if "qsa_context" in overrides else None
    with pytest.raises(ConfigError, match=flag):
        runner._resolve(runner.CompareConfig(overlay=default_model_dir, qsa=qsa,
                                             overrides=overrides))
    runner._resolve(runner.CompareConfig(overlay=default_model_dir, qsa=qsa,
                                         overrides={k: 16 for k in overrides}))


def test_control_that_is_not_a_negative_control_is_refused(tmp_path: Path):
    """--control PACK was taken as it came: a calibrated pack (say the --overlay itself) was
    reported as the "unit-scale E4M3 (negative control)" arm."""
    from kvcap.scales.overlay import write_overlay

    base = make_checkpoint(tmp_path / "base")
    cal = write_overlay(base, tmp_path / "cal", make_report(base))
    unit = write_overlay(base, tmp_path / "unit", None, negative_control=True)
    with pytest.raises(ConfigError, match="not a unit-scale negative control"):
        ab.arm_specs(base, cal, cal)
    arms = ab.arm_specs(base, cal, unit)
    assert arms[2].name == ab.CONTROL and arms[2].overlay["negative_control"] is True


def test_calibration_manifest_is_the_one_beside_the_packs_report(tmp_path: Path):
    """Two calibration runs under one parent: the pack's own (by its report's sha256) is
    found, not the first in name order; none where no report matches."""
    import hashlib

    for run in ("a-run", "b-run"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "calibration-corpus.json").write_text(json.dumps(
            {"schema": corpora.MANIFEST_SCHEMA, "split": "calibration", "shards": []}))
        (tmp_path / run / "calibration-report.json").write_text(json.dumps({"run": run}))
    report = (tmp_path / "b-run" / "calibration-report.json").read_bytes()
    pack = tmp_path / "pack"
    pack.mkdir()

    def bind(sha) -> Path | None:
        (pack / "kvscales-manifest.json").write_text(json.dumps(
            {"calibration": {"report_sha256": sha}}))
        return disjoint.find_calibration_manifest(pack)

    assert bind(hashlib.sha256(report).hexdigest()) == \
        tmp_path / "b-run" / "calibration-corpus.json"
    assert bind("0" * 64) is None
    assert bind(None) == tmp_path / "a-run" / "calibration-corpus.json"  # a pack that says not
