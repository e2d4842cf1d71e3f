"""`kvcap overlay`: calibration report -> revision-bound scale pack for one base checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

HELP = "write a K/V scale overlay pack (scale file + manifest) bound to a base checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="base checkpoint: 'default' or an HF-format directory"
    )
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        help="calibration-report.json (or the calibrate output directory)",
    )
    p.add_argument("--out", required=True, type=Path, help="pack directory (must not exist)")
    p.add_argument(
        "--unit-scale-negative-control",
        action="store_true",
        help="write all scales = 1.0, flagged as a negative control (A/B only)",
    )
    p.add_argument(
        "--vllm-config",
        action="store_true",
        help="also write vllm-quantization-config.json (compressed-tensors kv_cache_scheme block)",
    )


def read_report(path: Path) -> dict[str, Any]:
    """A calibration report from a file or a calibrate output directory, with its SHA-256."""
    from kvcap.commands.calibrate import REPORT_NAME
    from kvcap.errors import OverlayError
    from kvcap.scales.binding import read_json
    from kvcap.scales.fsutil import sha256_file

    if path.is_dir():
        path = path / REPORT_NAME
    report = read_json(path, OverlayError, unique_keys=True)
    if not isinstance(report, dict):
        raise OverlayError(f"{path} is not a calibration report")
    report["_sha256"] = sha256_file(path)
    return report


def run(args: argparse.Namespace) -> int:
    from kvcap.commands.common import refuse_dummy
    from kvcap.errors import OverlayError
    from kvcap.models.loader import resolve_model_dir
    from kvcap.scales.overlay import write_overlay

    if args.report is None and not args.unit_scale_negative_control:
        raise OverlayError("--report is required (or --unit-scale-negative-control)")
    refuse_dummy(args.model, "overlay")
    base = resolve_model_dir(args.model)
    report = read_report(args.report) if args.report is not None else None
    out = write_overlay(
        base,
        args.out,
        report,
        negative_control=args.unit_scale_negative_control,
        vllm_config=args.vllm_config,
    )
    kind = "NEGATIVE CONTROL (unit scales)" if args.unit_scale_negative_control else "calibrated"
    print(f"wrote {kind} overlay {out} for base {base}")
    return 0
