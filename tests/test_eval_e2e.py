"""End to end on the embedded model with a tiny budget: calibrate -> overlay -> compare."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from kvcap.commands import calibrate, overlay
from kvcap.eval import runner


def _args(module, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])


# On CUDA the arms run the GPU engine (triton backend, CUDA graphs, piecewise prefill graphs),
# which the CPU run never reaches: the internals task once crashed there after every arm loaded.
@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_compare_end_to_end(default_model_dir, tmp_path: Path, device: str):
    cal, pack, out = tmp_path / "cal", tmp_path / "pack", tmp_path / "cmp"
    calibrate.run(_args(calibrate, ["--out", str(cal), "--max-tokens", "640",
                                    "--record-tokens", "64", "--device", device]))
    overlay.run(_args(overlay, ["--model", "default", "--report", str(cal), "--out", str(pack)]))
    cfg = runner.CompareConfig(
        overlay=pack, out=out, device=device, tasks=runner.TASKS, quick=True,
        overrides={"heldout_tokens": 96, "record_tokens": 48, "plain_prompts": 1,
                   "chat_prompts": 1, "max_new_tokens": 4, "contexts": (256,),
                   "depths": (0, 100), "retrieval_tasks": ("passkey",)})
    report, paths = runner.run_compare(cfg)
    data = json.loads(paths["json"].read_text())
    assert [a["name"] for a in data["arms"]] == ["reference", "e4m3", "e4m3_unit"]
    assert data["arms"][2]["overlay"]["negative_control"] is True
    dis = data["data"]["disjointness"]
    assert dis["verified"] is True and dis["calibration_manifest"]["path"].endswith(
        calibrate.CORPUS_NAME)
    ho = data["results"]["heldout"]["arms"]
    assert 0.0 <= ho["e4m3"]["top1_agreement"] <= 1.0 and ho["e4m3"]["kl_mean"] >= 0.0
    assert len(ho["e4m3"]["internals"]["per_layer"]) == 30
    iso = ho["e4m3"]["internals_isolated"]["per_layer"]
    # Layer 0 sees identical inputs in both views.
    assert iso[0]["cosine"] == pytest.approx(ho["e4m3"]["internals"]["per_layer"][0]["cosine"])
    assert data["results"]["generation"]["arms"]["e4m3"]["n"] == 2
    assert len(data["results"]["retrieval"]["cases"]) == 2
    for name in data["plots"]:
        assert (out / name).is_file()
    assert "## Goals" in paths["md"].read_text()
