"""`kvcap verify`: load a checkpoint for fp8_e4m3 and run the startup gate, nothing else."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

HELP = "load a checkpoint with an fp8_e4m3 KV cache and run the scale gate (exit 0 = pass)"
VERIFY_BLOCKS = 4
VERIFY_BLOCK_SIZE = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="a materialized (derived) checkpoint, or a base with --kv-scales",
    )
    p.add_argument(
        "--kv-scales",
        type=Path,
        default=None,
        help="overlay pack to bind in memory (LLM(model=BASE, kv_scales=PACK))",
    )
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N")


def run(args: argparse.Namespace) -> int:
    from kvcap.commands.common import refuse_dummy
    from kvcap.errors import ScaleGateError
    from kvcap.llm import LLM
    from kvcap.models.loader import resolve_model_dir
    from kvcap.scales.binding import MANIFEST_NAME
    from kvcap.scales.materialize import verify_derived
    from kvcap.scales.overlay import read_manifest

    refuse_dummy(args.model, "verify")
    start = time.perf_counter()
    model_dir = resolve_model_dir(args.model)
    binding = "checkpoint scales (no kvcap manifest)"
    negative = False
    if args.kv_scales is None and (model_dir / MANIFEST_NAME).is_file():
        manifest = verify_derived(model_dir)
        negative = bool(manifest["negative_control"])
        binding = (
            f"overlay sha256 {manifest['scale_file']['sha256'][:16]} bound to base "
            f"{manifest['base']['fingerprint']['scheme']}="
            f"{manifest['base']['fingerprint']['sha256'][:16]}"
        )
    elif args.kv_scales is not None:
        binding = f"overlay pack {args.kv_scales} (bound in memory)"
    llm = LLM(
        model=str(model_dir),
        kv_cache_dtype="fp8_e4m3",
        kv_scales=args.kv_scales,
        device=args.device,
        num_blocks=VERIFY_BLOCKS,
        block_size=VERIFY_BLOCK_SIZE,
        max_model_len=VERIFY_BLOCKS * VERIFY_BLOCK_SIZE,
        max_num_batched_tokens=64,
    )
    if args.kv_scales is not None:  # LLM has run every binding check on the pack by now
        negative = bool(read_manifest(args.kv_scales)["negative_control"])
    if not llm.pool.scales_finalized:  # the gate must have run; never report a pass otherwise
        raise ScaleGateError(f"{model_dir}: K/V scales were not finalized by the gate")
    k = llm.pool.k_scales.cpu().tolist()
    v = llm.pool.v_scales.cpu().tolist()
    n = 2 * llm.spec.num_layers
    print(
        f"gate passed: loaded {n}/{n} K/V scales for {model_dir} ({binding}); "
        f"K {min(k):.4g}..{max(k):.4g}, V {min(v):.4g}..{max(v):.4g}; "
        f"{time.perf_counter() - start:.1f} s"
    )
    if negative:
        print("warning: this overlay is a unit-scale NEGATIVE CONTROL (all scales 1.0)")
    return 0
