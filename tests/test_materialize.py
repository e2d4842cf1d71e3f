"""materialize: derived checkpoint layout, every refusal, crash safety, base never modified."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kvscale_helpers import hash_tree, make_checkpoint, make_report, rewrite_json
from safetensors import safe_open

from kvcap.config import ModelSpec
from kvcap.errors import OverlayError
from kvcap.scales import materialize as mat
from kvcap.scales.binding import INDEX_NAME, MANIFEST_NAME, SCALE_FILE
from kvcap.scales.gate import is_kv_scale_name, run_gate
from kvcap.scales.overlay import write_overlay


@pytest.fixture(params=[False, True], ids=["single", "sharded"])
def base(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    return make_checkpoint(tmp_path / "base", sharded=request.param)


@pytest.fixture
def pack(base: Path, tmp_path: Path) -> Path:
    return write_overlay(base, tmp_path / "pack", make_report(base))


def leftovers(parent: Path) -> list[str]:
    if not parent.exists():
        return []
    return sorted(p.name for p in parent.iterdir() if "staging" in p.name)


def read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF dir through its index, with the safetensors library only."""
    weight_map = json.loads((model_dir / INDEX_NAME).read_text())["weight_map"]
    out = {}
    for fname in sorted(set(weight_map.values())):
        with safe_open(str(model_dir / fname), framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    assert set(out) == set(weight_map)
    return out


def test_derived_layout_and_gate(base: Path, pack: Path, tmp_path: Path) -> None:
    before = hash_tree(base)
    out = mat.materialize(base, pack, tmp_path / "derived")
    assert hash_tree(base) == before
    assert leftovers(tmp_path) == []
    for entry in base.iterdir():
        if entry.name == INDEX_NAME:
            continue
        link = out / entry.name
        assert link.is_symlink() and link.resolve() == entry.resolve()
    assert (out / SCALE_FILE).is_file() and not (out / SCALE_FILE).is_symlink()
    assert (out / MANIFEST_NAME).is_file()
    index = json.loads((out / INDEX_NAME).read_text())
    spec = ModelSpec.from_hf_config(json.loads((base / "config.json").read_text()))
    names = spec.scale_names()
    assert all(index["weight_map"][n] == SCALE_FILE for n in names)
    tensors = read_all(out)
    base_bytes = sum(t.numel() * t.element_size() for n, t in tensors.items() if n not in names)
    assert index["metadata"]["total_size"] == base_bytes + 4 * len(names)
    found = {n: t for n, t in tensors.items() if is_kv_scale_name(n)}
    assert sorted(found) == sorted(names)
    k, v = run_gate(spec, found, "derived")
    assert k == [0.015625, 0.046875, 0.078125] and v == [0.03125, 0.0625, 0.09375]
    assert mat.verify_derived(out)["tensor_count"] == 6


def test_sharded_index_keeps_base_entries(tmp_path: Path) -> None:
    base = make_checkpoint(tmp_path / "b", sharded=True)
    pack = write_overlay(base, tmp_path / "p", make_report(base))
    out = mat.materialize(base, pack, tmp_path / "d")
    old = json.loads((base / INDEX_NAME).read_text())
    new = json.loads((out / INDEX_NAME).read_text())
    assert {k: v for k, v in new["weight_map"].items() if v != SCALE_FILE} == old["weight_map"]
    assert new["metadata"]["total_size"] == old["metadata"]["total_size"] + 24


def refused(base: Path, pack: Path, out: Path, match: str) -> None:
    before = hash_tree(base)
    existed = out.exists()
    with pytest.raises(OverlayError, match=match):
        mat.materialize(base, pack, out)
    assert hash_tree(base) == before
    assert out.exists() == existed
    assert leftovers(out.parent) == []


def test_output_exists(base: Path, pack: Path, tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    refused(base, pack, tmp_path / "d", "already exists")


def test_output_inside_base(base: Path, pack: Path) -> None:
    refused(base, pack, base / "derived", "lies inside the base")
    refused(base, pack, base / "sub" / "derived", "lies inside the base")
    assert not (base / "sub").exists()


def test_output_is_base_through_symlink(base: Path, pack: Path, tmp_path: Path) -> None:
    alias = tmp_path / "alias"
    alias.symlink_to(base)
    refused(base, pack, alias / "derived", "lies inside the base")


def test_wrong_revision(base: Path, tmp_path: Path) -> None:
    other = make_checkpoint(tmp_path / "other", num_layers=3, sharded=True, seed=3)
    pack = write_overlay(other, tmp_path / "p", make_report(other))
    refused(base, pack, tmp_path / "d", "wrong checkpoint revision|changed since calibration")


def test_base_weights_changed_after_calibration(base: Path, pack: Path, tmp_path: Path) -> None:
    shard = sorted(base.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    refused(base, pack, tmp_path / "d", "changed since calibration|wrong checkpoint revision")


def test_checksum_mismatch(base: Path, pack: Path, tmp_path: Path) -> None:
    f = pack / SCALE_FILE
    f.write_bytes(f.read_bytes()[:-4])
    refused(base, pack, tmp_path / "d", "checksum mismatch")


def test_tensor_set_mismatch(base: Path, pack: Path, tmp_path: Path) -> None:
    rewrite_json(pack / MANIFEST_NAME, lambda d: d["tensor_names"].reverse())
    refused(base, pack, tmp_path / "d", "tensor set does not match")


def test_scale_keys_in_base(tmp_path: Path) -> None:
    clean = make_checkpoint(tmp_path / "clean")
    pack = write_overlay(clean, tmp_path / "p", make_report(clean))
    dirty = make_checkpoint(tmp_path / "dirty", extra={
        "model.layers.2.self_attn.v_scale": torch.tensor(1.0)})
    refused(dirty, pack, tmp_path / "d", "already has K/V scale tensors")


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_crash_mid_build_leaves_nothing(base: Path, pack: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch,
                                        exc: BaseException) -> None:
    def boom(stage: Path, index: dict) -> None:
        assert (stage / SCALE_FILE).exists()  # really mid-build
        raise exc

    monkeypatch.setattr(mat, "_write_index", boom)
    before = hash_tree(base)
    with pytest.raises(type(exc)):
        mat.materialize(base, pack, tmp_path / "d")
    assert not (tmp_path / "d").exists()
    assert leftovers(tmp_path) == []
    assert hash_tree(base) == before


def test_killed_process_leaves_no_output_and_is_cleaned(base: Path, pack: Path,
                                                         tmp_path: Path) -> None:
    """SIGKILL mid-build: no derived dir appears; the next run removes the dead staging dir."""
    script = textwrap.dedent(f"""
        import os, signal
        from kvcap.scales import materialize as mat
        def die(stage, index):
            os.kill(os.getpid(), signal.SIGKILL)
        mat._write_index = die
        mat.materialize({str(base)!r}, {str(pack)!r}, {str(tmp_path / "d")!r})
    """)
    before = hash_tree(base)
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ}, timeout=120)
    assert proc.returncode == -9
    assert not (tmp_path / "d").exists()
    assert len(leftovers(tmp_path)) == 1  # hidden, never mistaken for the output
    mat.materialize(base, pack, tmp_path / "d")
    assert leftovers(tmp_path) == []
    assert hash_tree(base) == before
    mat.verify_derived(tmp_path / "d")


def test_verify_derived_detects_tampering(base: Path, pack: Path, tmp_path: Path) -> None:
    out = mat.materialize(base, pack, tmp_path / "d")
    rewrite_json(out / INDEX_NAME, lambda d: d["weight_map"].pop(
        "model.layers.0.self_attn.k_scale"))
    with pytest.raises(OverlayError, match="not the base index merged"):
        mat.verify_derived(out)


def test_verify_derived_index_not_utf8(base: Path, pack: Path, tmp_path: Path) -> None:
    """A corrupted merged index (bytes that are not UTF-8) is refused by name; it was a
    UnicodeDecodeError traceback out of `kvcap verify`."""
    out = mat.materialize(base, pack, tmp_path / "d")
    (out / INDEX_NAME).write_bytes(b"\xff\xfe not an index")
    with pytest.raises(OverlayError, match=f"cannot read .*{INDEX_NAME}"):
        mat.verify_derived(out)


def test_verify_derived_detects_base_change(base: Path, pack: Path, tmp_path: Path) -> None:
    out = mat.materialize(base, pack, tmp_path / "d")
    rewrite_json(base / "config.json", lambda d: d.update(rope_theta=5.0))
    with pytest.raises(OverlayError, match="config.json changed since calibration"):
        mat.verify_derived(out)


def test_verify_derived_rejects_plain_dir(base: Path) -> None:
    with pytest.raises(OverlayError, match="not a materialized checkpoint"):
        mat.verify_derived(base)


def test_describe_scale_source(base: Path, pack: Path, tmp_path: Path) -> None:
    from kvcap.scales.overlay import describe_scale_source

    out = mat.materialize(base, pack, tmp_path / "d")
    manifest = json.loads((pack / MANIFEST_NAME).read_text())
    text = describe_scale_source(out)
    assert manifest["scale_file"]["sha256"][:16] in text
    assert manifest["base"]["fingerprint"]["sha256"][:16] in text
    assert describe_scale_source(base) == f"checkpoint {base}"
