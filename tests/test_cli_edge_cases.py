"""Bad or unusual input to the scale toolchain CLI (overlay, materialize, envelope, demo): every
refusal is one `error:` line with exit 2 (no traceback), and no output is lost or half-written."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kvscale_helpers import make_checkpoint, make_report, rewrite_json
from safetensors.torch import load_file, save_file
from test_scales_report import make_data, report_for

from kvcap.cli import main
from kvcap.errors import CalibrationError, OverlayError
from kvcap.scales.binding import MANIFEST_NAME, SCALE_FILE
from kvcap.scales.fsutil import sha256_file
from kvcap.scales.materialize import materialize
from kvcap.scales.overlay import load_overlay_scales, write_overlay


def cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def refused(capsys: pytest.CaptureFixture, match: str, *argv: str) -> str:
    rc, _, err = cli(capsys, *argv)
    assert rc == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert match in err, err
    return err


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "base")


@pytest.fixture
def report_path(base: Path, tmp_path: Path) -> Path:
    path = tmp_path / "report.json"
    path.write_text(json.dumps(make_report(base)))
    return path


@pytest.fixture
def pack(base: Path, tmp_path: Path) -> Path:
    return write_overlay(base, tmp_path / "pack", make_report(base))


# --- outputs whose parent is a file -------------------------------------------------------------

def test_overlay_out_under_a_file(base: Path, report_path: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "afile").write_text("keep me")
    refused(capsys, "afile", "overlay", "--model", str(base), "--report", str(report_path),
            "--out", str(tmp_path / "afile" / "pack"))
    assert (tmp_path / "afile").read_text() == "keep me"


def test_materialize_out_under_a_file(base: Path, pack: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "afile").write_text("keep me")
    refused(capsys, "afile", "materialize", "--model", str(base), "--overlay", str(pack),
            "--out", str(tmp_path / "afile" / "sub" / "derived"))


def test_compare_out_under_a_file(base: Path, pack: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "afile").write_text("keep me")
    refused(capsys, "afile", "compare", "--model", str(base), "--overlay", str(pack),
            "--tasks", "heldout", "--record-tokens", "64", "--out", str(tmp_path / "afile" / "cmp"))


# --- malformed calibration reports -------------------------------------------------------------

def _first(report: dict) -> dict:
    return report["tensors"][0]


@pytest.mark.parametrize("edit", [
    lambda r: _first(r).pop("scale"),
    lambda r: _first(r).update(scale=None),
    lambda r: _first(r).update(scale="abc"),
    lambda r: _first(r).update(scale=True),
    lambda r: _first(r).update(max_abs=None),
    lambda r: r.update(tensors={"x": 1}),
    lambda r: r["tensors"].append({**_first(r), "scale": 0.5}),  # duplicate, other value
    lambda r: r["model"]["files"].update({"config.json": "x"}),
    lambda r: r["model"]["fingerprint"].update(sha256=5),
], ids=["no-scale", "null-scale", "str-scale", "bool-scale", "null-max", "tensors-dict",
        "duplicate", "file-record-str", "sha-int"])
def test_overlay_refuses_malformed_report(edit, base: Path, report_path: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    rewrite_json(report_path, edit)
    refused(capsys, "report", "overlay", "--model", str(base), "--report", str(report_path),
            "--out", str(tmp_path / "p"))
    assert not (tmp_path / "p").exists()


# --- malformed or forged overlay packs ---------------------------------------------------------

NAME0 = "model.layers.0.self_attn.k_scale"


@pytest.mark.parametrize("edit", [
    lambda d: d["tensors"].update({NAME0: "x"}),
    lambda d: d.update(tensors=5),
    lambda d: d.update(scale_file="x"),
    lambda d: d["base"]["files"].update({"config.json": "x"}),
], ids=["record-str", "tensors-int", "scale-file-str", "base-file-str"])
def test_materialize_refuses_malformed_manifest(edit, base: Path, pack: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    rewrite_json(pack / MANIFEST_NAME, edit)
    refused(capsys, "malformed", "materialize", "--model", str(base), "--overlay", str(pack),
            "--out", str(tmp_path / "d"))
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("bad", [0.0, -0.5, math.inf, math.nan])
def test_pack_with_a_non_positive_or_non_finite_scale_refused(bad: float, base: Path,
                                                              pack: Path, tmp_path: Path) -> None:
    """A consistently forged pack (scale file, its checksum and the manifest agree) whose scale
    can never pass the gate: refused when the pack is bound, not only later by the gate."""
    values = load_file(str(pack / SCALE_FILE))
    values[NAME0] = torch.tensor(bad, dtype=torch.float32)
    save_file(values, str(pack / SCALE_FILE))
    digest = sha256_file(pack / SCALE_FILE)

    def forge(d: dict) -> None:
        d["scale_file"]["sha256"] = digest
        d["tensors"][NAME0]["scale"] = bad

    rewrite_json(pack / MANIFEST_NAME, forge)
    with pytest.raises(OverlayError, match=f"{NAME0} .*finite and > 0"):
        load_overlay_scales(base, pack)
    with pytest.raises(OverlayError, match="finite and > 0"):
        materialize(base, pack, tmp_path / "d")
    assert not (tmp_path / "d").exists()


# --- envelope ----------------------------------------------------------------------------------

@pytest.fixture
def reports(tmp_path: Path) -> list[Path]:
    paths = []
    for i, mult in enumerate((1.0, 1.5)):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(report_for({"prose": make_data(i, mult=mult)})))
        paths.append(p)
    return paths


def test_envelope_out_png_would_overwrite_itself(reports: list[Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    refused(capsys, ".png", "envelope", "--reports", *map(str, reports),
            "--out", str(tmp_path / "env.png"))
    assert not (tmp_path / "env.png").exists()


def test_envelope_refuses_to_overwrite_an_existing_figure(reports: list[Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    png = tmp_path / "env.png"
    png.write_bytes(b"an earlier figure")
    refused(capsys, "already exists", "envelope", "--reports", *map(str, reports),
            "--out", str(tmp_path / "env.json"))
    assert png.read_bytes() == b"an earlier figure"
    assert not (tmp_path / "env.json").exists()


def test_envelope_out_under_a_file(reports: list[Path], tmp_path: Path,
                                   capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "afile").write_text("keep me")
    refused(capsys, "afile", "envelope", "--reports", *map(str, reports),
            "--out", str(tmp_path / "afile" / "env.json"))


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0.0, None])
def test_envelope_refuses_bad_max_abs(bad, index: int, reports: list[Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    rewrite_json(reports[index], lambda r: r["tensors"][1].update(max_abs=bad))
    refused(capsys, "max_abs", "envelope", "--reports", *map(str, reports),
            "--out", str(tmp_path / "env.json"))
    assert not (tmp_path / "env.json").exists() and not (tmp_path / "env.png").exists()


@pytest.mark.parametrize("edit", [
    lambda r: r.pop("model"),
    lambda r: r.update(policy=None),
    lambda r: r.update(tensors=None),
    lambda r: r["tensors"][0].pop("name"),
], ids=["no-model", "null-policy", "null-tensors", "no-name"])
def test_envelope_refuses_malformed_report(edit, reports: list[Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    rewrite_json(reports[1], edit)
    refused(capsys, "report 1", "envelope", "--reports", *map(str, reports),
            "--out", str(tmp_path / "env.json"))


# --- demo ----------------------------------------------------------------------------------------

def test_demo_out_is_a_file(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "afile").write_text("keep me")
    refused(capsys, "afile", "demo", "--model", str(base), "--out",
            str(tmp_path / "afile"), "--device", "cpu")
    assert (tmp_path / "afile").read_text() == "keep me"


def test_demo_bad_model_leaves_no_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    refused(capsys, "does not exist", "demo", "--model", str(tmp_path / "nope"), "--out",
            str(tmp_path / "runs"), "--device", "cpu")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_demo_out_inside_the_base_refused_before_calibrating(base: Path, monkeypatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    # calibration wrote its output into the checkpoint, then the overlay step refused the place
    monkeypatch.setattr("kvcap.commands.calibrate.run", lambda a: pytest.fail("calibrated"))
    refused(capsys, "inside the base checkpoint", "demo", "--model", str(base), "--out",
            str(base / "runs"), "--device", "cpu")
    assert not (base / "runs").exists()


def test_demo_failed_first_step_names_it_and_leaves_no_run_dir(
        base: Path, tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture) -> None:
    # (a bad --device or too few --calib-tokens: each failed run left one more empty run
    # folder, and the error named calibrate's --max-tokens with no word of which step spoke)
    def refuse(args):
        raise CalibrationError("--max-tokens 20 too small")

    monkeypatch.setattr("kvcap.commands.calibrate.run", refuse)
    refused(capsys, "demo step 1. calibrate: --max-tokens", "demo", "--model", str(base),
            "--out", str(tmp_path / "runs"), "--device", "cpu")
    assert not any((tmp_path / "runs").iterdir())


def test_demo_sigterm_removes_the_staging_dir(base: Path, tmp_path: Path) -> None:
    # SIGTERM (`timeout kvcap demo`) killed the process inside calibrate's staged_dir: its
    # hidden staging dir stayed in the run folder, where no later run ever sweeps it
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from kvcap.commands import calibrate
        from kvcap.errors import CalibrationError
        from kvcap.scales.fsutil import staged_dir

        def run(args):
            with staged_dir(args.out, CalibrationError) as stage:
                (stage / "calibration-corpus.json").write_text("partial")
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)

        calibrate.run = run
        from kvcap.cli import main
        sys.exit(main(["demo", "--model", {str(base)!r}, "--out", {str(tmp_path / "runs")!r},
                       "--device", "cpu"]))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 130, res.stderr
    assert not list((tmp_path / "runs").rglob("*"))


def test_demo_summary_prints_whole_paths(base: Path, tmp_path: Path, monkeypatch,
                                         capsys: pytest.CaptureFixture) -> None:
    # an 80-column terminal cut every artifact path in the summary to "/tmp/.../run-2026…" and
    # broke the run folder's path of the last line in two
    for step in ("calibrate", "overlay", "materialize", "verify"):
        monkeypatch.setattr(f"kvcap.commands.{step}.run", lambda a: 0)
    monkeypatch.setattr("kvcap.commands.demo._generate", lambda d, dev: "64 tokens (length)")
    monkeypatch.setattr("kvcap.commands.demo._capacity", lambda m, g: "n tokens")
    monkeypatch.setenv("COLUMNS", "80")
    rc, out, err = cli(capsys, "demo", "--model", str(base), "--out",
                       str(tmp_path / "a-long-parent-folder" / "runs"), "--device", "cpu",
                       "--skip-compare")
    assert rc == 0, err
    summary = out[out.index("summary"):]
    assert "…" not in summary, summary
    assert "derived-checkpoint" in summary and "overlay" in summary
    run_dir = next((tmp_path / "a-long-parent-folder" / "runs").iterdir())
    assert f"inside it): {run_dir}\n" in summary, summary  # (was broken over two lines)
