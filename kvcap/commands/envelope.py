"""`kvcap envelope`: merge calibration reports (max of max_abs, scales recomputed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "merge calibration reports: base statistics of the first, max of max_abs over all"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--reports",
        required=True,
        nargs="+",
        type=Path,
        help="calibration reports (files or calibrate output dirs); the first one's "
        "distribution statistics are kept",
    )
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="output report JSON (a PNG figure is written beside it)",
    )


def run(args: argparse.Namespace) -> int:
    from kvcap.commands.overlay import read_report
    from kvcap.errors import CalibrationError
    from kvcap.scales.figure import write_figure
    from kvcap.scales.fsutil import atomic_write_text, make_dirs
    from kvcap.scales.report import envelope

    png = args.out.with_suffix(".png")
    if png == args.out:  # the JSON would replace the figure just written under the same name
        raise CalibrationError(f"--out {args.out} ends in .png, the figure's name; give the "
                               "report a .json name (the figure goes beside it)")
    for path in (args.out, png):  # both are outputs: overwrite neither
        if path.exists() or path.is_symlink():
            raise CalibrationError(f"output {path} already exists; refusing to overwrite it")
    reports = [read_report(p) for p in args.reports]
    merged = envelope(reports)
    merged["envelope"]["sources"] = [
        {"path": str(p), "sha256": r["_sha256"]} for p, r in zip(args.reports, reports, strict=True)
    ]
    make_dirs(args.out.parent, CalibrationError)
    try:
        write_figure(merged, png)
    except (KeyError, TypeError, AttributeError) as e:  # report 0 lacks what the figure shows
        raise CalibrationError(f"cannot draw the figure from report 0 ({type(e).__name__}: "
                               f"{e}); use reports written by kvcap calibrate") from None
    try:
        atomic_write_text(args.out, json.dumps(merged, indent=1) + "\n")
    except BaseException:  # no figure without its report (it would also block a rerun)
        png.unlink(missing_ok=True)
        raise
    changed = sum(
        t["scale"] != r0["scale"]
        for t, r0 in zip(merged["tensors"], reports[0]["tensors"], strict=True)
    )
    s = merged["summary"]["scale_range"]
    print(
        f"envelope of {len(reports)} reports: {changed} of {len(merged['tensors'])} scales "
        f"raised; scales {s[0]:.4g}..{s[1]:.4g}; wrote {args.out} and {png}"
    )
    return 0
