"""The fail-closed E4M3 startup gate (SYSTEM.md §4).

Every scaled attention layer owns two loading slots, k_scale and v_scale, that start at the
sentinel -1.0 ("not loaded"; 1.0 is a legal loaded value). After *all* checkpoint tensors have
been read, the loader hands every tensor whose name looks like a K/V scale to `run_gate`, which
fills the slots (accepting the aliases mainstream checkpoints use) and refuses to start unless
all 2 x num_layers scales are present, scalar, floating point, finite and > 0.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping

import torch

from kvcap.config import ModelSpec
from kvcap.errors import ScaleGateError

logger = logging.getLogger(__name__)

SENTINEL = -1.0  # "not loaded"; never a legal scale because scales must be > 0

# Suffixes after `<prefix>.<layer>.` accepted for each slot; the first is the canonical name
# (the one kvcap overlays write and vLLM/SGLang load).
K_ALIASES = ("self_attn.k_scale", "self_attn.k_proj.k_scale", "self_attn.k_proj.output_scale",
             "self_attn.attn.k_scale")
V_ALIASES = ("self_attn.v_scale", "self_attn.v_proj.v_scale", "self_attn.v_proj.output_scale",
             "self_attn.attn.v_scale")

# Anything that looks like a K/V cache scale, including forms the gate does not accept (the
# legacy combined `kv_scale`, unknown prefixes): the loader sets these aside from the weights and
# the gate then refuses what it cannot map, instead of silently ignoring it.
_KV_SCALE_RE = re.compile(r"(?:^|\.)(?:k_scale|v_scale|kv_scale|k_proj\.output_scale|"
                          r"v_proj\.output_scale)$")

ACCEPTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_LISTED = 12


def is_kv_scale_name(name: str) -> bool:
    """True for checkpoint tensor names that are (or look like) per-tensor K/V cache scales."""
    return _KV_SCALE_RE.search(name) is not None


def alias_table(spec: ModelSpec) -> dict[str, tuple[int, str]]:
    """Map every accepted tensor name to its slot (layer, "K" | "V")."""
    table: dict[str, tuple[int, str]] = {}
    for layer in range(spec.num_layers):
        for kind, aliases in (("K", K_ALIASES), ("V", V_ALIASES)):
            for suffix in aliases:
                table[f"{spec.layer_prefix}.{layer}.{suffix}"] = (layer, kind)
    return table


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" (and {more} more)" if more > 0 else "")


def scale_value(name: str, t: torch.Tensor) -> float:
    """The scalar value of one scale tensor; refuses wrong dtypes and shapes."""
    if not isinstance(t, torch.Tensor):
        raise ScaleGateError(f"K/V scale {name} is a {type(t).__name__}, not a tensor")
    if t.dtype not in ACCEPTED_DTYPES:
        raise ScaleGateError(f"K/V scale {name} has dtype {t.dtype}; expected a float32, "
                             "float16 or bfloat16 scalar")
    if t.dim() > 1 or t.numel() != 1:
        raise ScaleGateError(f"K/V scale {name} has shape {tuple(t.shape)}; expected a scalar "
                             "or a 1-element tensor")
    return float(t.detach().to("cpu", torch.float32).reshape(()).item())


def run_gate(spec: ModelSpec, found: Mapping[str, torch.Tensor],
             source: str) -> tuple[list[float], list[float]]:
    """Validate the K/V scales found in a checkpoint (or overlay) and return them per layer.

    Args:
        spec: the model's architecture (num_layers, layer_prefix).
        found: every tensor whose name `is_kv_scale_name`, read after all weights were consumed
            (other scale-like names such as `q_scale`/`prob_scale` are logged and ignored).
        source: where they came from (path and overlay fingerprint), for the log.

    Returns:
        (k_scales, v_scales): num_layers positive finite floats each.

    Raises:
        ScaleGateError: `Loaded X/N K/V scales. Missing: ...`, `... invalid: layer L K|V ...`,
        wrong dtype/shape, unrecognized or conflicting scale tensors.
    """
    n_layers = spec.num_layers
    total = 2 * n_layers
    table = alias_table(spec)
    ignored = sorted(name for name in found if not is_kv_scale_name(name))
    if ignored:  # e.g. q_scale / prob_scale of FP8 attention: not K/V cache scales
        logger.warning("ignoring %d non-K/V scale tensors from %s: %s", len(ignored), source,
                       _listing(ignored))
    found = {name: t for name, t in found.items() if is_kv_scale_name(name)}
    unknown = sorted(name for name in found if name not in table)
    if unknown:
        raise ScaleGateError(
            f"unrecognized K/V scale tensors in {source}: {_listing(unknown)} (expected "
            f"{spec.layer_prefix}.<0..{n_layers - 1}>.self_attn.k_scale/v_scale or an alias)")

    slots = {"K": [SENTINEL] * n_layers, "V": [SENTINEL] * n_layers}
    origin: dict[tuple[int, str], str] = {}
    for name in sorted(found):
        layer, kind = table[name]
        value = scale_value(name, found[name])
        prev = origin.get((layer, kind))
        if prev is not None and not _same(slots[kind][layer], value):
            raise ScaleGateError(f"conflicting K/V scales for layer {layer} {kind}: {prev} = "
                                 f"{slots[kind][layer]!r} but {name} = {value!r}")
        slots[kind][layer] = value
        origin[(layer, kind)] = name

    canonical = spec.scale_names()  # K then V per layer
    missing = [canonical[2 * layer + (kind == "V")]
               for layer in range(n_layers) for kind in ("K", "V")
               if (layer, kind) not in origin]
    if missing:
        raise ScaleGateError(f"Loaded {total - len(missing)}/{total} K/V scales. "
                             f"Missing: {_listing(missing)}")

    invalid = [f"layer {layer} {kind} = {slots[kind][layer]!r}"
               for layer in range(n_layers) for kind in ("K", "V")
               if not (math.isfinite(slots[kind][layer]) and slots[kind][layer] > 0)]
    if invalid:
        raise ScaleGateError(f"Loaded {total}/{total} K/V scales but some are invalid: "
                             f"{_listing(invalid)} (scales must be finite and > 0)")

    k_scales, v_scales = slots["K"], slots["V"]
    logger.info("gate passed: loaded %d/%d K/V scales from %s (K %.4g..%.4g, V %.4g..%.4g)",
                total, total, source, min(k_scales), max(k_scales), min(v_scales),
                max(v_scales))
    return k_scales, v_scales


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))
