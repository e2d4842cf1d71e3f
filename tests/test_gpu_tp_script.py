"""scripts/gpu_tp.py (issue 11's multi-GPU run) on CPU, so that the GPU run does not die on a
typo: the whole script in --cpu-smoke mode (gloo, tiny dummy model, TP1 vs TP2), the entry
point's no-GPU message, the plan for 2 and 4 GPUs, and the report/summary code on a synthetic
GPU-shaped report (the paths the smoke cannot reach: CUDA graphs, TP4, symm, mismatches)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_tp.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_tp_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_tp = _load()


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def test_cpu_smoke_runs_every_phase(tmp_path):
    """~45 s on a loaded 2-core box: every phase in its own process, TP2 workers, gloo."""
    out = tmp_path / "smoke"
    run = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out)],
                         capture_output=True, text=True, timeout=170, env=_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rep = json.loads((out / "gpu_tp.json").read_text())
    assert rep["finished"] and not rep["skipped"]
    assert set(rep["phases"]) == set(rep["plan"]) == {
        "tiny-tp1", "tiny-tp2-fp16", "comm-2", "tiny-tp2-fp16-symm", "tiny-tp2-fp8"}
    for name, ph in rep["phases"].items():
        assert not ph.get("error"), (name, ph.get("error"))
        assert all(not x.get("error") for x in ph.get("instances", [])), name
    corr = {c["instance"]: c for c in rep["correctness"]}
    assert set(corr) == {"tiny-fp16-tp2", "tiny-fp8-tp2", "tiny-fp16-tp2-symm"}
    assert all(c["sequences"] == 4 for c in corr.values())
    assert corr["tiny-fp16-tp2"]["all_identical"], corr["tiny-fp16-tp2"]["rows"]
    assert all(g["passed"] and "gate passed" in g["log"][0] for g in rep["gate"])
    assert rep["scale_agreement"]["tiny-tp2"]["max_rel_diff_vs_tp1"] < 1e-6
    cells = [r for r in rep["decode_matrix"] if r["allreduce"] == "nccl"]
    assert len(cells) == 2 * 2 * 4  # kv x tp x (2 concurrencies x 2 contexts)
    assert all(r["decode_tok_s"] > 0 and r["decode_steps"] == 6 for r in cells)
    assert all("speedup_vs_tp1" in r for r in cells if r["tp"] == 2)
    ar = rep["allreduce"]
    assert {(r["mode"], r["active"]) for r in ar} == {("nccl", "gloo"), ("symm", "gloo")}
    assert all(r["exact"] and r["eager_us"] > 0 for r in ar)
    assert {c["tp"] for c in rep["capacity"]} == {1, 2}
    assert "issue 11 summary" in run.stdout and "decode tok/s" in run.stdout


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="would really run on this host")
def test_entry_point_without_gpus_says_so(tmp_path):
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_tp.sh")], capture_output=True,
                         text=True, timeout=120,
                         env=_env(PYTHON=sys.executable, OUT=str(tmp_path),
                                  CUDA_VISIBLE_DEVICES=""))
    assert run.returncode == 3, run.stdout + run.stderr
    assert "needs 2 or 4 CUDA GPUs" in run.stdout and "--cpu-smoke" in run.stdout
    log = (tmp_path / "tp.log").read_text()
    assert "needs 2 or 4 CUDA GPUs" in log and "exit 3" in log
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_tp.sh"), "--no-such-flag"],
                         capture_output=True, text=True, timeout=60,
                         env=_env(PYTHON=sys.executable, OUT=str(tmp_path)))
    assert bad.returncode == 2 and "unrecognized arguments" in bad.stdout


@pytest.mark.parametrize("gpus", [2, 4])
def test_plan_for_two_and_four_gpus(tmp_path, gpus):
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--gpus", str(gpus),
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=60,
                         env=_env())
    assert run.returncode == 0, run.stderr
    plan = run.stdout.split("plan ", 1)[1]
    names = [p.split("~")[0] for p in plan.strip().split(", ")]
    assert names[names.index("8b-tp1"):names.index("8b-tp1") + 4] == \
        ["8b-tp1", "8b-tp2-fp16", "comm-2", "8b-tp2-fp16-symm"]
    assert ("8b-tp4-fp16" in names) == ("comm-4" in names) == ("8b-tp4-fp8" in names) == \
        (gpus == 4)
    assert f"TP sizes {[1, 2, 4] if gpus == 4 else [1, 2]}" in run.stdout


def test_cells_and_estimates():
    args = gpu_tp.parse_args(["--out", "/tmp/x"])
    assert gpu_tp.cells_for(args) == [[16, 1024, False], [64, 1024, False],
                                      [16, 16384, False], [64, 16384, True]]
    assert gpu_tp.cells_for(args, symm=True) == [[16, 1024, False], [64, 1024, False]]
    assert gpu_tp.cells_for(gpu_tp.parse_args(["--no-big"]))[-1] == [16, 16384, False]
    # 64 x 16K prefills in 128 chunks of 8192: the window still has 48 decode-only steps
    assert gpu_tp.cell_out_tokens(64, 16384, 8192, 48) == 178
    est = lambda c, ctx: gpu_tp.est_cell_s(c, ctx, 32000, 0.01, 8192, 48)
    assert est(16, 1024) < est(64, 1024) < est(16, 16384) < est(64, 16384)
    assert 10 < est(16, 16384) < 25  # the H200 bench measured ~13 s of prefill there


def test_compare_seqs_reports_the_first_difference():
    ref = [{"tokens": [1, 2, 3, 4], "margins": [0.5, 0.01, 0.2, 0.3]},
           {"tokens": [5, 6], "margins": [1.0, 1.0]}]
    got = [{"tokens": [1, 2, 9, 4], "margins": [0.5, 0.02, 0.001, 0.3]},
           {"tokens": [5, 6], "margins": [1.0, 1.0]}]
    cmp = gpu_tp.compare_seqs(ref, got)
    assert cmp["identical"] == 1 and not cmp["all_identical"]
    row = cmp["rows"][0]
    assert (row["first_diff"], row["ref_token"], row["token"]) == (2, 3, 9)
    assert (row["ref_margin"], row["margin"]) == (0.2, 0.001)
    short = gpu_tp.compare_seqs([{"tokens": [1, 2], "margins": []}],
                                [{"tokens": [1], "margins": []}])
    assert short["rows"][0]["first_diff"] == 1 and short["rows"][0]["token"] is None


def _synthetic_report(tmp_path: Path) -> dict:
    """What a 4-GPU run would write, incl. a mismatch, a skip, an error, symm and TP4."""
    s1, s2 = tmp_path / "s1.json", tmp_path / "s2.json"
    s1.write_text(json.dumps({"a.k_scale": 1.0, "a.v_scale": 2.0}))
    s2.write_text(json.dumps({"a.k_scale": 1.0, "a.v_scale": 2.0000002}))
    seq = lambda toks: {"tokens": toks, "margins": [0.1] * len(toks)}

    def inst(tp, kv="fp16", ar="nccl", tok_s=(1000.0, 3000.0), check=(1, 2, 3), **kw):
        cells = [{"concurrency": 16, "context": 1024, "decode_tok_s": tok_s[0], "step_ms": 16e3
                  / tok_s[0], "ttft_s": 0.5, "prefill_tok_s": 30000.0 * tp,
                  "roofline_fraction": 0.5, "decode_steps": 48},
                 {"concurrency": 64, "context": 1024, "decode_tok_s": tok_s[1], "step_ms": 64e3
                  / tok_s[1], "ttft_s": 2.0, "prefill_tok_s": 31000.0, "decode_steps": 48},
                 {"concurrency": 64, "context": 16384, "skip": "needs 65536 KV blocks"}]
        return {"model": "8b", "tp": tp, "kv": kv, "allreduce": ar, "eager": False,
                "build_s": 20.0, "cells": cells, "check_result": {"seqs": [seq(list(check))]},
                "capacity": {"tokens": 400000 * tp, "kv_gib_per_gpu": 100.0,
                             "tokens_per_gpu": 400000.0},
                "log": ["gate passed: loaded 64/64 K/V scales from programmatic scales"]
                if kv == "fp8" else [], **kw}

    return {
        "host": {"n_gpus": 4, "gpus": ["NVIDIA H200"] * 4}, "commit": "abc", "elapsed_s": 400,
        "skipped": {"emb-tp2-fp16-eager": "time budget: estimated 23 s, 5 s left"},
        "phases": {
            "8b-tp1": {"wall_s": 90, "instances": [
                inst(1, calibration={"file": str(s1)}), inst(1, "fp8")]},
            "8b-tp2-fp16": {"wall_s": 50, "instances": [
                inst(2, tok_s=(1700.0, 5000.0), check=(1, 7, 3),
                     calibration={"file": str(s2)})]},
            "8b-tp4-fp16": {"wall_s": 50, "instances": [inst(4, tok_s=(2500.0, 8000.0))]},
            "8b-tp2-fp16-symm": {"wall_s": 40, "instances": [
                inst(2, ar="symm", tok_s=(1800.0, 5200.0), symm_active=True)]},
            "8b-tp2-fp8": {"wall_s": 50, "error": "killed after 88 s (phase time limit)",
                           "instances": [inst(2, "fp8", error="TensorParallelError: boom")]},
            "comm-2": {"world": 2, "wall_s": 15, "allreduce": [
                {"mode": m, "active": m, "batch": b, "bytes": b * 8192, "ops_per_step": 65,
                 "eager_us": 30.0, "graph_us": 12.0 if m == "nccl" else 6.0, "exact": True,
                 "graph_exact": True} for m in ("nccl", "symm") for b in (1, 16, 64)]},
            "comm-4": {"world": 4, "wall_s": 15, "allreduce": [
                {"mode": "symm", "active": "nccl", "batch": 16, "bytes": 131072,
                 "ops_per_step": 65, "eager_us": 40.0, "exact": True,
                 "graph_error": "RuntimeError: capture failed", "error": None}]},
            "emb-tp1": {"wall_s": 30, "instances": [
                {"model": "embedded", "tp": 1, "kv": "fp16", "allreduce": "nccl",
                 "eager": False, "refused": {"4": "tensor_parallel_size 4 cannot split"}}]},
        }}


def test_derive_and_summary_on_a_gpu_shaped_report(tmp_path, capsys):
    rep = _synthetic_report(tmp_path)
    gpu_tp.derive(rep)
    corr = {c["instance"]: c for c in rep["correctness"]}
    assert corr["8b-fp16-tp2"]["rows"][0]["first_diff"] == 1
    assert corr["8b-fp16-tp4"]["all_identical"] and corr["8b-fp16-tp2-symm"]["all_identical"]
    rows = {(r["allreduce"], r["tp"], r["concurrency"], r["context"]): r
            for r in rep["decode_matrix"] if r["kv"] == "fp16"}
    r = rows[("nccl", 2, 16, 1024)]
    assert r["speedup_vs_tp1"] == pytest.approx(1.7) and r["meets_1_6x"]
    assert r["efficiency"] == pytest.approx(0.85)
    assert r["allreduce_ms_per_step_in_graph"] == pytest.approx(12.0 * 65 / 1e3)
    assert rows[("symm", 2, 16, 1024)]["speedup_vs_tp1"] == pytest.approx(1.8)
    assert rows[("symm", 2, 16, 1024)]["allreduce_ms_per_step_in_graph"] == \
        pytest.approx(6.0 * 65 / 1e3)
    assert rows[("nccl", 4, 64, 1024)]["efficiency"] == pytest.approx(8000 / 3000 / 4)
    assert "meets_1_6x" not in rows[("nccl", 4, 64, 1024)]
    assert rows[("nccl", 1, 64, 16384)]["skip"]
    assert rep["scale_agreement"]["8b-tp2"]["max_rel_diff_vs_tp1"] == pytest.approx(1e-7)
    cap = {c["instance"]: c for c in rep["capacity"]}
    assert cap["8b-fp16-tp4"]["tokens_vs_tp1"] == 4
    gate = {g["instance"]: g for g in rep["gate"]}
    assert gate["8b-fp8-tp1"]["passed"] and "gate passed" in gate["8b-fp8-tp1"]["log"][0]
    assert gate["8b-fp8-tp2"]["error"].startswith("TensorParallelError")
    gpu_tp.print_summary(rep)
    text = capsys.readouterr().out
    for needle in ("first diff at token 1", "1.70x*", "skip: needs 65536", "killed after 88 s",
                   "refused: tensor_parallel_size 4", "emb-tp2-fp16-eager", "skipped",
                   "world 4 symm (active nccl)", "0.78 ms/step", "gate 8b-fp8-tp1",
                   "graph ERROR RuntimeError: capture failed"):
        assert needle in text, needle


def test_calibration_corpus_for_the_embedded_model(default_model_dir):
    from types import SimpleNamespace

    from kvcap.models import loader

    tok = loader.load_tokenizer(default_model_dir)
    llm = SimpleNamespace(tokenizer=tok, spec=SimpleNamespace(vocab_size=len(tok)))
    shards = gpu_tp.calibration_shards(llm, {"model": "embedded", "device": "cuda"})
    total = sum(s.num_tokens for s in shards)
    assert shards[0].name != "random" and 2048 < total <= 4096
    assert all(len(r) <= 512 for s in shards for r in s.records)
    dummy = gpu_tp.calibration_shards(llm, {"model": "8b", "device": "cuda"})
    assert [s.name for s in dummy] == ["random"] and dummy[0].num_tokens == 4 * 512
    assert all(tok.encode(p) for p in gpu_tp.TEXT_PROMPTS)
