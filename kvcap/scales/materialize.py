"""Materialize an overlay: base checkpoint + scale pack -> derived checkpoint directory.

The derived directory holds a symlink to every top-level entry of the base (except its index),
a copy of the scale file and of the manifest, and a merged standard
`model.safetensors.index.json` whose weight_map gains the scale keys and whose total_size
grows by their bytes (a single-file base gets a new index). Because it keeps the manifest and
scale file, a derived directory is itself a pack bound to the base its symlinks point at, so
`verify_derived` re-runs every binding check. The base is never written to.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Any

from kvcap.errors import OverlayError
from kvcap.scales.binding import (
    CONFIG_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    SCALE_FILE,
    SINGLE_NAME,
    BaseCheckpoint,
    read_json,
)
from kvcap.scales.fsutil import atomic_write_text, lies_within, sha256_file, staged_dir
from kvcap.scales.overlay import verify_pack

logger = logging.getLogger(__name__)


def safetensors_data_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file (file size - 8 - header length)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) != 8:
        raise OverlayError(f"{path} is truncated (no safetensors header)")
    (header_len,) = struct.unpack("<Q", head)
    data = path.stat().st_size - 8 - header_len
    if data < 0:
        raise OverlayError(f"{path} is truncated (header longer than the file)")
    return data


def _resolved_out(out: Path) -> Path:
    return out.parent.resolve() / out.name


def merged_index(base: BaseCheckpoint, scale_names: list[str], scale_bytes: int
                 ) -> dict[str, Any]:
    """The base's index (or a new one for a single-file base) plus the scale keys."""
    if base.index is not None:
        index = copy.deepcopy(base.index)
        meta = index.setdefault("metadata", {})
        if "total_size" not in meta:
            files = sorted(set(index["weight_map"].values()))
            meta["total_size"] = sum(safetensors_data_bytes(base.path / f) for f in files)
    else:
        index = {"metadata": {"total_size": safetensors_data_bytes(base.path / SINGLE_NAME)},
                 "weight_map": dict.fromkeys(sorted(base.tensor_names), SINGLE_NAME)}
    index["metadata"]["total_size"] = int(index["metadata"]["total_size"]) + scale_bytes
    clash = sorted(set(scale_names) & set(index["weight_map"]))
    if clash:
        raise OverlayError(f"scale keys already in the base index: {clash[:4]}")
    for name in scale_names:
        index["weight_map"][name] = SCALE_FILE
    return index


def _write_index(stage: Path, index: dict[str, Any]) -> None:
    atomic_write_text(stage / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")


def materialize(base_dir: Path | str, pack_dir: Path | str, out_dir: Path | str) -> Path:
    """Build the derived checkpoint `out_dir` from `base_dir` and the pack `pack_dir`.

    Refuses (OverlayError) on: output exists or lies inside the base, wrong base revision,
    changed base files, checksum or tensor-set mismatch, scale keys already in the base.
    Builds in a staging directory renamed atomically; nothing is left on failure.
    """
    base_dir, pack_dir, out = Path(base_dir), Path(pack_dir), Path(out_dir)
    if out.exists() or out.is_symlink():
        raise OverlayError(f"output {out} already exists; refusing to overwrite it")
    base_res = base_dir.resolve()
    out_res = _resolved_out(out)
    if lies_within(out_res, base_res):
        raise OverlayError(f"output {out} lies inside the base checkpoint {base_dir}; "
                           "the base is never modified")
    base = BaseCheckpoint.inspect(base_res)
    base.refuse_existing_scales()
    manifest, tensors = verify_pack(base, pack_dir)
    entries = sorted(base_res.iterdir(), key=lambda p: p.name)
    taken = {e.name for e in entries} & {SCALE_FILE, MANIFEST_NAME}
    if taken:
        raise OverlayError(f"base checkpoint already has {sorted(taken)}; cannot overlay")
    names = list(manifest["tensor_names"])
    with staged_dir(out, OverlayError) as stage:
        for entry in entries:
            if entry.name != INDEX_NAME:
                os.symlink(base_res / entry.name, stage / entry.name)
        shutil.copyfile(pack_dir / SCALE_FILE, stage / SCALE_FILE)
        if sha256_file(stage / SCALE_FILE) != manifest["scale_file"]["sha256"]:
            raise OverlayError(f"{pack_dir / SCALE_FILE} changed while it was being copied")
        shutil.copyfile(pack_dir / MANIFEST_NAME, stage / MANIFEST_NAME)
        index = merged_index(base, names, safetensors_data_bytes(stage / SCALE_FILE))
        _write_index(stage, index)
        missing = sorted(f for f in set(index["weight_map"].values())
                         if not (stage / f).is_file())
        if missing:
            raise OverlayError(f"derived index names missing files {missing}")
    logger.info("materialized %s: %d base entries linked, %d scale tensors, base %s=%s%s", out,
                sum(e.name != INDEX_NAME for e in entries), len(tensors),
                base.fingerprint["scheme"], base.fingerprint["sha256"][:16],
                " (NEGATIVE CONTROL)" if manifest["negative_control"] else "")
    return out


def derived_base_dir(derived: Path) -> Path:
    """The base a derived directory was built from (where its config.json symlink points)."""
    cfg = Path(derived) / CONFIG_NAME
    if not cfg.is_symlink():
        raise OverlayError(f"{derived} is not a materialized checkpoint ({CONFIG_NAME} is not a "
                           "symlink into a base)")
    # Follow this one link only: resolve() would also follow the base's own links, and an HF
    # hub snapshot links every file into ../../blobs, which is not the base directory.
    return (cfg.parent / os.readlink(cfg)).parent


def verify_derived(derived: Path | str) -> dict[str, Any]:
    """Re-check a derived directory: its pack against its base, and its merged index."""
    derived = Path(derived)
    base = BaseCheckpoint.inspect(derived_base_dir(derived))
    base.refuse_existing_scales()
    manifest, tensors = verify_pack(base, derived)
    index_path = derived / INDEX_NAME
    index = read_json(index_path)  # (bytes that are not UTF-8 were a UnicodeDecodeError)
    want = merged_index(base, list(manifest["tensor_names"]),
                        safetensors_data_bytes(derived / SCALE_FILE))
    if index != want:
        raise OverlayError(f"{index_path} is not the base index merged with the overlay")
    for name in base.files:
        if (derived / name).resolve() != (base.path / name).resolve():
            raise OverlayError(f"{derived / name} does not point into the base {base.path}")
    return manifest
