"""`kvcap materialize`: base checkpoint + overlay pack -> derived checkpoint directory."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "build a derived checkpoint (symlinks to the base + scale file + merged index)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="base checkpoint: 'default' or an HF-format directory"
    )
    p.add_argument("--overlay", required=True, type=Path, help="overlay pack directory")
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="derived directory (must not exist, must not lie inside the base)",
    )


def run(args: argparse.Namespace) -> int:
    from kvcap.commands.common import refuse_dummy
    from kvcap.models.loader import resolve_model_dir
    from kvcap.scales.materialize import materialize

    refuse_dummy(args.model, "materialize")
    base = resolve_model_dir(args.model)
    out = materialize(base, args.overlay, args.out)
    print(f"materialized {out} from base {base} and overlay {args.overlay}")
    return 0
