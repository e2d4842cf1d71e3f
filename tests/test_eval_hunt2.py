"""Second correctness hunt in the A/B harness and its commands; each test fails without its fix:

- a QSA record of the model's whole window (the default where twice the budget reaches it, or
  --qsa-context = the window) passed validation and failed after every arm had loaded;
- --qsa-context / --qsa-records without --qsa were ignored without a word, and --qsa-context
  still sized every arm's KV pool;
- the KV pool of every arm was sized for the retrieval contexts when retrieval did not run;
- a refused overlay left an empty --out directory behind (mkdir ran before the check);
- `kvcap demo --memory-gib` too small for one KV block was refused at the last step, after
  minutes of calibration and comparison;
- perplexity raised OverflowError (math.exp) for a mean NLL past ~709.8 nats, after scoring.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kvscale_helpers import make_report

from kvcap.errors import ConfigError, KvcapError
from kvcap.eval import ab, heldout, metrics, report, runner
from kvcap.eval.corpora import Shard


# ----------------------------------------------------------------------------- QSA context
def test_qsa_record_of_the_whole_window_is_refused_up_front(default_model_dir):
    """every4:4096 on the 8192-token embedded model: the default record (twice the budget)
    was the whole window; `prompt_logits` refuses such a prompt (one position follows it),
    but only after every arm had loaded."""
    from kvcap.models import loader

    window = loader.read_spec(default_model_dir).position_limit
    cfg = runner.CompareConfig(overlay=default_model_dir, qsa=f"every4:{window // 2}",
                               tasks=("qsa",))
    _, _, budget = runner._resolve(cfg)
    assert budget.qsa_context < window
    with pytest.raises(ConfigError, match=f"--qsa-context {window - 1}"):
        runner._resolve(runner.CompareConfig(overlay=default_model_dir, qsa="every4:1024",
                                             tasks=("qsa",),
                                             overrides={"qsa_context": window}))
    _, _, budget = runner._resolve(runner.CompareConfig(
        overlay=default_model_dir, qsa="every4:1024", tasks=("qsa",),
        overrides={"qsa_context": window - 1}))
    assert budget.qsa_context == window - 1


def test_a_whole_window_prompt_is_what_prompt_logits_refuses(tiny):
    """Why the QSA context must stay below the window: the rule the check above mirrors."""
    from kvcap.llm import LLM

    llm = LLM(model=tiny, device="cpu")
    n = llm.max_model_len
    assert llm.prompt_logits([[5] * (n - 1)])[0].shape[0] == n - 1
    with pytest.raises(ConfigError, match="does not fit"):
        llm.prompt_logits([[5] * n])


@pytest.mark.parametrize("argv, flags", [(["--qsa-context", "1000000"], "--qsa-context"),
                                         (["--qsa-records", "3"], "--qsa-records"),
                                         (["--qsa-context", "64", "--qsa-records", "3"],
                                          "--qsa-context and --qsa-records")])
def test_qsa_flags_without_qsa_are_refused(default_model_dir, tmp_path: Path, argv, flags):
    from kvcap.commands import compare

    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    args = p.parse_args(["--overlay", str(default_model_dir), *argv])
    cfg = runner.CompareConfig(overlay=default_model_dir, overrides=compare.overrides(args))
    with pytest.raises(ConfigError, match=f"{flags} need --qsa"):
        runner._resolve(cfg)


# ----------------------------------------------------------------------------- KV pool size
class _Loaded(Exception):
    pass


@pytest.fixture
def calibrated_pack(default_model_dir, tmp_path: Path) -> Path:
    from kvcap.scales.overlay import write_overlay

    return write_overlay(default_model_dir, tmp_path / "pack", make_report(default_model_dir))


@pytest.mark.parametrize("tasks, quick, want", [(("heldout",), False, runner.FULL.record_tokens),
                                                (("internals",), True, runner.QUICK.record_tokens),
                                                (("generation",), False,
                                                 512 + runner.FULL.max_new_tokens),
                                                (("retrieval",), True,
                                                 2 * max(runner.QUICK.contexts)),
                                                (("heldout", "retrieval"), False,
                                                 2 * max(runner.FULL.contexts))])
def test_kv_pool_is_sized_by_the_tasks_that_run(calibrated_pack, tmp_path: Path, monkeypatch,
                                                tasks, quick, want):
    """--tasks heldout allocated every arm a pool for the 8192-token retrieval contexts it
    never ran (16384 tokens for 512-token records: 755 MB per arm of the embedded model)."""
    seen = {}

    def fake_build(base, arms, device, max_tokens, **kw):
        seen["need"] = max_tokens
        raise _Loaded

    monkeypatch.setattr(ab, "build_llms", fake_build)
    cfg = runner.CompareConfig(overlay=calibrated_pack, out=tmp_path / "o", tasks=tasks,
                               quick=quick, no_control=True)
    with pytest.raises(_Loaded):
        runner.run_compare(cfg)
    assert seen["need"] == want


# ----------------------------------------------------------------------------- no writes
def test_a_refused_overlay_leaves_no_out_directory(default_model_dir, tmp_path: Path):
    not_a_pack = tmp_path / "empty"
    not_a_pack.mkdir()
    with pytest.raises(KvcapError):
        runner.run_compare(runner.CompareConfig(overlay=not_a_pack, out=tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_demo_refuses_a_budget_of_no_block_before_its_first_step(tmp_path: Path, monkeypatch):
    from kvcap.commands import calibrate, demo

    def no_calibration(_args):
        raise AssertionError("calibration ran on a budget the capacity step refuses")

    monkeypatch.setattr(calibrate, "run", no_calibration)
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path / "demo"), "--memory-gib", "1e-6",
                         "--device", "cpu"])
    with pytest.raises(ConfigError, match="--memory-gib 1e-06 holds no FP16 block"):
        demo.run(args)
    assert not (tmp_path / "demo").exists()


# ----------------------------------------------------------------------------- perplexity
def test_perplexity_past_the_float_range_is_inf_not_an_overflow():
    assert metrics.perplexity(2.0 * 10, 10) == pytest.approx(math.exp(2.0))
    assert metrics.perplexity(710.0 * 3, 3) == math.inf
    assert math.isnan(metrics.perplexity(0.0, 0))


def test_heldout_with_an_arm_of_huge_nll_reports_a_missed_goal():
    """A broken arm that puts the next token ~2000 nats down: run_heldout raised
    OverflowError after scoring every record; now its perplexity is inf and the goal missed."""
    v = 11

    def ref_fn(ids):
        return torch.randn(len(ids), v, generator=torch.Generator().manual_seed(len(ids)))

    def arm_fn(ids):
        out = torch.zeros(len(ids), v)
        out[torch.arange(len(ids) - 1), torch.tensor(ids[1:])] = -2000.0
        return out

    class Fake:
        def __init__(self, fn):
            self.fn, self.spec = fn, SimpleNamespace(num_layers=1)

        def prompt_logits(self, prompts):
            return [self.fn(p) for p in prompts]

    recs = [[(3 * i) % v for i in range(20)]]
    summary, _ = heldout.run_heldout({"reference": Fake(ref_fn), "e4m3": Fake(arm_fn)},
                                     "reference", [Shard("prose", recs, [{}])], internals=False)
    arm = summary["arms"]["e4m3"]
    assert arm["perplexity"] == math.inf and arm["ppl_delta_pct"] == math.inf
    assert arm["per_shard"]["prose"]["perplexity"] == math.inf
    goals = {g["goal"]: g for g in report.evaluate_goals({"heldout": summary}, "e4m3", None)}
    assert goals["ppl_delta_pct"]["met"] is False


def test_record_length_is_checked_only_where_records_are_scored(tmp_path: Path):
    """A 128-token model: --tasks generation was refused for the held-out record length
    (quick: 256) of a task it did not run; held-out scoring is still refused."""
    from kvscale_helpers import make_checkpoint

    base = make_checkpoint(tmp_path / "base")  # max_position_embeddings 128
    cfg = runner.CompareConfig(model=str(base), overlay=base, tasks=("generation",),
                               quick=True)
    _, spec, budget = runner._resolve(cfg)
    assert budget.record_tokens >= spec.position_limit
    for tasks in (("heldout",), ("internals",), ("heldout", "generation")):
        with pytest.raises(ConfigError, match="--record-tokens 64 or fewer"):
            runner._resolve(runner.CompareConfig(model=str(base), overlay=base, tasks=tasks,
                                                 quick=True))
