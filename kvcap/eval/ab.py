"""The A/B arms: the same checkpoint with an unquantized KV cache (reference), calibrated E4M3,
and the unit-scale E4M3 negative control, all fed the same token ids with greedy decoding.

Arms are built up front and kept alive together so that every record runs through all of them
back to back and only the metrics (never the full-vocabulary logits) are kept.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcap.errors import ConfigError

logger = logging.getLogger(__name__)

REFERENCE = "reference"
CALIBRATED = "e4m3"
CONTROL = "e4m3_unit"
BASELINE_KV = ("auto", "fp16", "bf16", "fp32")


@dataclass(frozen=True)
class ArmSpec:
    name: str
    label: str
    kv_cache_dtype: str
    kv_scales: Path | None = None
    overlay: dict[str, Any] | None = None  # fingerprint of the overlay pack, when any


def overlay_fingerprint(base_dir: Path, pack: Path) -> dict[str, Any]:
    """Verify a pack against the base (fails fast on another checkpoint) and describe it."""
    from kvcap.scales.binding import BaseCheckpoint
    from kvcap.scales.overlay import verify_pack

    manifest, tensors = verify_pack(BaseCheckpoint.inspect(base_dir), pack)
    values = [float(t) for t in tensors.values()]
    return {
        "path": str(pack),
        "scale_file_sha256": manifest["scale_file"]["sha256"],
        "negative_control": bool(manifest["negative_control"]),
        "base_fingerprint": manifest["base"]["fingerprint"],
        "tensor_count": manifest["tensor_count"],
        "scale_min": min(values),
        "scale_max": max(values),
        "calibration": manifest.get("calibration"),
    }


def make_unit_overlay(base_dir: Path, out: Path) -> Path:
    """The unit-scale negative control pack for `base_dir` (reused when already valid)."""
    from kvcap.scales.overlay import write_overlay

    if out.exists():
        if overlay_fingerprint(base_dir, out)["negative_control"]:
            return out
        raise ConfigError(f"{out} exists and is not a unit-scale control overlay")
    return write_overlay(base_dir, out, None, negative_control=True)


def arm_specs(
    base_dir: Path, overlay: Path, control: Path | None, baseline_kv: str = "auto"
) -> list[ArmSpec]:
    """Validate every input of the arms (cheap checks only) and describe them."""
    if baseline_kv not in BASELINE_KV:
        raise ConfigError(f"baseline KV dtype {baseline_kv!r} is not one of {BASELINE_KV}")
    cal = overlay_fingerprint(base_dir, overlay)
    if cal["negative_control"]:
        raise ConfigError(f"{overlay} is a unit-scale negative control, not a calibrated overlay")
    arms = [
        ArmSpec(REFERENCE, f"{baseline_kv} KV (reference)", baseline_kv),
        ArmSpec(CALIBRATED, "calibrated E4M3", "fp8_e4m3", overlay, cal),
    ]
    if control is not None:
        ctl = overlay_fingerprint(base_dir, control)
        if not ctl["negative_control"]:  # (the report would call a calibrated pack the control)
            raise ConfigError(f"--control {control} is not a unit-scale negative control overlay "
                              "(kvcap overlay --unit-scale-negative-control writes one; leave "
                              "--control out to have compare write it)")
        arms.append(
            ArmSpec(
                CONTROL,
                "unit-scale E4M3 (negative control)",
                "fp8_e4m3",
                control,
                ctl,
            )
        )
    return arms


def build_llms(
    base_dir: Path,
    arms: Sequence[ArmSpec],
    device: str | None,
    max_tokens: int,
    max_num_seqs: int = 16,
    qsa: str | None = None,
) -> dict[str, Any]:
    """One LLM per arm, each with a KV pool of `max_tokens` tokens (plus a block per seq);
    `qsa`: a QSA preset every arm runs with (None: dense attention)."""
    from tqdm.auto import tqdm

    from kvcap.llm import LLM

    block = 16
    num_blocks = -(-max_tokens // block) + max_num_seqs
    llms = {}
    for arm in tqdm(arms, desc="loading arms"):
        llms[arm.name] = LLM(
            model=str(base_dir),
            kv_cache_dtype=arm.kv_cache_dtype,
            kv_scales=str(arm.kv_scales) if arm.kv_scales else None,
            device=device,
            block_size=block,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=False,
            seed=0,
            qsa=qsa,
        )
        logger.info("arm %s: kv %s, %s", arm.name, llms[arm.name].kv_dtype, arm.label)
    return llms


def _batches(prompts: Sequence[Sequence[int]], max_new: int, capacity: int, block: int
             ) -> list[list[int]]:
    """Indices of prompts grouped so that each group's KV need fits the pool (no preemption)."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, p in enumerate(prompts):
        need = -(-(len(p) + max_new) // block) * block + block
        if groups[-1] and used + need > capacity:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += need
    return [g for g in groups if g]


def greedy_all(llms: dict[str, Any], prompts: Sequence[Sequence[int]], max_new_tokens: int,
               desc: str) -> dict[str, list[list[int]]]:
    """Greedy continuations of the same prompt ids on every arm, in the same batches (sized to
    the smallest pool so no arm preempts)."""
    from tqdm.auto import tqdm

    from kvcap.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, seed=0)
    capacity = min(llm.pool.num_tokens for llm in llms.values())
    block = max(llm.config.block_size for llm in llms.values())
    groups = _batches(prompts, max_new_tokens, capacity, block)
    out: dict[str, list[list[int]]] = {name: [[] for _ in prompts] for name in llms}
    with tqdm(total=len(llms) * len(prompts), desc=desc) as bar:
        for name, llm in llms.items():
            for g in groups:
                res = llm.generate([list(prompts[i]) for i in g], params, use_tqdm=False)
                for i, r in zip(g, res, strict=True):
                    out[name][i] = list(r.token_ids)
                bar.update(len(g))
    return out
