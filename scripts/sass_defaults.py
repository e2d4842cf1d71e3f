"""Compile every default decode launch for one NVIDIA target and print what ptxas made of it:
registers, spilled bytes, and the tile loop's SASS instructions, loads and spills. No GPU needed.

The H200 runs triton 3.6 while CI runs a newer Triton, and the two compile the same kernel very
differently (docs/kernels.md, "Twenty-eighth change"), so count a kernel change under the
GPU's Triton before spending device time on it:

    pip install --no-deps --target DIR triton==3.6.0
    PYTHONPATH=DIR python scripts/sass_defaults.py [--sm 90] [--json FILE]

Run it in two trees (or before and after a change) and compare the tables.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSPECT = ROOT / "scripts" / "inspect_decode_ptx.py"

# (route, head_dim, caches, extra inspect_decode_ptx flags): the launches decode_config picks
# on a tensor-core GPU for BF16 queries (the engine's dtype where the GPU has BF16).
ROUTES = [
    ("16-bit", 64, ["fp16"], []),
    ("16-bit", 128, ["fp16"], []),
    ("16-bit", 256, ["fp16"], []),
    ("E4M3 bytes", 64, ["native", "software"], []),
    ("E4M3 short bytes", 128, ["native", "software"], ["--short"]),
    ("E4M3 words", 128, ["native", "software"], ["--words"]),
    ("E4M3 words", 256, ["native", "software"], ["--words"]),
]
COLUMNS = ["registers", "spill store bytes", "shared memory bytes", "sass loop instructions",
           "sass LDL", "sass STL", "sass LDS", "sass IMAD"]
HEADERS = ["regs", "spill B", "smem B", "loop instr", "LDL", "STL", "LDS", "IMAD"]


def counts(sm: int, head_dim: int, cache: str, extra: list[str]) -> dict[str, int]:
    cmd = [sys.executable, str(INSPECT), "--cache", cache, "--head-dim", str(head_dim),
           "--sm", str(sm), "--defaults", "--dtype", "bf16", "--sass", *extra]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[1:])} failed:\n{run.stderr[-2000:]}")
    return {m[1]: int(m[2]) for m in re.finditer(r"^\s+(\S+(?: \S+)*?)\s+(-?\d+)$", run.stdout,
                                                 re.MULTILINE)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sm", type=int, default=90, help="compute capability, e.g. 80, 86, 90")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    import triton

    print(f"triton {triton.__version__}, sm_{args.sm}, BF16 queries, default launches")
    print(f"{'route':<17} {'D':>4} {'cache':<9} " + " ".join(f"{h:>10}" for h in HEADERS))
    rows = []
    for route, head_dim, caches, extra in ROUTES:
        for cache in caches:
            c = counts(args.sm, head_dim, cache, extra)
            rows.append({"route": route, "head_dim": head_dim, "cache": cache,
                         **{k: c.get(k) for k in COLUMNS}})
            print(f"{route:<17} {head_dim:>4} {cache:<9} "
                  + " ".join(f"{c.get(k, '-'):>10}" for k in COLUMNS))
    if args.json:
        from kvcap.bench.provenance import stamp
        from kvcap.scales.fsutil import atomic_write_text

        atomic_write_text(args.json, json.dumps({"triton": triton.__version__, "sm": args.sm,
                                                 **stamp(), "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
