"""Second hunt in the scale toolchain: a base config the spec cannot read, a stale index the
loader reads past, int8 codes through the packed decoder, calibrate's refusals before the model
load, and the gate's log line on a hand-edited manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kvscale_helpers import make_checkpoint, make_report, tiny_config
from test_calibrate_cli import build_tiny, cli

from kvcap.errors import OverlayError
from kvcap.models.loader import safetensors_files
from kvcap.numerics import e4m3
from kvcap.scales.binding import INDEX_NAME, MANIFEST_NAME, SCALE_FILE, BaseCheckpoint
from kvcap.scales.materialize import materialize, verify_derived
from kvcap.scales.overlay import describe_scale_source, load_overlay_scales, write_overlay

# ---------------------------------------------------------------------------------------------
# binding: a config.json whose fields the spec cannot read


@pytest.mark.parametrize("cfg", [
    [],  # a JSON list: was AttributeError ('list' object has no attribute 'get')
    {**tiny_config(), "num_attention_heads": None},  # was TypeError from int(None)
    {**tiny_config(), "num_attention_heads": 0},  # was ZeroDivisionError
    {**tiny_config(), "num_hidden_layers": "x"},  # was ValueError from int("x")
])
def test_overlay_refuses_an_unreadable_base_config_by_name(tmp_path: Path, cfg) -> None:
    """models.loader.read_spec refuses these in one line; the binding (kvcap overlay,
    materialize, LLM(kv_scales=...)) let them escape as tracebacks from inside the spec."""
    base = make_checkpoint(tmp_path / "base")
    (base / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(OverlayError, match="config.json"):
        write_overlay(base, tmp_path / "pack", None, negative_control=True)
    assert not (tmp_path / "pack").exists()


def test_index_with_non_string_files_is_refused_by_name(tmp_path: Path) -> None:
    base = make_checkpoint(tmp_path / "base")
    (base / INDEX_NAME).write_text(json.dumps({"weight_map": {"model.norm.weight": 3}}))
    with pytest.raises(OverlayError, match="weight_map"):
        BaseCheckpoint.inspect(base)


# ---------------------------------------------------------------------------------------------
# binding: a stale index (a sharded save re-saved as one file into the same directory)


def _stale_index(base: Path) -> None:
    """What transformers leaves after save_pretrained(max_shard_size=...) and then a plain
    save_pretrained into the same directory: the old index, its shards deleted."""
    (base / INDEX_NAME).write_text(json.dumps(
        {"metadata": {"total_size": 1},
         "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))


def test_stale_index_binds_the_single_file_the_loader_reads(tmp_path: Path) -> None:
    """The loader reads model.safetensors past a stale index (as transformers does); the
    binding refused the directory ('lacks model-00001-of-00002.safetensors'), so a checkpoint
    that loads could not be calibrated (refused after the model load), overlaid or
    materialized."""
    base = make_checkpoint(tmp_path / "base")
    _stale_index(base)
    assert safetensors_files(base) == [base / "model.safetensors"]  # what the loader reads
    b = BaseCheckpoint.inspect(base)
    assert b.fingerprint["file"] == "model.safetensors" and b.index is None
    assert set(b.files) == {"config.json", "model.safetensors"}
    pack = write_overlay(base, tmp_path / "pack", make_report(base))
    assert len(load_overlay_scales(base, pack)) == 6
    derived = materialize(base, pack, tmp_path / "derived")
    verify_derived(derived)
    # the derived index is a new one over model.safetensors + the scale file, which the
    # loader reads (the stale one was not carried over, so it cannot hide the scale file)
    assert sorted(p.name for p in safetensors_files(derived)) == [SCALE_FILE,
                                                                  "model.safetensors"]
    # the weights the loader reads are still bound: changing them is refused
    make_checkpoint(base, seed=1)  # a fine-tune saved over it: same names, other values
    with pytest.raises(OverlayError, match="wrong checkpoint revision"):
        load_overlay_scales(base, pack)


def test_index_naming_a_missing_shard_without_a_single_file_is_still_refused(
        tmp_path: Path) -> None:
    base = make_checkpoint(tmp_path / "base", sharded=True)
    (base / "model-00002-of-00002.safetensors").unlink()  # a partial download
    with pytest.raises(OverlayError, match="lacks model-00002-of-00002"):
        BaseCheckpoint.inspect(base)


def test_stale_index_chain_passes_the_gate(default_model_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    """End to end through the CLI: overlay -> materialize -> verify (loads the derived
    checkpoint in fp8_e4m3 and runs the gate) on a base with a stale index."""
    base = build_tiny(tmp_path / "base", default_model_dir)
    _stale_index(base)
    rc, _, err = cli(capsys, "overlay", "--model", str(base), "--unit-scale-negative-control",
                     "--out", str(tmp_path / "pack"))
    assert rc == 0, err
    rc, _, err = cli(capsys, "materialize", "--model", str(base), "--overlay",
                     str(tmp_path / "pack"), "--out", str(tmp_path / "derived"))
    assert rc == 0, err
    rc, out, err = cli(capsys, "verify", "--model", str(tmp_path / "derived"), "--device", "cpu")
    assert rc == 0, err
    assert "gate passed: loaded 4/4" in out


# ---------------------------------------------------------------------------------------------
# e4m3: the packed decoder took any integer dtype


@pytest.mark.parametrize("method", e4m3.DECODE_METHODS)
@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.float32])
def test_every_decoder_refuses_codes_that_are_not_uint8(method: str, dtype: torch.dtype) -> None:
    """bitcast and scalar refused an int8 view of the cache; packed sign-extended it into its
    words and returned garbage (0xB8 = -1.0 came back as -1, 0x38 = 1.0 as -480)."""
    q = torch.tensor([0xB8, 0x38, 0xC0, 0x01], dtype=torch.uint8)
    assert e4m3.decode(q, method=method).tolist() == [-1.0, 1.0, -2.0, 2.0**-9]
    bad = q.view(torch.int8).to(dtype) if dtype != torch.int8 else q.view(torch.int8)
    with pytest.raises(ValueError, match="uint8"):
        e4m3.decode(bad, method=method)


# ---------------------------------------------------------------------------------------------
# calibrate: refusals that came only after the model load


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvcap.llm

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(kvcap.llm, "LLM", refuse)


def test_calibrate_refuses_short_records_before_loading_the_model(
        no_model_load: None, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc, _, err = cli(capsys, "calibrate", "--model", str(tmp_path), "--out", str(tmp_path / "c"),
                     "--corpus", "prose", "--record-tokens", "8")
    assert rc != 0
    assert "--record-tokens 8" in err and "AssertionError" not in err
    assert not (tmp_path / "c").exists()


def test_calibrate_refuses_a_dangling_symlink_out_before_loading_the_model(
        no_model_load: None, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "c"
    out.symlink_to(tmp_path / "nowhere")
    rc, _, err = cli(capsys, "calibrate", "--model", str(tmp_path), "--out", str(out),
                     "--corpus", "prose")
    assert rc != 0
    assert "already exists" in err and "AssertionError" not in err
    assert out.is_symlink() and not (tmp_path / "nowhere").exists()


# ---------------------------------------------------------------------------------------------
# the gate's log line on a hand-edited manifest


@pytest.mark.parametrize("edit", [
    {"scale_file": "x"}, {"base": None}, {"base": {"fingerprint": []}},
])
def test_describe_scale_source_survives_a_malformed_manifest(tmp_path: Path, edit) -> None:
    """It names the source in the gate's log line on every fp8 load of a checkpoint with a
    manifest; `.get` on a list or null was an AttributeError that aborted the load."""
    base = make_checkpoint(tmp_path / "base")
    pack = write_overlay(base, tmp_path / "pack", make_report(base))
    manifest = json.loads((pack / MANIFEST_NAME).read_text())
    manifest.update(edit)
    (pack / MANIFEST_NAME).write_text(json.dumps(manifest))
    text = describe_scale_source(pack)
    assert text.startswith(f"checkpoint {pack} (overlay sha256 ")
