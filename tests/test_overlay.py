"""Overlay packs: writing, loading with safetensors alone, binding checks and every refusal."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from kvscale_helpers import make_checkpoint, make_report, rewrite_json
from safetensors.torch import load_file, save_file

from kvcap.config import ModelSpec
from kvcap.errors import OverlayError
from kvcap.scales.binding import MANIFEST_NAME, SCALE_FILE, BaseCheckpoint
from kvcap.scales.fsutil import sha256_file
from kvcap.scales.gate import run_gate
from kvcap.scales.overlay import (
    VLLM_CONFIG_NAME,
    load_overlay_scales,
    write_overlay,
)

VLLM_NAME = re.compile(r"^model\.layers\.\d+\.self_attn\.[kv]_scale$")


@pytest.fixture(params=[False, True], ids=["single", "sharded"])
def base(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    return make_checkpoint(tmp_path / "base", sharded=request.param)


@pytest.fixture
def pack(base: Path, tmp_path: Path) -> Path:
    return write_overlay(base, tmp_path / "pack", make_report(base))


def spec_of(base: Path) -> ModelSpec:
    return ModelSpec.from_hf_config(json.loads((base / "config.json").read_text()))


def test_pack_loads_with_safetensors_alone(pack: Path, base: Path) -> None:
    from safetensors.numpy import load_file as np_load

    arrays = np_load(str(pack / SCALE_FILE))
    assert sorted(arrays) == sorted(spec_of(base).scale_names())
    assert all(VLLM_NAME.match(n) for n in arrays)
    for a in arrays.values():
        assert a.dtype.name == "float32" and a.shape == ()
    expected = make_report(base)["tensors"]
    assert [float(arrays[t["name"]]) for t in expected] == [t["scale"] for t in expected]


def test_manifest_contents(pack: Path, base: Path) -> None:
    m = json.loads((pack / MANIFEST_NAME).read_text())
    assert m["schema_version"] == 1
    assert m["scale_contract"] == "e4m3fn(x/scale), max_abs/448"
    assert m["negative_control"] is False
    assert m["scale_file"]["sha256"] == sha256_file(pack / SCALE_FILE)
    assert m["tensor_count"] == 6 and m["tensor_names"] == spec_of(base).scale_names()
    fp = BaseCheckpoint.inspect(base).fingerprint
    assert m["base"]["fingerprint"] == fp
    index = base / "model.safetensors.index.json"
    assert fp["sha256"] == sha256_file(index if index.exists() else base / "model.safetensors")
    rec = m["tensors"]["model.layers.1.self_attn.v_scale"]
    assert rec == {"layer": 1, "kind": "V", "max_abs": 0.0625 * 448.0, "scale": 0.0625}


def test_load_overlay_scales_feeds_the_gate(pack: Path, base: Path) -> None:
    found = load_overlay_scales(base, pack)
    k, v = run_gate(spec_of(base), found, "t")
    assert k == [0.015625, 0.046875, 0.078125] and v == [0.03125, 0.0625, 0.09375]


def test_negative_control(base: Path, tmp_path: Path) -> None:
    pack = write_overlay(base, tmp_path / "nc", None, negative_control=True)
    m = json.loads((pack / MANIFEST_NAME).read_text())
    assert m["negative_control"] is True
    k, v = run_gate(spec_of(base), load_overlay_scales(base, pack), "t")
    assert k == v == [1.0, 1.0, 1.0]


def test_negative_control_relabelled_in_the_manifest_refused(base: Path, tmp_path: Path) -> None:
    pack = write_overlay(base, tmp_path / "nc", None, negative_control=True)
    manifest = pack / MANIFEST_NAME
    manifest.write_text(manifest.read_text().replace('"negative_control": true',
                                                     '"negative_control": false'))
    with pytest.raises(OverlayError, match="manifest says negative_control false but"):
        load_overlay_scales(base, pack)


def test_overlay_needs_a_report(base: Path, tmp_path: Path) -> None:
    with pytest.raises(OverlayError, match="needs a calibration report"):
        write_overlay(base, tmp_path / "p", None)


def test_vllm_config_parses_with_compressed_tensors(base: Path, tmp_path: Path) -> None:
    ct = pytest.importorskip("compressed_tensors.quantization",
                             reason="compressed-tensors is not installed (pip install "
                                    "--no-deps compressed-tensors loguru)")
    pack = write_overlay(base, tmp_path / "p", make_report(base), vllm_config=True)
    block = json.loads((pack / VLLM_CONFIG_NAME).read_text())["quantization_config"]
    cfg = ct.QuantizationConfig.model_validate(block)
    kv = cfg.kv_cache_scheme
    assert isinstance(kv, ct.QuantizationArgs)
    assert (kv.num_bits, kv.type, kv.strategy, kv.dynamic, kv.symmetric) == (
        8, ct.QuantizationType.FLOAT, ct.QuantizationStrategy.TENSOR, False, True)
    assert cfg.quant_method == "compressed-tensors"


def test_no_vllm_config_unless_asked(pack: Path) -> None:
    assert not (pack / VLLM_CONFIG_NAME).exists()


def test_output_exists_refused(base: Path, pack: Path) -> None:
    before = sha256_file(pack / SCALE_FILE)
    with pytest.raises(OverlayError, match="already exists"):
        write_overlay(base, pack, make_report(base))
    assert sha256_file(pack / SCALE_FILE) == before


def test_report_from_other_weights_refused(base: Path, tmp_path: Path) -> None:
    other = make_checkpoint(tmp_path / "other", seed=7)
    with pytest.raises(OverlayError, match="wrong checkpoint revision|changed since"):
        write_overlay(base, tmp_path / "p", make_report(other))
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), 0.1])  # 0.1 is not an FP32 value
def test_report_with_bad_scale_refused(base: Path, tmp_path: Path, bad: float) -> None:
    scales = [0.5] * 6
    scales[3] = bad
    with pytest.raises(OverlayError, match="not a positive FP32 value"):
        write_overlay(base, tmp_path / "p", make_report(base, scales))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -7.0, 0.0])
def test_report_with_bad_max_abs_refused(base: Path, tmp_path: Path, bad: float) -> None:
    """max_abs goes into the manifest: NaN / inf were written there as bare NaN / Infinity
    (not JSON to strict readers), a negative one passed as is."""
    report = make_report(base)
    report["tensors"][2]["max_abs"] = bad
    with pytest.raises(OverlayError, match="max_abs .* not a finite number > 0"):
        write_overlay(base, tmp_path / "p", report)
    assert not (tmp_path / "p").exists()


def test_report_scale_that_saturates_under_the_max_policy_refused(base: Path,
                                                                   tmp_path: Path) -> None:
    """A report claiming the max policy with 448 * scale < max_abs would saturate on its own
    calibration set: refused. A percentile report may clip (explicit opt-in)."""
    report = make_report(base)
    report["tensors"][1]["max_abs"] = report["tensors"][1]["scale"] * 448.0 * 1.5
    with pytest.raises(OverlayError, match="under the max policy"):
        write_overlay(base, tmp_path / "p", report)
    report["policy"] = {"name": "percentile", "percentile": 99.9}
    write_overlay(base, tmp_path / "p", report)


def test_duplicate_json_keys_refused(base: Path, pack: Path, tmp_path: Path) -> None:
    """json.loads keeps the last of two equal keys in silence (other readers the first): a
    manifest or report that says both true and false is refused, not read one way."""
    from kvcap.commands.overlay import read_report

    manifest = pack / MANIFEST_NAME
    text = manifest.read_text()
    assert '"negative_control": false' in text
    manifest.write_text(text.replace('"negative_control": false',
                                     '"negative_control": true, "negative_control": false'))
    with pytest.raises(OverlayError, match="repeats the key 'negative_control'"):
        load_overlay_scales(base, pack)
    report = tmp_path / "report.json"
    text = json.dumps(make_report(base))
    report.write_text(text.replace('"scale": 0.015625,', '"scale": 0.5, "scale": 0.015625,', 1))
    with pytest.raises(OverlayError, match="repeats the key 'scale'"):
        read_report(report)


def test_base_with_scale_keys_refused(tmp_path: Path) -> None:
    base = make_checkpoint(tmp_path / "b", extra={
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5)})
    with pytest.raises(OverlayError, match="already has K/V scale tensors"):
        write_overlay(base, tmp_path / "p", None, negative_control=True)


# --- binding refusals of load_overlay_scales (materialize shares them) -----------------------


def test_wrong_revision_refused(base: Path, pack: Path) -> None:
    fp_file = base / ("model.safetensors.index.json"
                      if (base / "model.safetensors.index.json").exists() else
                      "model.safetensors")
    if fp_file.name.endswith(".json"):
        rewrite_json(fp_file, lambda d: d["metadata"].update(total_size=1))
    else:
        save_file({"model.embed_tokens.weight": torch.zeros(2)}, str(fp_file))
    with pytest.raises(OverlayError, match="wrong checkpoint revision"):
        load_overlay_scales(base, pack)


def test_weights_changed_after_calibration_refused(base: Path, pack: Path) -> None:
    """Same names and shapes (the index is byte-identical), different weights."""
    shard = sorted(base.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(OverlayError, match="changed since calibration|wrong checkpoint rev"):
        load_overlay_scales(base, pack)


def test_config_changed_refused(base: Path, pack: Path) -> None:
    rewrite_json(base / "config.json", lambda d: d.update(rms_norm_eps=1e-5))
    with pytest.raises(OverlayError, match="config.json changed since calibration"):
        load_overlay_scales(base, pack)


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _resign(pack: Path) -> None:
    """Make the manifest's scale-file checksum match again (a consistent forgery)."""
    digest = sha256_file(pack / SCALE_FILE)
    rewrite_json(pack / MANIFEST_NAME, lambda d: d["scale_file"].update(sha256=digest))


def test_truncated_scale_file(base: Path, pack: Path) -> None:
    f = pack / SCALE_FILE
    f.write_bytes(f.read_bytes()[:-5])
    with pytest.raises(OverlayError, match="checksum mismatch"):
        load_overlay_scales(base, pack)
    _resign(pack)
    with pytest.raises(OverlayError, match="cannot read"):
        load_overlay_scales(base, pack)


def test_corrupted_scale_value(base: Path, pack: Path) -> None:
    f = pack / SCALE_FILE
    _flip_byte(f, f.stat().st_size - 2)  # inside the last tensor's data
    with pytest.raises(OverlayError, match="checksum mismatch"):
        load_overlay_scales(base, pack)
    _resign(pack)
    with pytest.raises(OverlayError, match="but the manifest records"):
        load_overlay_scales(base, pack)


def test_corrupted_header(base: Path, pack: Path) -> None:
    _flip_byte(pack / SCALE_FILE, 10)
    _resign(pack)
    with pytest.raises(OverlayError, match="cannot read"):
        load_overlay_scales(base, pack)


@pytest.mark.parametrize("tensors,match", [
    ("fp16", "expected an FP32 scalar"),
    ("vector", "expected an FP32 scalar"),
    ("extra", "tensor set does not match"),
    ("missing", "tensor set does not match"),
])
def test_replaced_scale_file(base: Path, pack: Path, tensors: str, match: str) -> None:
    names = spec_of(base).scale_names()
    values = load_file(str(pack / SCALE_FILE))  # the genuine values
    if tensors == "fp16":
        values[names[2]] = values[names[2]].half()
    elif tensors == "vector":
        values[names[2]] = values[names[2]].reshape(1)
    elif tensors == "extra":
        values["model.layers.9.self_attn.k_scale"] = torch.tensor(0.5)
    else:
        del values[names[-1]]
    save_file(values, str(pack / SCALE_FILE))
    _resign(pack)
    with pytest.raises(OverlayError, match=match):
        load_overlay_scales(base, pack)


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["tensors"]["model.layers.0.self_attn.k_scale"].update(scale=0.5),
     "but the manifest records"),
    (lambda d: d["tensor_names"].pop(), "tensor set does not match"),
    (lambda d: d.update(tensor_count=5), "tensor set does not match"),
    (lambda d: d["base"]["fingerprint"].update(sha256="0" * 64), "wrong checkpoint revision"),
    (lambda d: d["scale_file"].update(sha256="f" * 64), "checksum mismatch"),
    (lambda d: d.update(schema_version=2), "schema version 2"),
    (lambda d: d.update(scale_contract="x/scale"), "scale contract"),
    (lambda d: d.update(negative_control=True), "negative control"),
    (lambda d: d.pop("base"), "lacks field"),
    (lambda d: d.update(kind="other"), "not a kvcap scale manifest"),
    (lambda d: d["scale_file"].update(name="../base/model.safetensors"), "manifest names scale"),
])
def test_manifest_edited(base: Path, pack: Path, edit, match: str) -> None:
    rewrite_json(pack / MANIFEST_NAME, edit)
    with pytest.raises(OverlayError, match=match):
        load_overlay_scales(base, pack)


def test_manifest_not_json(base: Path, pack: Path) -> None:
    (pack / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(OverlayError, match="cannot read"):
        load_overlay_scales(base, pack)


def test_pack_for_other_layer_count_refused(tmp_path: Path) -> None:
    base2 = make_checkpoint(tmp_path / "b2", num_layers=2)
    base3 = make_checkpoint(tmp_path / "b3", num_layers=3)
    pack = write_overlay(base3, tmp_path / "p", make_report(base3))
    with pytest.raises(OverlayError, match="wrong checkpoint revision"):
        load_overlay_scales(base2, pack)


def test_scale_keys_added_to_base_later_refused(base: Path, pack: Path) -> None:
    idx = base / "model.safetensors.index.json"
    if idx.exists():
        rewrite_json(idx, lambda d: d["weight_map"].update(
            {"model.layers.0.self_attn.k_scale": "model-00001-of-00002.safetensors"}))
    else:
        f = base / "model.safetensors"
        tensors = load_file(str(f))
        tensors["model.layers.0.self_attn.k_proj.output_scale"] = torch.tensor(0.5)
        save_file(tensors, str(f))
    with pytest.raises(OverlayError, match="already has K/V scale tensors"):
        load_overlay_scales(base, pack)
