"""The revision-bound scale overlay pack (SYSTEM.md §3): write it, verify it, load it.

A pack directory holds `model-kvscales.safetensors` (one FP32 scalar per scaled tensor, named
`<prefix>.<L>.self_attn.k_scale|v_scale`, the names vLLM/SGLang load) and
`kvscales-manifest.json` (schema, scale contract, base fingerprint and file hashes, scale-file
SHA-256, tensor names and count, per-tensor max_abs and scale, negative-control flag).
Binding rules are in `kvcap.scales.binding`; `materialize` is in `kvcap.scales.materialize`.
"""

from __future__ import annotations

import json
import logging
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvcap.config import is_number
from kvcap.errors import OverlayError
from kvcap.scales.binding import (
    MANIFEST_KIND,
    MANIFEST_NAME,
    SCALE_CONTRACT,
    SCALE_FILE,
    SCHEMA_VERSION,
    BaseCheckpoint,
    check_same_base,
    read_json,
)
from kvcap.scales.fsutil import atomic_write_text, lies_within, sha256_file, staged_dir

logger = logging.getLogger(__name__)

VLLM_CONFIG_NAME = "vllm-quantization-config.json"
E4M3_MAX = 448.0


def kv_cache_scheme() -> dict[str, Any]:
    """The compressed-tensors `kv_cache_scheme` for static per-tensor E4M3 K/V scales."""
    return {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
            "symmetric": True}


def vllm_quantization_config() -> dict[str, Any]:
    """A `quantization_config` block (compressed-tensors format) declaring only the KV scheme."""
    return {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
            "ignore": [], "quantization_status": "frozen", "kv_cache_scheme": kv_cache_scheme()}


def _scales_from_report(report: dict[str, Any], base: BaseCheckpoint
                        ) -> tuple[dict[str, float], dict[str, float | None], dict[str, Any]]:
    """Per-name scale and max_abs from a calibration report, checked against the base."""
    if report.get("kind") != "kvcap.calibration-report":
        raise OverlayError("the report is not a kvcap calibration report")
    if "model" in report:
        check_same_base(report["model"], base, "the calibration report")
    else:
        raise OverlayError("the calibration report does not record its model fingerprint")
    scales: dict[str, float] = {}
    max_abs: dict[str, float | None] = {}
    records = report.get("tensors")
    if not isinstance(records, list):
        raise OverlayError("the calibration report has no list of tensors")
    for i, t in enumerate(records):
        # A hand-edited or truncated report must be refused by name, not by a KeyError, and
        # never coerced: float("0.5") or float(True) would pass off text or a flag as a scale.
        try:
            name, s, m = t["name"], t["scale"], t["max_abs"]
        except (KeyError, TypeError):
            raise OverlayError(f"calibration report tensor record {i} lacks name, scale or "
                               "max_abs") from None
        if not isinstance(name, str):  # (a list or dict name was a TypeError further down)
            raise OverlayError(f"calibration report tensor record {i}: name {name!r} is not a "
                               "string")
        if not all(is_number(v) for v in (s, m)):
            raise OverlayError(f"calibration report tensor {name!r}: scale {s!r} and max_abs "
                               f"{m!r} must be numbers")
        if name in scales:  # a second record would silently replace the first
            raise OverlayError(f"calibration report lists tensor {name!r} twice")
        scales[name], max_abs[name] = float(s), float(m)
    expected = base.spec.scale_names()
    if set(scales) != set(expected):
        missing = sorted(set(expected) - set(scales))
        extra = sorted(set(scales) - set(expected))
        raise OverlayError(f"report tensors do not match the base's {len(expected)} scale names"
                           f" (missing {missing[:4]}, unexpected {extra[:4]})")
    policy = report.get("policy")
    for name, s in scales.items():
        if not (math.isfinite(s) and s > 0 and float(np.float32(s)) == s):
            raise OverlayError(f"report scale for {name} is {s!r}: not a positive FP32 value")
        m = max_abs[name]
        # max_abs goes into the manifest: NaN or inf would be written as bare NaN / Infinity,
        # which strict JSON readers refuse, and a value <= 0 cannot come from calibration.
        if not (math.isfinite(m) and m > 0):
            raise OverlayError(f"report max_abs for {name} is {m!r}: not a finite number > 0 "
                               "(a corrupted report? recalibrate)")
        # The max policy guarantees 448 * scale >= max_abs (zero saturation on the calibration
        # set); a report that claims it but breaks it would saturate silently.
        if isinstance(policy, dict) and policy.get("name") == "max" and \
                Fraction(s) * int(E4M3_MAX) < Fraction(m):
            raise OverlayError(f"report scale for {name} is {s!r} but its max_abs {m!r} needs "
                               f"at least {m / E4M3_MAX!r} under the max policy (448 * scale >= "
                               "max_abs); the report was edited or corrupted: recalibrate")
    info = {"policy": report.get("policy"), "tokens": report.get("tokens"),
            "shards": report.get("shard_names"), "report_sha256": report.get("_sha256")}
    return scales, max_abs, info


def write_overlay(base_dir: Path | str, out_dir: Path | str, report: dict[str, Any] | None,
                  negative_control: bool = False, vllm_config: bool = False) -> Path:
    """Write a pack for `base_dir` from a calibration `report` (or a unit-scale control)."""
    out = Path(out_dir)
    out_res, base_res = out.parent.resolve() / out.name, Path(base_dir).resolve()
    if lies_within(out_res, base_res):  # as materialize refuses it
        raise OverlayError(f"output {out} lies inside the base checkpoint {base_dir}; the base "
                           "is never modified: write the pack elsewhere")
    base = BaseCheckpoint.inspect(base_dir)
    base.refuse_existing_scales()
    names = base.spec.scale_names()
    if report is not None:
        scales, max_abs, calib = _scales_from_report(report, base)
    elif negative_control:
        scales, max_abs, calib = {}, dict.fromkeys(names), {}
    else:
        raise OverlayError("an overlay needs a calibration report (or "
                           "--unit-scale-negative-control)")
    if negative_control:
        scales = dict.fromkeys(names, 1.0)
        logger.warning("writing a unit-scale NEGATIVE CONTROL overlay (all scales 1.0)")
    tensors = {n: torch.tensor(scales[n], dtype=torch.float32) for n in names}
    with staged_dir(Path(out_dir), OverlayError) as stage:
        save_file(tensors, str(stage / SCALE_FILE),
                  metadata={"format": "pt", "kvcap_scale_contract": SCALE_CONTRACT,
                            "kvcap_negative_control": str(negative_control).lower()})
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "kind": MANIFEST_KIND,
            "scale_contract": SCALE_CONTRACT,
            "kv_cache_dtype": "fp8_e4m3",
            "negative_control": negative_control,
            "base": base.describe(),
            "scale_file": {"name": SCALE_FILE, "sha256": sha256_file(stage / SCALE_FILE),
                           "size": (stage / SCALE_FILE).stat().st_size},
            "tensor_count": len(names),
            "tensor_names": names,
            "tensors": {n: {"layer": i // 2, "kind": "KV"[i % 2], "max_abs": max_abs[n],
                            "scale": scales[n]} for i, n in enumerate(names)},
            "calibration": calib,
        }
        atomic_write_text(stage / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")
        if vllm_config:
            atomic_write_text(stage / VLLM_CONFIG_NAME, json.dumps(
                {"quantization_config": vllm_quantization_config()}, indent=1) + "\n")
    logger.info("overlay %s: %d scales for base %s=%s%s", out_dir, len(names),
                base.fingerprint["scheme"], base.fingerprint["sha256"][:16],
                " (negative control)" if negative_control else "")
    return Path(out_dir)


def read_manifest(pack_dir: Path) -> dict[str, Any]:
    manifest = read_json(Path(pack_dir) / MANIFEST_NAME, unique_keys=True)
    if not isinstance(manifest, dict) or manifest.get("kind") != MANIFEST_KIND:
        raise OverlayError(f"{pack_dir / MANIFEST_NAME} is not a kvcap scale manifest")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise OverlayError(f"{pack_dir / MANIFEST_NAME} has schema version "
                           f"{manifest.get('schema_version')!r}; this kvcap reads "
                           f"{SCHEMA_VERSION}")
    if manifest.get("scale_contract") != SCALE_CONTRACT:
        raise OverlayError(f"manifest scale contract {manifest.get('scale_contract')!r} is not "
                           f"{SCALE_CONTRACT!r}")
    return manifest


def verify_pack(base: BaseCheckpoint, pack_dir: Path) -> tuple[dict[str, Any],
                                                               dict[str, torch.Tensor]]:
    """All binding checks of a pack against a base; returns (manifest, scale tensors)."""
    pack_dir = Path(pack_dir)
    manifest = read_manifest(pack_dir)
    try:
        check_same_base(manifest["base"], base, f"overlay {pack_dir}")
        names = list(manifest["tensor_names"])
        records = manifest["tensors"]
        file_rec = manifest["scale_file"]
        negative = manifest["negative_control"]
        count = manifest["tensor_count"]
    except (KeyError, TypeError) as e:
        raise OverlayError(f"{pack_dir / MANIFEST_NAME} lacks field {e}") from None
    expected = base.spec.scale_names()
    # Hand-edited manifests: wrong types are refused by name, not by an AttributeError.
    if not isinstance(file_rec, dict) or not isinstance(records, dict) or \
            not all(isinstance(r, dict) for r in records.values()):
        raise OverlayError(f"{pack_dir / MANIFEST_NAME} is malformed: scale_file and every "
                           "tensors entry must be JSON objects; rewrite it with kvcap overlay")
    if names != expected or count != len(expected) or set(records) != set(expected):
        raise OverlayError(f"overlay {pack_dir} tensor set does not match the base's "
                           f"{len(expected)} scale names ({base.spec.layer_prefix}.<L>."
                           "self_attn.k_scale/v_scale)")
    if file_rec.get("name") != SCALE_FILE:
        raise OverlayError(f"manifest names scale file {file_rec.get('name')!r}, expected "
                           f"{SCALE_FILE!r}")
    scale_path = pack_dir / SCALE_FILE
    if not scale_path.is_file():
        raise OverlayError(f"overlay {pack_dir} lacks {scale_path.name}")
    digest = sha256_file(scale_path)
    if digest != file_rec.get("sha256"):
        raise OverlayError(f"checksum mismatch: {scale_path} has sha256 {digest[:16]} but the "
                           f"manifest records {str(file_rec.get('sha256'))[:16]}")
    try:
        with safe_open(str(scale_path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types
        raise OverlayError(f"cannot read {scale_path}: {e}") from None
    if set(tensors) != set(expected):
        raise OverlayError(f"{scale_path} tensor set does not match its manifest "
                           f"({len(tensors)} tensors, expected {len(expected)})")
    for name in expected:
        t = tensors[name]
        if t.dtype != torch.float32 or t.dim() != 0:
            raise OverlayError(f"{scale_path}: {name} is {t.dtype} {tuple(t.shape)}, expected "
                               "an FP32 scalar")
        value = float(t)
        # A forged or hand-written pack can agree with its own checksum and still carry a scale
        # the gate will refuse; refuse it here so materialize never builds an unusable checkpoint.
        if not (math.isfinite(value) and value > 0):
            raise OverlayError(f"{scale_path}: {name} = {value!r}; scales must be finite and > 0"
                               " (recalibrate and rewrite the overlay)")
        if value != records[name].get("scale"):
            raise OverlayError(f"{name} = {value!r} in {scale_path.name} but the manifest "
                               f"records {records[name].get('scale')!r}")
        if negative is True and value != 1.0:
            raise OverlayError(f"manifest says negative control but {name} = {value!r}")
    if not isinstance(negative, bool):
        raise OverlayError(f"manifest negative_control is {negative!r}, not a boolean")
    # The scale file's own flag is under the checksum; the manifest's is not: a unit-scale
    # control relabelled "false" by hand would otherwise pass as a calibrated pack.
    flag = metadata.get("kvcap_negative_control")
    if flag is not None and flag != str(negative).lower():
        raise OverlayError(f"manifest says negative_control {str(negative).lower()} but "
                           f"{scale_path.name} was written with {flag}: the manifest was edited; "
                           "rewrite the overlay with kvcap overlay")
    return manifest, tensors


def load_overlay_scales(base_dir: Path | str, pack_dir: Path | str) -> dict[str, torch.Tensor]:
    """Scales of a pack for `LLM(model=BASE, kv_scales=PACK)`, with materialize's checks."""
    base = BaseCheckpoint.inspect(base_dir)
    base.refuse_existing_scales()
    manifest, tensors = verify_pack(base, Path(pack_dir))
    logger.info("overlay %s bound to base %s=%s; scale file sha256 %s%s", pack_dir,
                base.fingerprint["scheme"], base.fingerprint["sha256"][:16],
                manifest["scale_file"]["sha256"][:16],
                " (NEGATIVE CONTROL: unit scales)" if manifest["negative_control"] else "")
    return tensors


def describe_scale_source(model_dir: Path | str) -> str:
    """A one-line source for the gate log: the overlay fingerprint when the dir has a manifest."""
    model_dir = Path(model_dir)
    try:
        manifest = read_manifest(model_dir)
    except OverlayError:
        return f"checkpoint {model_dir}"
    nc = ", NEGATIVE CONTROL" if manifest.get("negative_control") else ""

    def field(*keys: str) -> str:
        # A log line only: a hand-edited manifest (a list or null where an object belongs)
        # must not turn the load it describes into an AttributeError traceback.
        value: Any = manifest
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return str(value)[:16]

    return (f"checkpoint {model_dir} (overlay sha256 {field('scale_file', 'sha256')}, base "
            f"{field('base', 'fingerprint', 'sha256')}{nc})")
