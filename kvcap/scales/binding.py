"""Binding of a scale overlay to one base checkpoint revision.

Fingerprint (the revision identity, SYSTEM.md §3): SHA-256 of the base's
`model.safetensors.index.json`, or of its single `model.safetensors` when it has no index
(or a stale one naming missing shards, which the loader reads past to that file).
The index alone does not change when a fine-tune keeps names and shapes, so the manifest also
records the SHA-256 and size of `config.json` and of every weight file the checkpoint uses, and
every binding check (materialize, load in memory, verify) re-hashes them: weights changed after
calibration are refused even when the index is byte-identical. Hashing costs one sequential read
of the weights (about a second per GB).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from kvcap.config import ModelSpec
from kvcap.errors import ConfigError, ModelLoadError, OverlayError
from kvcap.models.loader import spec_of_config, stale_index
from kvcap.scales.fsutil import sha256_file
from kvcap.scales.gate import is_kv_scale_name

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
SCALE_FILE = "model-kvscales.safetensors"
MANIFEST_NAME = "kvscales-manifest.json"
SCHEMA_VERSION = 1
MANIFEST_KIND = "kvcap.kvscales-overlay"
SCALE_CONTRACT = "e4m3fn(x/scale), max_abs/448"


class _DuplicateKey(ValueError):
    pass


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def read_json(path: Path, error: type[Exception] = OverlayError,
              unique_keys: bool = False) -> Any:
    """Parse a JSON file, refusing with `error` (one line) whatever is wrong with it.

    `unique_keys`: refuse an object that repeats a key. json.loads keeps the last value in
    silence, other readers the first, so a manifest or report that says
    `"negative_control": true, ..., "negative_control": false` means different things to
    different tools; kvcap never writes one (used for kvcap's own artifacts, not for a base's
    config or index, which transformers reads leniently).
    """
    hook = _unique_object if unique_keys else None
    try:
        return json.loads(Path(path).read_text(), object_pairs_hook=hook)
    except FileNotFoundError:
        raise error(f"{path} does not exist") from None
    except _DuplicateKey as e:
        raise error(f"{path} repeats the key {e.args[0]!r} in one object (hand-edited or "
                    "corrupted?); write it again with kvcap") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"cannot read {path}: {e}") from None


def safetensors_names(path: Path) -> list[str]:
    """Tensor names in a safetensors file (header only); OverlayError if unreadable."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error types
        raise OverlayError(f"cannot read safetensors file {path}: {e}") from None


@dataclass(frozen=True)
class BaseCheckpoint:
    """What binds an overlay to a base checkpoint: identity, files, tensor names, spec."""

    path: Path
    spec: ModelSpec
    fingerprint: dict[str, str]  # {"scheme", "file", "sha256"}
    files: dict[str, dict[str, Any]]  # name -> {"size", "sha256"} (config + weight files)
    tensor_names: frozenset[str]
    index: dict[str, Any] | None  # parsed index file, None for a single-file base

    @classmethod
    def inspect(cls, path: Path | str) -> BaseCheckpoint:
        path = Path(path)
        if not path.is_dir():
            raise OverlayError(f"base checkpoint {path} is not a directory")
        try:  # as the loader reads it: a list, null heads, "x" layers are one line each
            spec = spec_of_config(read_json(path / CONFIG_NAME), path / CONFIG_NAME)
        except (ConfigError, ModelLoadError) as e:
            raise OverlayError(f"base checkpoint {path}: {e}") from None
        index: dict[str, Any] | None = None
        if (path / INDEX_NAME).is_file():
            index = read_json(path / INDEX_NAME)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map or \
                    not all(isinstance(f, str) for f in weight_map.values()):
                raise OverlayError(f"{path / INDEX_NAME} has no weight_map of tensor name -> "
                                   "file name")
            if stale_index(path, weight_map.values()):
                # The loader reads model.safetensors alone here, as transformers does: bind
                # that file, not the stale index, or a checkpoint that loads could never be
                # calibrated or overlaid.
                logger.warning("%s names missing files but %s is there: binding %s (a stale "
                               "index, as the loader reads it)", INDEX_NAME, SINGLE_NAME,
                               SINGLE_NAME)
                index = None
        if index is not None:
            weight_files = sorted(set(weight_map.values()))
            names = frozenset(weight_map)
            fp_file = INDEX_NAME
        elif (path / SINGLE_NAME).is_file():
            # Without an index the loader reads model.safetensors alone, as transformers does
            # (models.loader.safetensors_files), whatever other *.safetensors lie beside it.
            weight_files = [SINGLE_NAME]
            names = frozenset(safetensors_names(path / SINGLE_NAME))
            fp_file = SINGLE_NAME
        else:
            raise OverlayError(f"base checkpoint {path} has neither {INDEX_NAME} nor "
                               f"{SINGLE_NAME}")
        files: dict[str, dict[str, Any]] = {}
        for name in [CONFIG_NAME, *weight_files]:
            f = path / name
            if not f.is_file():
                raise OverlayError(f"base checkpoint {path} lacks {name} (named by its index)")
            files[name] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
        fp_sha = files[fp_file]["sha256"] if fp_file in files else sha256_file(path / fp_file)
        fingerprint = {"scheme": f"sha256({fp_file})", "file": fp_file, "sha256": fp_sha}
        return cls(path, spec, fingerprint, files, names, index)

    def scale_keys_present(self) -> list[str]:
        return sorted(n for n in self.tensor_names if is_kv_scale_name(n))

    def refuse_existing_scales(self) -> None:
        present = self.scale_keys_present()
        if present:
            raise OverlayError(f"base checkpoint {self.path} already has K/V scale tensors "
                               f"({', '.join(present[:4])}{' ...' if len(present) > 4 else ''});"
                               " refusing to overlay another set")

    def describe(self) -> dict[str, Any]:
        """The JSON record of this base (stored in reports and manifests)."""
        return {"fingerprint": dict(self.fingerprint), "files": self.files,
                "layer_prefix": self.spec.layer_prefix, "num_layers": self.spec.num_layers}


def check_same_base(recorded: dict[str, Any], base: BaseCheckpoint, what: str) -> None:
    """Refuse unless `recorded` (from a manifest or report) describes exactly `base`."""
    try:
        fp = recorded["fingerprint"]
        files = recorded["files"]
        want, scheme = fp["sha256"], fp["scheme"]
    except (KeyError, TypeError):
        raise OverlayError(f"{what} lacks the base checkpoint fingerprint") from None
    have = base.fingerprint
    if scheme != have["scheme"] or want != have["sha256"]:
        raise OverlayError(
            f"{what} was made for base revision {scheme}={str(want)[:16]} but {base.path} has "
            f"{have['scheme']}={have['sha256'][:16]}: wrong checkpoint revision")
    if not isinstance(files, dict) or set(files) != set(base.files):
        raise OverlayError(f"{what} records base files {sorted(files or {})} but {base.path} "
                           f"uses {sorted(base.files)}: wrong checkpoint revision")
    for name, rec in sorted(files.items()):
        now = base.files[name]
        if not isinstance(rec, dict):  # hand-edited record: refuse by name, not AttributeError
            raise OverlayError(f"{what} has a malformed record for base file {name}: {rec!r}")
        if rec.get("sha256") != now["sha256"] or rec.get("size") != now["size"]:
            raise OverlayError(f"base file {base.path / name} changed since calibration "
                               f"(sha256 {now['sha256'][:16]}, recorded "
                               f"{str(rec.get('sha256'))[:16]}); recalibrate for this revision")
