"""The end-to-end decode targets, judged cell by cell, from `kvcap.bench.throughput` JSONs.

    python -m kvcap.bench.throughput_targets docs/benchmarks/throughput-2026-12-03i-h200-*.json

The targets (issue "gpu-engine-perf"): KV capacity with E4M3 >= 1.95x the unquantized cache's
at the same budget; E4M3 decode >= the unquantized cache's in every matched cell, and >= 1.3x at
context >= 16K with concurrency >= 16; the software decoder within 3% of the unquantized cache
(>= 0.97x); decode steps at >= 0.80 of their roofline at concurrency >= 16 and >= 10x the HF
transformers baseline's decode at 16 x 1K (targets of the Llama-3.1-8B shape only,
ROOFLINE_SHAPE). Every cell is reported, met or not. A ratio only compares arms of one file --
one run on one GPU -- since runs on different machines or days differ by a few percent (the HF
baseline too: the one in the same file); where several files hold the same comparison the
later file's is used (as in kvcap.bench.throughput_report). A cell that did not fit (or whose
unquantized counterpart did not) is listed as skipped with its reason, never counted as met;
a missing or NaN value is not met; a target no cell judges is reported missing. Roofline
fractions of files written before the benchmark recorded `roofline_kv_tokens` are restated
to the KV a timed decode step reads, those of files written before faf91da without the input
embedding table (which a step only gathers rows of), and those (and the HF ratio's decode
rates) of files written before cells recorded `steps_run_ahead` to the steps their decode clock
timed (roofline_fraction, decode_tok_s). The markdown goes to stdout; bad
input is one line on stderr (exit 2).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvcap.bench.throughput_report import (
    DEFAULT_SHAPE,
    ReportError,
    load_reports,
    measured,
    pool_tokens,
    print_report,
    report_cells,
    row_label,
)

CAPACITY_MIN = 1.95
E4M3_MIN = 1.0
E4M3_LONG_MIN = 1.3  # at context >= LONG_CONTEXT with concurrency >= WIDE_CONCURRENCY
SOFTWARE_MIN = 0.97  # within 3% of the unquantized cache
ROOFLINE_MIN = 0.80  # at concurrency >= WIDE_CONCURRENCY
HF_MIN = 10.0  # decode tok/s over HF transformers generate's, at HF_CELL, 8B shape
HF_CELL = (16, 1024)  # (concurrency, context)
LONG_CONTEXT = 16384
WIDE_CONCURRENCY = 16
ROOFLINE_SHAPE = "llama-3.1-8b"

T_CAPACITY = f"KV capacity E4M3 >= {CAPACITY_MIN}x"
T_E4M3 = "E4M3 >= unquantized decode"
T_LONG = f"E4M3 >= {E4M3_LONG_MIN}x at ctx >= 16K, c >= 16"
T_SOFTWARE = "software E4M3 within 3% of unquantized"
T_ROOFLINE = f"roofline >= {ROOFLINE_MIN:.2f} at c >= 16"
T_HF = f"decode >= {HF_MIN:.0f}x HF transformers at 16 x 1K"
NOT_JUDGED = ("greedy tokens identical between CUDA-graph and eager runs (a GPU test, not in "
              "these JSONs)")


@dataclass(frozen=True)
class Verdict:
    target: str
    cell: str  # "16 x 1K", "16 x 1K, E4M3 (native)" or "pool"
    value: float  # NaN where the file has no usable value: not met
    threshold: float
    source: str
    skip: str | None = None  # the cell (or the arm it is compared with) did not run: why
    note: str = ""

    @property
    def met(self) -> bool:
        # a skip is never a pass; NaN compares false
        return self.skip is None and self.value >= self.threshold


ARM_NAMES = {"fp16": "unquantized", "fp8": "E4M3 (native)", "fp8-software": "E4M3 (software)"}


def json_number(x: object) -> float:
    """A JSON number as a float; NaN for None, a bool, a string, a missing value or an
    infinite one (JSON's Infinity: an infinite rate's ratio, or an infinite roofline
    fraction, was judged met)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return math.nan
    x = float(x)
    return x if math.isfinite(x) else math.nan


def _ratio(a: object, b: object) -> float:
    """a / b, NaN unless both are numbers and b is positive and finite (a broken baseline
    judges nothing as met)."""
    a, b = json_number(a), json_number(b)
    return a / b if b > 0 and math.isfinite(b) else math.nan


# Commits of committed throughput runs made before the engine's overlap (10ba699, 2026-11-29):
# their decode steps ran one after another, so no step ran before the decode clock started.
SERIAL_ENGINE_COMMITS = frozenset({"c78f26f", "bcab3ad", "446a61a"})
# Commits of committed throughput runs made before faf91da (2026-12-01): their roofline counted
# every parameter, the untied input embedding table too (1.05 GB of the 8B shape's 16-bit
# weights), of which a decode step only gathers one row per token (throughput.weight_bytes).
WHOLE_EMBEDDING_COMMITS = frozenset({"c78f26f", "bcab3ad", "446a61a", "b195e08", "6b725da",
                                     "758ca81", "d2ca851"})
ROOFLINE_CONFIG = Path(__file__).parent / "configs" / "llama-3.1-8b.json"


@functools.cache  # read once, not per restated cell
def embedding_bytes() -> int:
    """Bytes of ROOFLINE_SHAPE's input embedding table in 16-bit weights (vocab x hidden)."""
    cfg = json.loads(ROOFLINE_CONFIG.read_text())
    return cfg["vocab_size"] * cfg["hidden_size"] * 2


@dataclass(frozen=True)
class RunInfo:
    """What a file records for restating its roofline fractions and for the HF target."""
    read_ceiling_tbs: float = math.nan
    out_tokens: int | None = None
    bytes_per_token: dict = field(default_factory=dict)  # (shape, kv) -> bytes
    hf_decode_tok_s: dict = field(default_factory=dict)  # (shape, batch, context) -> tok/s
    overlapped: bool = True  # the engine ran a step ahead (not SERIAL_ENGINE_COMMITS)
    whole_embedding: bool = False  # the roofline counted the input embedding table


def run_infos(reports: list[tuple[str, dict]]) -> dict[str, RunInfo]:
    out = {}
    for name, report in reports:
        args = report.get("args") if isinstance(report.get("args"), dict) else {}
        out_tokens = args.get("out_tokens")
        out[name] = RunInfo(
            json_number(report.get("read_ceiling_tbs")),
            out_tokens if isinstance(out_tokens, int) and not isinstance(out_tokens, bool)
            else None,
            {(c.get("shape"), c.get("kv")): c.get("bytes_per_token")
             for c in report.get("capacity") or [] if isinstance(c, dict)},
            {(h.get("shape"), h.get("batch"), h.get("context")): h.get("decode_tok_s")
             for h in report.get("hf_baseline") or [] if isinstance(h, dict)},
            report.get("commit") not in SERIAL_ENGINE_COMMITS,
            report.get("commit") in WHOLE_EMBEDDING_COMMITS)
    return out


def steps_ahead(cell: dict, info: RunInfo | None) -> int:
    """Steps a request had computed past its first token when the cell's decode clock
    started, which its recorded rate counted as timed: 0 where the cell records
    `steps_run_ahead` (its rate counts only what was timed) or the run's engine had no
    overlap; else 1 -- the overlapped engine (on CUDA since 10ba699) launched the step after
    the first token before reading it, and the sync that started the clock waited for it."""
    if "steps_run_ahead" in cell or info is None or not info.overlapped:
        return 0
    return 1 if info.out_tokens is not None and info.out_tokens > 2 else 0


def decode_tok_s(cell: dict, info: RunInfo | None) -> float:
    """The cell's decode tok/s over the steps its clock timed: a recorded rate that counted
    out_tokens - 1 steps a request over out_tokens - 2 steps' time (steps_ahead) is restated
    by (out_tokens - 2) / (out_tokens - 1) (1.6% at 64 output tokens, 0.4% at 256)."""
    tok_s = json_number(cell.get("decode_tok_s"))
    ahead = steps_ahead(cell, info)
    if not ahead:
        return tok_s
    counted = info.out_tokens - 1
    return tok_s * (counted - ahead) / counted


def roofline_fraction(cell: dict, info: RunInfo | None) -> tuple[float, str]:
    """(fraction, note): the cell's roofline fraction, restated for files written before the
    benchmark counted what a timed decode step reads and how many steps it timed.

    KV: files without `roofline_kv_tokens` counted `context` tokens a sequence, but the timed
    steps of a cell read context - out_tokens + 1 ... context - 1 (mean context - out_tokens
    / 2: kvcap.bench.throughput.kv_read_tokens), so their fractions read high by
    bytes_per_token * out_tokens / 2 * decode_tok_s / ceiling (0.003 at 16 x 16K E4M3,
    0.02-0.03 at 64 x 1K). Steps: files without `steps_run_ahead` divided the time of
    out_tokens - 2 steps by out_tokens - 1 (steps_ahead), so the step time read short and the
    fraction high by (out_tokens - 1) / (out_tokens - 2); the steps timed read the KV of
    context - out_tokens + 2 ... context - 1. Weights: files of WHOLE_EMBEDDING_COMMITS counted
    the untied input embedding table, which a step does not read in full, so their fractions
    read high by its bytes (embedding_bytes) * decode_tok_s / concurrency / ceiling (0.04 at
    16 x 1K, 0.02 at 16 x 16K). Only for the 8B shape (no sliding layers); the recorded value
    stays where the file lacks what restating needs."""
    frac = json_number(cell.get("roofline_fraction"))
    ahead = steps_ahead(cell, info)
    whole_embedding = info is not None and info.whole_embedding
    if (("roofline_kv_tokens" in cell and not ahead and not whole_embedding) or info is None
            or not math.isfinite(frac)):
        return frac, ""
    bpt = json_number(info.bytes_per_token.get((cell["shape"], cell["kv"])))
    ceiling, out = info.read_ceiling_tbs, info.out_tokens
    tok_s = json_number(cell.get("decode_tok_s"))
    if (cell["shape"] != ROOFLINE_SHAPE or out is None or out < 2 or not bpt > 0
            or not ceiling > 0 or not tok_s > 0):
        return frac, ""
    counted = out - 1
    timed = counted - ahead
    kv_used = json_number(cell.get("roofline_kv_tokens", cell["context"]))
    kv_timed = cell["context"] - (timed + 1) / 2  # the mean of the steps timed
    if not math.isfinite(kv_used):
        return frac, ""
    emb = embedding_bytes() / cell["concurrency"] if whole_embedding else 0.0
    restated = ((frac + (bpt * (kv_timed - kv_used) - emb) * tok_s / (ceiling * 1e12))
                * timed / counted)
    what = (["the input embedding table"] if whole_embedding else []) + (
        [] if "roofline_kv_tokens" in cell else ["`context` KV tokens a step"]) + (
        [f"{counted} steps over {timed} steps' time"] if ahead else [])
    return restated, f"recorded {frac:.3f} counting {' and '.join(what)}"


def judge(cells: list[dict], shape: str = DEFAULT_SHAPE,
          capacity: list[tuple[str, float]] = (),
          infos: dict[str, RunInfo] | None = None) -> list[Verdict]:
    """Every target on every cell of `shape` that can be judged, in target order, cells by
    context then concurrency; a later file's verdict on the same cell replaces an earlier one
    (a measured one is never replaced by a skip). A cell that did not run (or whose
    counterpart arm did not) is a skip verdict with the reason, never met and never a miss.
    `capacity`: (source, E4M3 / unquantized pool tokens) per file (capacity_ratios);
    `infos`: run_infos of the files (roofline restating and the HF baseline)."""
    infos = infos or {}
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
            threshold: float, source: str, skip: str | None = None, note: str = "") -> None:
        old = found.get((target, label))
        if skip is not None and old is not None and old[1].skip is None:
            return
        found[(target, label)] = ((rank, ctx, conc, label),
                                  Verdict(target, label, value, threshold, source, skip, note))

    def skip_reason(kv: str, cell: dict | None) -> str | None:
        if cell is None or measured(cell):
            return None
        return f"{ARM_NAMES.get(kv, kv)}: {cell['skip']}"

    ratio_targets = {"fp8": [(1, T_E4M3, E4M3_MIN, lambda conc, ctx: True),
                             (2, T_LONG, E4M3_LONG_MIN,
                              lambda conc, ctx: ctx >= LONG_CONTEXT and conc >= WIDE_CONCURRENCY)],
                     "fp8-software": [(3, T_SOFTWARE, SOFTWARE_MIN, lambda conc, ctx: True)]}
    for source, sel in by_file.items():
        info = infos.get(source)
        arms = {kv for kv, _, _ in sel}
        # A cell one of whose arms the file lacks while it ran that arm at other cells (a run
        # cut off between its arms) is a skip naming the missing arm: it was left out of
        # every verdict, neither met nor listed.
        for conc, ctx in dict.fromkeys((c, x) for _, c, x in sel):
            for kv in sorted(ratio_targets.keys() & arms) if "fp16" in arms else []:
                pair = {"fp16": sel.get(("fp16", conc, ctx)), kv: sel.get((kv, conc, ctx))}
                missing = [arm for arm, cell in pair.items() if cell is None]
                if len(missing) == 1:
                    why = (f"{ARM_NAMES.get(missing[0], missing[0])}: not in this file (the "
                           "run stopped before it?)")
                    for rank, target, threshold, applies in ratio_targets[kv]:
                        if applies(conc, ctx):
                            add(rank, target, conc, ctx, row_label(conc, ctx), math.nan,
                                threshold, source, why)
        for (kv, conc, ctx), cell in sel.items():
            label = row_label(conc, ctx)
            base = sel.get(("fp16", conc, ctx))
            # a matched cell: both arms of one file measured; one that did not run is a skip
            if kv in ratio_targets and base is not None:
                skip = skip_reason(kv, cell) or skip_reason("fp16", base)
                ratio = math.nan if skip else _ratio(cell["decode_tok_s"], base["decode_tok_s"])
                for rank, target, threshold, applies in ratio_targets[kv]:
                    if applies(conc, ctx):
                        add(rank, target, conc, ctx, label, ratio, threshold, source, skip)
            if shape == ROOFLINE_SHAPE and conc >= WIDE_CONCURRENCY:
                arm = f"{label}, {ARM_NAMES.get(kv, kv)}"
                if measured(cell):  # a missing or NaN fraction is not met
                    frac, note = roofline_fraction(cell, info)
                    add(4, T_ROOFLINE, conc, ctx, arm, frac, ROOFLINE_MIN, source, note=note)
                else:
                    add(4, T_ROOFLINE, conc, ctx, arm, math.nan, ROOFLINE_MIN, source,
                        skip=cell["skip"])
            hf_key = (shape, conc, ctx)
            if (shape == ROOFLINE_SHAPE and (conc, ctx) == HF_CELL and info is not None
                    and hf_key in info.hf_decode_tok_s):  # the baseline of the same run only
                arm = f"{label}, {ARM_NAMES.get(kv, kv)}"
                hf = info.hf_decode_tok_s[hf_key]
                add(5, T_HF, conc, ctx, arm,
                    _ratio(decode_tok_s(cell, info), hf) if measured(cell) else math.nan,
                    HF_MIN, source, skip=None if measured(cell) else cell["skip"])
    for source, ratio in capacity:
        add(0, T_CAPACITY, 0, 0, "pool", ratio, CAPACITY_MIN, source)
    return [verdict for _, verdict in sorted(found.values(), key=lambda kv: kv[0])]


def targets_for(shape: str) -> list[str]:
    """The issue's targets that `shape` is judged on (roofline and HF: the 8B shape only)."""
    return [T_CAPACITY, T_E4M3, T_LONG, T_SOFTWARE] + (
        [T_ROOFLINE, T_HF] if shape == ROOFLINE_SHAPE else [])


def judge_reports(reports: list[tuple[str, dict]], shape: str = DEFAULT_SHAPE) -> list[Verdict]:
    """judge() over load_reports' (file name, report) pairs, every input validated first."""
    cells = report_cells(reports)
    return judge(cells, shape, capacity_ratios(reports, shape), run_infos(reports))


def capacity_ratios(reports: list[tuple[str, dict]], shape: str) -> list[tuple[str, float]]:
    """(file name, E4M3 / unquantized pool tokens) for each report (load_reports) whose run
    sized both pools of `shape` at one memory budget."""
    out = []
    for name, report in reports:
        pools = pool_tokens(report)
        fp16, fp8 = pools.get((shape, "fp16")), pools.get((shape, "fp8"))
        if (isinstance(fp16, int) and isinstance(fp8, int) and not isinstance(fp16, bool)
                and not isinstance(fp8, bool) and fp16 > 0):
            out.append((name, fp8 / fp16))
    return out


def markdown(verdicts: list[Verdict], shape: str | None = None) -> str:
    """One row per judged cell, then one summary line per target: met / judged, the cells
    not met, the cells skipped (never counted as met), and each of `shape`'s targets that no
    cell of the files could judge (missing, not met)."""
    lines = ["| target | cell | measured | met | source |", "| --- | --- | --- | --- | --- |"]
    for v in verdicts:
        if v.skip is not None:
            value, met = "-", f"skipped: {v.skip}"
        elif math.isnan(v.value):
            value, met = "missing", "**no**"
        else:
            value = f"{v.value:.3f}" + ("" if v.target == T_ROOFLINE else "x")
            met = "yes" if v.met else "**no**"
        if v.note:
            value += f" ({v.note})"
        lines.append(f"| {v.target} | {v.cell} | {value} | {met} | `{v.source}` |")
    lines.append("")
    targets = list(dict.fromkeys([v.target for v in verdicts]
                                 + (targets_for(shape) if shape else [])))
    order = {t: i for i, t in enumerate(targets_for(ROOFLINE_SHAPE))}
    for target in sorted(targets, key=lambda t: order.get(t, len(order))):
        mine = [v for v in verdicts if v.target == target and v.skip is None]
        skipped = [v for v in verdicts if v.target == target and v.skip is not None]
        if not mine:
            lines.append(f"- {target}: missing: no cell of these files judges it"
                         + (f"; skipped: {'; '.join(f'{v.cell} ({v.skip})' for v in skipped)}"
                            if skipped else ""))
            continue
        met = sum(v.met for v in mine)
        lines.append(f"- {target}: met in {met} of {len(mine)} cell(s)"
                     + ("" if met == len(mine) else
                        f"; not met: {'; '.join(v.cell for v in mine if not v.met)}")
                     + (f"; skipped (not judged): {'; '.join(v.cell for v in skipped)}"
                        if skipped else ""))
    if shape:
        lines.append(f"- not judged here: {NOT_JUDGED}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    # (`kvcap bench` puts the suite's name in sys.argv[0]; under `python -m` it is a path)
    ap = argparse.ArgumentParser(prog=sys.argv[0] if sys.argv[0].startswith("kvcap bench")
                                 else "python -m kvcap.bench.throughput_targets",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", metavar="FILE.json", help="kvcap.bench.throughput JSONs")
    ap.add_argument("--shape", default=DEFAULT_SHAPE, help=f"default {DEFAULT_SHAPE}")
    args = ap.parse_args(argv)
    try:
        reports = load_reports(args.files)
        # every file's cells are validated here, before any verdict
        verdicts = judge_reports(reports, args.shape)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_report(markdown(verdicts, args.shape))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
