"""Summarise Nsight Compute reports of the decode kernels as JSON: per profiled kernel the
headline metrics of `ncu --page details` and, from `ncu --page source --print-source sass
--csv`, the warp-stall samples by reason and the instructions that collect the most.

    python scripts/ncu_summary.py ncu-details.txt ncu-sass.csv --labels a,b,... --out x.json

`--labels` names the kernels in report order (scripts/ncu_decode.py launches each arm's decode
kernel, then its merge kernel when it splits).
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import re
import sys

METRICS = ["Duration", "DRAM Throughput", "Memory Throughput", "Elapsed Cycles",
           "SM Active Cycles", "SM Frequency", "Issue Slots Busy", "Executed Ipc Active",
           "Warp Cycles Per Issued Instruction", "Eligible Warps Per Scheduler",
           "Registers Per Thread", "Dynamic Shared Memory Per Block",
           "Achieved Active Warps Per SM", "Theoretical Occupancy", "Executed Instructions",
           "Grid Size"]
HEADER = re.compile(r"^  (\w+) \(([\d, ]+)\)x\(([\d, ]+)\)")


def parse_details(text: str) -> list[dict]:
    """Kernels in report order: name, grid, block and METRICS as (unit, value)."""
    kernels = []
    for line in text.splitlines():
        m = HEADER.match(line)
        if m:
            kernels.append({"kernel": m[1], "grid": m[2], "block": m[3], "metrics": {}})
            continue
        if not kernels:
            continue
        parts = re.split(r"\s{2,}", line.strip())
        if len(parts) >= 2 and parts[0] in METRICS and parts[0] not in kernels[-1]["metrics"]:
            value = parts[-1].replace(",", "")
            unit = parts[1] if len(parts) == 3 else ""
            try:
                kernels[-1]["metrics"][parts[0]] = {"unit": unit, "value": float(value)}
            except ValueError:
                pass
    return kernels


def parse_sass(path: str, top: int = 8) -> list[dict]:
    """Per kernel in report order: stall samples by reason and the `top` SASS instructions
    with the most samples."""
    out, rows, header = [], None, None
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if r and r[0] == "Kernel Name":
                rows = []
                out.append({"kernel": r[1], "rows": rows})
            elif r and r[0] == "Address":  # each kernel has its own columns
                header = out[-1]["header"] = {n: i for i, n in enumerate(r)}
            elif rows is not None and r and header:
                rows.append(r)
    result = []
    for k in out:
        header = k["header"]
        reasons = collections.Counter()
        samples = []
        for r in k["rows"]:
            for name, i in header.items():
                if name.startswith("stall_") and "Not Issued" not in name and r[i].isdigit():
                    reasons[name[6:]] += int(r[i])
            n = r[header["Warp Stall Sampling (All Samples)"]]
            if n.isdigit():
                samples.append((int(n), r[header["Source"]].strip()))
        total = sum(reasons.values()) or 1
        result.append({"kernel": k["kernel"], "samples": sum(n for n, _ in samples),
                       "stall_share": {a: round(b / total, 4) for a, b in reasons.most_common()},
                       "top_instructions": [{"samples": n, "sass": s}
                                            for n, s in sorted(samples, reverse=True)[:top]]})
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("details")
    ap.add_argument("sass", nargs="?")
    ap.add_argument("--labels", default="")
    ap.add_argument("--meta", default="{}", help="JSON object stored as the file's info")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    kernels = parse_details(open(args.details).read())
    if args.sass:
        for k, s in zip(kernels, parse_sass(args.sass), strict=True):
            if k["kernel"] != s["kernel"]:
                sys.exit(f"{args.sass}: kernel order differs from {args.details}")
            k.update({key: s[key] for key in ("samples", "stall_share", "top_instructions")})
    labels = [x for x in args.labels.split(",") if x]
    for k, label in zip(kernels, labels, strict=False):  # labels may be fewer
        k["label"] = label
    with open(args.out, "w") as f:
        json.dump({"info": json.loads(args.meta), "kernels": kernels}, f, indent=1)
    print(f"wrote {args.out}: {len(kernels)} kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
