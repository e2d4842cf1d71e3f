"""Report completeness: goals, self-describing metadata, report.md sections, plots; and
compare's input validation failing before any model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcap.errors import ConfigError, KvcapError
from kvcap.eval import plots, report, runner


def _results() -> dict:
    per_layer = [{"layer": i, "cosine": 0.9995, "rel_l2": 0.03, "rmse": 0.01} for i in range(3)]
    internals = {"per_layer": per_layer, "mean_cosine": 0.9995, "min_cosine": 0.9995,
                 "max_rel_l2": 0.03, "mean_rel_l2": 0.03}
    edges = [1e-10, 1e-5, 1e-3, 1e-1, 10.0]
    arm = {"perplexity": 10.02, "nll_mean": 2.3, "ppl_delta_pct": 0.2, "positions": 100,
           "top1_agreement": 0.995, "kl_mean": 1e-3, "kl_max": 0.02,
           "kl_quantiles": {"p99": 0.01}, "kl_histogram": [10, 50, 30, 10],
           "internals": internals, "internals_isolated": internals,
           "per_shard": {"prose": {"perplexity": 10.0, "kl_mean": 1e-3,
                                   "top1_agreement": 0.99}}}
    control = {**arm, "top1_agreement": 0.97, "kl_mean": 5e-3, "ppl_delta_pct": 1.0}
    ref = {"perplexity": 10.0, "nll_mean": 2.3, "ppl_delta_pct": 0.0,
           "per_shard": {"prose": {"perplexity": 10.0}}}
    gen_arm = {"n": 4, "first_token_equal": 4, "identical": 3, "first_divergences": [17],
               "by_kind": {"plain": {"n": 4, "first_token_equal": 4, "identical": 3}},
               "cases": [], "mean_unigram_jaccard": 0.9,
               "divergence_examples": [{"prompt": 1, "kind": "plain", "first_divergence": 17,
                                        "reference": "a b c", "arm": "a b d"}]}
    cases = [{"id": f"passkey@512/{d}", "task": "passkey", "context": 512, "depth": d,
              "answer": "12345", "needle_token": 10, "hash": "h", "provenance": {}}
             for d in (0, 50, 100)]
    return {
        "heldout": {"records": 2, "tokens": 100, "shards": {"prose": {"records": 2,
                                                                      "tokens": 100}},
                    "kl_histogram_edges": edges,
                    "arms": {"reference": ref, "e4m3": arm, "e4m3_unit": control}},
        "generation": {"max_new_tokens": 8, "prompts": [{}] * 4, "reference_lengths": [8] * 4,
                       "arms": {"e4m3": gen_arm, "e4m3_unit": {**gen_arm,
                                                               "first_token_equal": 3}}},
        "retrieval": {"cases": cases, "arms": {
            "reference": {"correct": [True, True, False], "score": 2, "n": 3, "outputs": []},
            "e4m3": {"correct": [True, True, False], "score": 2, "n": 3, "outputs": [],
                     "regressions": [], "improvements": []},
            "e4m3_unit": {"correct": [True, False, True], "score": 2, "n": 3, "outputs": [],
                          "regressions": ["passkey@512/50"],
                          "improvements": ["passkey@512/100"]}}},
    }


def test_goals():
    goals = {g["goal"]: g for g in report.evaluate_goals(_results(), "e4m3", "e4m3_unit")}
    assert set(goals) == {g[0] for g in report.GOALS}
    assert goals["first_token_agreement"]["value"] == 1.0
    assert goals["first_token_agreement"]["control_value"] == 0.75
    assert goals["top1_agreement"]["met"] is True
    assert goals["kl_mean"]["met"] is True and goals["kl_mean"]["control_value"] == 5e-3
    assert goals["retrieval_regressions"]["value"] == 0
    assert goals["retrieval_regressions"]["control_value"] == 1
    assert goals["retrieval_score_delta"]["value"] == 0
    assert goals["attn_mean_cosine"]["met"] is True
    assert goals["attn_mean_cosine_e2e"]["value"] == 0.9995
    missing = report.evaluate_goals({}, "e4m3", None)
    assert all(g["met"] is None for g in missing)


def test_a_failed_figure_write_leaves_the_earlier_figure_whole(tmp_path: Path, monkeypatch):
    """A figure is rendered in memory and renamed into place: a write that fails midway
    (disk full, a stopped run) keeps the earlier PNG and leaves no partial or staging file
    (savefig wrote the file in place)."""
    results = _results()
    labels = {"reference": "fp16 KV", "e4m3": "E4M3", "e4m3_unit": "unit"}
    plots.write_plots(results, labels, tmp_path)
    before = (tmp_path / "kl_distribution.png").read_bytes()
    real_open = open

    def full_disk(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if "w" in mode and ".png" in str(file):
            f.write(b"\x89PNG partial")
            f.close()
            raise OSError(28, "No space left on device")
        return f

    monkeypatch.setattr("builtins.open", full_disk)
    with pytest.raises(OSError, match="No space"):
        plots.kl_distribution(results["heldout"], labels, tmp_path / "kl_distribution.png")
    monkeypatch.undo()
    assert (tmp_path / "kl_distribution.png").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "kl_distribution.png", "per_layer_error.png", "retrieval_grid.png"]


def test_report_files_are_self_describing(tmp_path: Path):
    results = _results()
    labels = {"reference": "fp16 KV", "e4m3": "E4M3", "e4m3_unit": "unit"}
    names = plots.write_plots(results, labels, tmp_path)
    assert set(names) == {"per_layer_error.png", "kl_distribution.png", "retrieval_grid.png"}
    for n in names:
        assert (tmp_path / n).stat().st_size > 1000
    meta = {
        "environment": report.environment("cpu"),
        "model": {"path": "/m", "spec": {}, "fingerprint": {"scheme": "sha256(x)",
                                                              "sha256": "ab" * 32}},
        "arms": [{"name": "reference", "label": "fp16 KV", "kv_cache_dtype": "fp16",
                  "overlay": None},
                 {"name": "e4m3", "label": "E4M3", "kv_cache_dtype": "fp8_e4m3",
                  "overlay": {"scale_file_sha256": "cd" * 32, "scale_min": 0.01,
                              "scale_max": 0.05}}],
        "settings": {"quick": True}, "data": {"disjointness": {"summary": "0 overlaps"},
                                              "eval_manifest": "m.json", "sources": "x"},
        "goals": report.evaluate_goals(results, "e4m3", "e4m3_unit"),
        "timings": {"total": 1.0},
    }
    paths = report.write_report(tmp_path, meta, results, names)
    data = json.loads(paths["json"].read_text())
    for key in ("environment", "model", "arms", "settings", "data", "goals", "results",
                "plots", "timings"):
        assert key in data
    for key in ("kvcap", "torch", "transformers", "python", "device", "created", "command"):
        assert data["environment"][key]
    md = paths["md"].read_text()
    for section in ("## Goals", "## Held-out", "## Greedy generation", "## Retrieval",
                    "## Data provenance", "## Figures", "same layer inputs", "end to end",
                    "ab" * 32, "cd" * 32, "passkey@512/50"):
        assert section in md


def test_parse_tasks():
    assert runner.parse_tasks("heldout, retrieval") == ("heldout", "retrieval")
    with pytest.raises(ConfigError, match="unknown task bogus"):
        runner.parse_tasks("heldout,bogus")


def test_context_beyond_window_fails_fast(default_model_dir, tmp_path: Path):
    cfg = runner.CompareConfig(overlay=tmp_path, out=tmp_path / "o",
                               overrides={"contexts": (1024, 100000)})
    with pytest.raises(ConfigError, match="exceeds the model's window"):
        runner.run_compare(cfg)
    assert not (tmp_path / "o").exists()


def test_overlay_for_another_checkpoint_fails_fast(default_model_dir, tmp_path: Path):
    import torch
    from safetensors.torch import save_file

    from kvcap.scales.overlay import write_overlay

    other = tmp_path / "other"
    other.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576,
           "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
           "intermediate_size": 1536, "vocab_size": 49152, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 8192, "tie_word_embeddings": True}
    (other / "config.json").write_text(json.dumps(cfg))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(other / "model.safetensors"))
    pack = write_overlay(other, tmp_path / "pack", None, negative_control=True)
    with pytest.raises(KvcapError, match="wrong checkpoint revision"):
        runner.run_compare(runner.CompareConfig(overlay=pack, out=tmp_path / "o",
                                                no_control=True))
