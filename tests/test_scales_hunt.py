"""Contract hunt in kvcap/scales: bindings that must cover every file the loader reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvscale_helpers import make_checkpoint, make_report
from safetensors.torch import save_file

from kvcap.errors import OverlayError
from kvcap.models.loader import safetensors_files
from kvcap.scales import materialize as mat
from kvcap.scales.overlay import load_overlay_scales, write_overlay


def _extra_weights(base: Path, value: float) -> Path:
    """A second weight file beside model.safetensors, with no index (the loader globs it)."""
    path = base / "extra.safetensors"
    save_file({"model.layers.0.mlp.down_proj.weight": torch.full((16, 32), value)}, str(path),
              metadata={"format": "pt"})
    return path


def test_unindexed_base_with_a_second_weight_file_is_not_half_bound(tmp_path: Path) -> None:
    """A base without an index is loaded from every *.safetensors, but the single-file binding
    hashed model.safetensors alone: a pack stayed valid after the other weight file changed
    (LLM(model=BASE, kv_scales=PACK) loaded it with the old scales)."""
    base = make_checkpoint(tmp_path / "base")
    pack = write_overlay(base, tmp_path / "pack", make_report(base))  # bound while it was clean
    _extra_weights(base, 1.0)
    assert base / "extra.safetensors" in safetensors_files(base)  # what the loader reads
    with pytest.raises(OverlayError, match="extra.safetensors"):
        load_overlay_scales(base, pack)
    with pytest.raises(OverlayError, match="extra.safetensors"):
        write_overlay(base, tmp_path / "pack2", None, negative_control=True)
    with pytest.raises(OverlayError, match="extra.safetensors"):
        mat.materialize(base, pack, tmp_path / "derived")
    assert not (tmp_path / "pack2").exists() and not (tmp_path / "derived").exists()
    # the documented layouts are unchanged: one model.safetensors, or an index naming shards
    (base / "extra.safetensors").unlink()
    assert load_overlay_scales(base, pack)
    sharded = make_checkpoint(tmp_path / "sharded", sharded=True)
    assert load_overlay_scales(sharded, write_overlay(sharded, tmp_path / "p3",
                                                      make_report(sharded)))
