"""The end-to-end decode targets, judged cell by cell, from `kvcap.bench.throughput` JSONs.

    python -m kvcap.bench.throughput_targets docs/benchmarks/throughput-2026-12-03i-h200-*.json

The targets (issue "gpu-engine-perf"): KV capacity with E4M3 >= 1.95x the unquantized cache's
at the same budget; E4M3 decode >= the unquantized cache's in every matched cell, and >= 1.3x at
context >= 16K with concurrency >= 16; the software decoder within 3% of the unquantized cache;
decode steps at >= 0.80 of their roofline at concurrency >= 16 (a target of the Llama-3.1-8B
shape only, ROOFLINE_SHAPE). Every cell is reported, met or not. A ratio only compares arms of
one file -- one run on one GPU -- since runs on different machines or days differ by a few
percent; where several files hold the same comparison the later file's is used (as in
kvcap.bench.throughput_report). Cells that did not fit are not judged (the capacity target
covers them). The markdown goes to stdout; bad input is one line on stderr (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from kvcap.bench.throughput_report import (
    DEFAULT_SHAPE,
    ReportError,
    load_reports,
    measured,
    pool_tokens,
    report_cells,
    row_label,
)

CAPACITY_MIN = 1.95
E4M3_MIN = 1.0
E4M3_LONG_MIN = 1.3  # at context >= LONG_CONTEXT with concurrency >= WIDE_CONCURRENCY
SOFTWARE_MIN = 0.97  # within 3% of the unquantized cache
ROOFLINE_MIN = 0.80  # at concurrency >= WIDE_CONCURRENCY
LONG_CONTEXT = 16384
WIDE_CONCURRENCY = 16
ROOFLINE_SHAPE = "llama-3.1-8b"


@dataclass(frozen=True)
class Verdict:
    target: str
    cell: str  # "16 x 1K", "16 x 1K, E4M3 (native)" or "pool"
    value: float
    threshold: float
    source: str

    @property
    def met(self) -> bool:
        return self.value >= self.threshold


ARM_NAMES = {"fp16": "unquantized", "fp8": "E4M3 (native)", "fp8-software": "E4M3 (software)"}


def judge(cells: list[dict], shape: str = DEFAULT_SHAPE,
          capacity: list[tuple[str, float]] = ()) -> list[Verdict]:
    """Every target on every cell of `shape` that can be judged, in target order, cells by
    context then concurrency; a later file's verdict on the same cell replaces an earlier one.
    `capacity`: (source, E4M3 / unquantized pool tokens) per file (capacity_ratios)."""
    mine = [c for c in cells if c["shape"] == shape]
    if not mine:
        shapes = sorted({c["shape"] for c in cells})
        raise ReportError(f"no cells for shape {shape!r} (the files hold: "
                          f"{', '.join(shapes) or 'no cells'})")
    dtypes = sorted({c["dtype"] for c in mine})
    if len(dtypes) > 1:
        raise ReportError(f"the files mix model dtypes ({', '.join(dtypes)}) for {shape}: judge "
                          "one dtype at a time")
    by_file: dict[str, dict[tuple[str, int, int], dict]] = {}
    for c in mine:
        by_file.setdefault(c["source"], {})[(c["kv"], c["concurrency"], c["context"])] = c
    # (target, cell) -> (sort key, verdict); a later file's verdict replaces an earlier one
    found: dict[tuple[str, str], tuple[tuple, Verdict]] = {}

    def add(rank: int, target: str, conc: int, ctx: int, label: str, value: float,
            threshold: float, source: str) -> None:
        found[(target, label)] = ((rank, ctx, conc, label),
                                  Verdict(target, label, value, threshold, source))

    for source, sel in by_file.items():
        for (kv, conc, ctx), cell in sel.items():
            if not measured(cell):
                continue
            label = row_label(conc, ctx)
            base = sel.get(("fp16", conc, ctx))
            if kv != "fp16" and measured(base):
                ratio = cell["decode_tok_s"] / base["decode_tok_s"]
                if kv == "fp8":
                    add(1, "E4M3 >= unquantized decode", conc, ctx, label, ratio, E4M3_MIN,
                        source)
                    if ctx >= LONG_CONTEXT and conc >= WIDE_CONCURRENCY:
                        add(2, f"E4M3 >= {E4M3_LONG_MIN}x at ctx >= 16K, c >= 16", conc, ctx,
                            label, ratio, E4M3_LONG_MIN, source)
                elif kv == "fp8-software":
                    add(3, "software E4M3 within 3% of unquantized", conc, ctx, label, ratio,
                        SOFTWARE_MIN, source)
            frac = cell.get("roofline_fraction")
            if (shape == ROOFLINE_SHAPE and conc >= WIDE_CONCURRENCY
                    and isinstance(frac, (int, float))):
                add(4, f"roofline >= {ROOFLINE_MIN:.2f} at c >= 16", conc, ctx,
                    f"{label}, {ARM_NAMES.get(kv, kv)}", frac, ROOFLINE_MIN, source)
    for source, ratio in capacity:
        add(0, f"KV capacity E4M3 >= {CAPACITY_MIN}x", 0, 0, "pool", ratio, CAPACITY_MIN,
            source)
    return [verdict for _, verdict in sorted(found.values(), key=lambda kv: kv[0])]


def capacity_ratios(reports: list[tuple[str, dict]], shape: str) -> list[tuple[str, float]]:
    """(file name, E4M3 / unquantized pool tokens) for each report (load_reports) whose run
    sized both pools of `shape` at one memory budget."""
    out = []
    for name, report in reports:
        pools = pool_tokens(report)
        fp16, fp8 = pools.get((shape, "fp16")), pools.get((shape, "fp8"))
        if isinstance(fp16, int) and isinstance(fp8, int) and fp16 > 0:
            out.append((name, fp8 / fp16))
    return out


def markdown(verdicts: list[Verdict]) -> str:
    """One row per judged cell, then one summary line per target."""
    lines = ["| target | cell | measured | met | source |", "| --- | --- | --- | --- | --- |"]
    for v in verdicts:
        value = f"{v.value:.3f}" + ("" if "roofline" in v.target else "x")
        lines.append(f"| {v.target} | {v.cell} | {value} | {'yes' if v.met else '**no**'} | "
                     f"`{v.source}` |")
    lines.append("")
    for target in dict.fromkeys(v.target for v in verdicts):
        mine = [v for v in verdicts if v.target == target]
        met = sum(v.met for v in mine)
        lines.append(f"- {target}: met in {met} of {len(mine)} cell(s)"
                     + ("" if met == len(mine) else
                        f"; not met: {'; '.join(v.cell for v in mine if not v.met)}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcap.bench.throughput_targets",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", metavar="FILE.json", help="kvcap.bench.throughput JSONs")
    ap.add_argument("--shape", default=DEFAULT_SHAPE, help=f"default {DEFAULT_SHAPE}")
    args = ap.parse_args(argv)
    try:
        reports = load_reports(args.files)
        # every file's cells are validated here, before any verdict
        cells = report_cells(reports)
        verdicts = judge(cells, args.shape, capacity_ratios(reports, args.shape))
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(verdicts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
