"""Contract hunt in kvcap/scales: bindings that must cover every file the loader reads."""

from __future__ import annotations

from pathlib import Path

import torch
from kvscale_helpers import make_checkpoint, make_report
from safetensors.torch import save_file

from kvcap.models.loader import safetensors_files
from kvcap.scales import materialize as mat
from kvcap.scales.overlay import load_overlay_scales, write_overlay


def _extra_weights(base: Path, value: float) -> Path:
    """A second weight file beside model.safetensors, with no index (the loader globs it)."""
    path = base / "extra.safetensors"
    save_file({"model.layers.0.mlp.down_proj.weight": torch.full((16, 32), value)}, str(path),
              metadata={"format": "pt"})
    return path


def test_unindexed_base_binds_the_one_file_the_loader_reads(tmp_path: Path) -> None:
    """A base without an index: the loader reads model.safetensors alone, as transformers does
    (a second weight file beside it, a PEFT adapter say, is ignored), and the single-file
    binding hashes that same file -- an extra file neither breaks nor half-binds a pack.
    (Until 2026-12-07 the loader read every *.safetensors and the binding refused the
    layout.)"""
    base = make_checkpoint(tmp_path / "base")
    pack = write_overlay(base, tmp_path / "pack", make_report(base))
    _extra_weights(base, 1.0)
    assert safetensors_files(base) == [base / "model.safetensors"]  # what the loader reads
    assert load_overlay_scales(base, pack)
    assert mat.materialize(base, pack, tmp_path / "derived")
    assert write_overlay(base, tmp_path / "pack2", None, negative_control=True)
    sharded = make_checkpoint(tmp_path / "sharded", sharded=True)
    assert load_overlay_scales(sharded, write_overlay(sharded, tmp_path / "p3",
                                                      make_report(sharded)))
