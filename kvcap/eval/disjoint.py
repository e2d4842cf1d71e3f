"""Calibration/evaluation disjointness: no evaluation record may appear in the calibration
manifest (SYSTEM.md §2). The splits are disjoint by construction (whole document groups); this
module verifies it by record hash against the calibration corpus manifest when one exists."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvcap.commands.calibrate import REPORT_NAME
from kvcap.errors import ConfigError
from kvcap.eval.corpora import MANIFEST_SCHEMA, manifest_hashes, tokenizer_fingerprint
from kvcap.scales.fsutil import sha256_file

logger = logging.getLogger(__name__)


def _is_calibration_manifest(path: Path) -> bool:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(data, dict) and data.get("schema") == MANIFEST_SCHEMA
            and data.get("split") == "calibration")


def find_calibration_manifest(overlay: Path) -> Path | None:
    """A calibration corpus manifest near an overlay pack (`kvcap calibrate` writes
    calibration-corpus.json beside calibration-report.json): in the pack dir, its parent, or
    their subdirectories. Where the pack records the sha256 of the report it was made from,
    only a manifest beside that very report counts: with several calibration runs under one
    parent, the first in name order was taken, and disjointness checked against another run's
    records. None when there is none."""
    want = None
    try:
        pack = json.loads((overlay / "kvscales-manifest.json").read_text(encoding="utf-8"))
        want = (pack.get("calibration") or {}).get("report_sha256")
    except (OSError, ValueError, AttributeError):
        pass
    candidates: list[Path] = []
    for d in (overlay, overlay.parent):
        candidates += sorted(d.glob("*.json")) + sorted(d.glob("*/*.json"))
    for c in candidates:
        if c.is_file() and c.stat().st_size < 64 * 2**20 and _is_calibration_manifest(c):
            if not isinstance(want, str) or _report_sha256(c.parent) == want:
                return c
            logger.info("calibration manifest %s is beside another report than %s's; not it",
                        c, overlay)
    return None


def _report_sha256(directory: Path) -> str | None:
    report = directory / REPORT_NAME
    return sha256_file(report) if report.is_file() else None


def load_calibration_hashes(path: Path, tokenizer: Any) -> tuple[set[str], dict[str, Any]]:
    """Hashes of a calibration manifest; refuses one made with a different tokenizer (its
    hashes would say nothing about these token ids)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read calibration manifest {path}: {exc}") from exc
    if (not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA
            or data.get("split") != "calibration"):
        raise ConfigError(f"{path} is not a calibration corpus manifest ({MANIFEST_SCHEMA})")
    if data.get("tokenizer_fingerprint") != tokenizer_fingerprint(tokenizer):
        raise ConfigError(f"calibration manifest {path} was made with another tokenizer")
    hashes = manifest_hashes(path)  # a malformed shard list fails here with one line
    info = {"path": str(path), "total_tokens": data.get("total_tokens"),
            "shards": [s.get("name") for s in data["shards"]]}
    return hashes, info


def check(eval_hashes: dict[str, Iterable[str]], cal_hashes: set[str] | None,
          cal_info: dict[str, Any] | None, excluded: int = 0) -> dict[str, Any]:
    """Compare every evaluation record hash (by task) with the calibration manifest."""
    per_task = {t: sorted(set(h)) for t, h in eval_hashes.items()}
    n_eval = sum(len(v) for v in per_task.values())
    if cal_hashes is None:
        return {"verified": False, "calibration_manifest": None, "evaluation_records": n_eval,
                "overlaps": None, "excluded_from_heldout": excluded,
                "summary": "no calibration manifest found: disjoint by construction (whole "
                           "document groups per split, split-tagged generators), not verified "
                           "by hash"}
    overlaps = {t: [h for h in v if h in cal_hashes] for t, v in per_task.items()}
    n_over = sum(len(v) for v in overlaps.values())
    summary = (f"{n_eval} evaluation records checked against {len(cal_hashes)} calibration "
               f"records: {n_over} overlaps"
               + (f" ({excluded} candidate held-out records were excluded before scoring)"
                  if excluded else ""))
    if n_over:
        logger.error("disjointness violated: %s", summary)
    return {"verified": n_over == 0, "calibration_manifest": cal_info,
            "evaluation_records": n_eval, "overlaps": {t: v for t, v in overlaps.items() if v},
            "excluded_from_heldout": excluded, "summary": summary}
