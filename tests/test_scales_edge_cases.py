"""Edge cases of the scale toolchain that users hit: file corpora and empty shards in
`kvcap calibrate`, derived checkpoints built from an HF hub snapshot, the negative-control
warning of an in-memory `kvcap verify`, and malformed report records."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from kvscale_helpers import hash_tree, make_checkpoint, make_report
from test_calibrate_cli import build_tiny, cli

from kvcap.errors import OverlayError
from kvcap.scales.materialize import derived_base_dir, materialize, verify_derived
from kvcap.scales.overlay import write_overlay

TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm sun. " * 30


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return build_tiny(tmp_path_factory.mktemp("edge") / "base", default_model_dir)


def test_calibrate_accepts_a_text_file_corpus(tiny_base: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    # calibrate resolved the names to `file:<path>` and build_shards refused them as unknown
    text = tmp_path / "notes.txt"
    text.write_text(TEXT)
    rc, _, err = cli(capsys, "calibrate", "--model", str(tiny_base), "--out",
                     str(tmp_path / "c"), "--corpus", "prose", str(text), "--max-tokens", "300",
                     "--record-tokens", "64", "--threads", "1")
    assert rc == 0, err
    report = json.loads((tmp_path / "c" / "calibration-report.json").read_text())
    assert report["shard_names"] == ["prose", f"file:{text.resolve()}"]
    assert all(n > 0 for n in report["shard_tokens"].values())


def test_calibrate_names_an_empty_shard_before_any_forward(
        tiny_base: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An empty shard surfaced only after all forwards, as "observer not wired to every forward?"
    import kvcap.commands.calibrate as calibrate

    def no_forwards(*a: object) -> float:
        raise AssertionError("forwards ran before the empty shard was refused")

    monkeypatch.setattr(calibrate, "observe_shards", no_forwards)
    short = tmp_path / "short.txt"
    short.write_text("hi there")
    rc, _, err = cli(capsys, "calibrate", "--model", str(tiny_base), "--out",
                     str(tmp_path / "c"), "--corpus", "prose", str(short), "--max-tokens", "300",
                     "--record-tokens", "64", "--threads", "1")
    assert rc == 2
    assert str(short.resolve()) in err and "no records" in err and "--max-tokens" in err
    assert "observer not wired" not in err
    assert not (tmp_path / "c").exists()


def _hub_snapshot(root: Path) -> Path:
    """An HF hub cache layout: snapshots/<rev>/<file> -> ../../blobs/<hash>."""
    plain = make_checkpoint(root / "plain")
    blobs, snap = root / "hub" / "blobs", root / "hub" / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(plain.iterdir()):
        shutil.copy(f, blobs / f"blob-{f.name}")
        os.symlink(f"../../blobs/blob-{f.name}", snap / f.name)
    return snap


def test_verify_derived_from_an_hf_hub_snapshot(tmp_path: Path) -> None:
    # derived_base_dir resolved config.json through the snapshot's own link into blobs/
    snap = _hub_snapshot(tmp_path)
    write_overlay(snap, tmp_path / "pack", make_report(snap))
    derived = materialize(snap, tmp_path / "pack", tmp_path / "derived")
    assert derived_base_dir(derived) == snap.resolve()
    assert verify_derived(derived)["tensor_count"] == 6


def test_verify_derived_still_refuses_a_changed_snapshot(tmp_path: Path) -> None:
    snap = _hub_snapshot(tmp_path)
    write_overlay(snap, tmp_path / "pack", make_report(snap))
    derived = materialize(snap, tmp_path / "pack", tmp_path / "derived")
    target = (snap / "model.safetensors").resolve()
    make_checkpoint(tmp_path / "other", seed=1)
    shutil.copy(tmp_path / "other" / "model.safetensors", target)  # a new revision's blob
    with pytest.raises(OverlayError, match="wrong checkpoint revision"):
        verify_derived(derived)


def test_verify_in_memory_negative_control_warns(tiny_base: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    # only a derived directory's verify printed the warning; a pack bound in memory did not
    assert cli(capsys, "overlay", "--model", str(tiny_base), "--unit-scale-negative-control",
               "--out", str(tmp_path / "nc"))[0] == 0
    rc, out, err = cli(capsys, "verify", "--model", str(tiny_base), "--kv-scales",
                       str(tmp_path / "nc"))
    assert rc == 0, err
    assert "gate passed" in out and "NEGATIVE CONTROL" in out


def test_report_tensor_name_must_be_a_string(tmp_path: Path) -> None:
    # a list name was a bare TypeError (unhashable type) from inside write_overlay
    base = make_checkpoint(tmp_path / "base")
    report = make_report(base)
    report["tensors"][0]["name"] = ["model.layers.0.self_attn.k_scale"]
    with pytest.raises(OverlayError, match="record 0: name .* is not a string"):
        write_overlay(base, tmp_path / "pack", report)
    assert not (tmp_path / "pack").exists()


@pytest.mark.parametrize("inside", ["kvscales", "sub/kvscales"])
def test_overlay_refuses_a_pack_inside_the_base(tmp_path: Path, inside: str) -> None:
    # materialize refused an output inside the base, but overlay wrote its pack there
    base = make_checkpoint(tmp_path / "base")
    before = hash_tree(base)
    with pytest.raises(OverlayError, match="inside the base checkpoint"):
        write_overlay(base, base / inside, make_report(base))
    with pytest.raises(OverlayError, match="inside the base checkpoint"):
        write_overlay(tmp_path / "base" / ".." / "base", base / inside, None,
                      negative_control=True)
    assert hash_tree(base) == before and sorted(p.name for p in base.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
