"""The throughput matrix as a README table and a PNG, from `kvcap.bench.throughput` JSONs.

    python -m kvcap.bench.throughput_report docs/benchmarks/throughput-2026-11-29c-h200-1k.json \
        docs/benchmarks/throughput-2026-11-29c-h200-16k.json \
        --png docs/benchmarks/throughput-2026-11-29c-h200.png

Several files may cover different contexts (or concurrencies); every cell keeps the file, GPU,
date, commit and model dtype it came from. Where two files hold the same cell, the later file's
wins (but a skip never replaces a measurement); files of different model dtypes (`--dtype` of
the benchmark: the unquantized arm's KV is in that dtype) are never merged into one table. The
markdown table goes to stdout; errors are one line on stderr (exit 2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from kvcap.scales.fsutil import atomic_write_png

DEFAULT_SHAPE = "llama-3.1-8b"
CROSS_RUN = "\u2020"  # a ratio between cells of two files (runs): a footnote says so
# (kv mode in the JSON, column title, bar colour); the "fp16" arm's KV is in the model dtype
KV_COLUMNS = (("fp16", "FP16 KV", "#4c72b0"), ("fp8", "E4M3 (native)", "#dd8452"),
              ("fp8-software", "E4M3 (software)", "#55a868"))
DTYPE_NAMES = {"float16": "FP16", "bfloat16": "BF16"}
_SKIP_BLOCKS = re.compile(r"needs (\d+) KV blocks, pool has (\d+)")


class ReportError(ValueError):
    """An input that is not a usable throughput JSON, or a selection with no cells."""


def print_report(text: str) -> None:
    """Print `text` to stdout and flush; a reader that left (`... | head`) ends the output
    quietly, as kernels --summary does (was a BrokenPipeError traceback): stdout then goes
    to /dev/null so the interpreter's exit flush is quiet too."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # (a stdout with no file descriptor)
            pass


def cells_from_report(report: object, source: str) -> list[dict]:
    """The cells of one throughput report (already parsed), each with its provenance (source,
    gpu, date, commit) and, for a cell that did not fit, `pool_tokens` where it can be known
    (the run's capacity record, else the block counts in its skip reason)."""
    if not isinstance(report, dict) or not isinstance(report.get("cells"), list):
        raise ReportError(f"{source}: no 'cells' list (not a kvcap.bench.throughput JSON)")
    _check_run_fields(report, source)
    capacity = pool_tokens(report)
    cells = []
    for i, raw in enumerate(report["cells"]):
        if not isinstance(raw, dict):
            raise ReportError(f"{source}: cell {i} is not an object")
        for key in ("shape", "kv", "concurrency", "context"):
            if key not in raw:
                raise ReportError(f"{source}: cell {i} has no {key!r}")
        if not all(isinstance(raw[k], str) for k in ("shape", "kv")):
            raise ReportError(f"{source}: cell {i}: shape and kv must be strings")
        if not all(isinstance(raw[k], int) and raw[k] > 0 for k in ("concurrency", "context")):
            raise ReportError(f"{source}: cell {i}: concurrency and context must be positive "
                              "integers")
        if "skip" not in raw and not _is_number(raw.get("decode_tok_s")):
            raise ReportError(f"{source}: cell {i} has neither 'decode_tok_s' nor 'skip'")
        if raw.get("roofline_fraction") is not None and not _is_number(raw["roofline_fraction"]):
            raise ReportError(f"{source}: cell {i}: roofline_fraction is not a number")
        cell = dict(raw)
        cell.update(source=source, gpu=report.get("gpu", "unknown GPU"),
                    date=report.get("date", "unknown date"),
                    commit=report.get("commit", "unknown"),
                    # runs before the benchmark's --dtype all used FP16 weights
                    dtype=(report.get("args") or {}).get("dtype", "float16"))
        if "skip" in cell and not _is_count(cell.get("pool_tokens")):
            pool = capacity.get((cell["shape"], cell["kv"]))
            cell["pool_tokens"] = ((pool if _is_count(pool) else None)
                                   or _pool_tokens_from_skip(cell))
        cells.append(cell)
    return cells


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_run_fields(report: dict, source: str) -> None:
    """The run's fields that the tables and the judges (kvcap.bench.throughput_targets) read,
    where present, of the types the benchmark writes: one ReportError naming the file, not an
    AttributeError or TypeError from inside them, for another program's JSON."""
    args = report.get("args")
    if args is not None and not isinstance(args, dict):
        raise ReportError(f"{source}: 'args' is not an object")
    if not isinstance((args or {}).get("dtype", ""), str):
        raise ReportError(f"{source}: args.dtype is not a string")
    if not isinstance(report.get("commit", ""), str):
        raise ReportError(f"{source}: 'commit' is not a string")
    for key, fields in (("capacity", ("shape", "kv", "tokens", "bytes_per_token")),
                        ("hf_baseline", ("shape", "batch", "context"))):
        records = report.get(key)
        if records is None:
            continue
        if not isinstance(records, list) or not all(
                isinstance(r.get(f), (str, int, float, type(None)))
                for r in records if isinstance(r, dict) for f in fields):
            raise ReportError(f"{source}: {key!r} is not a list of records whose "
                              f"{', '.join(fields)} are strings or numbers")


def _pool_tokens_from_skip(cell: dict) -> int | None:
    """Pool tokens from "needs N KV blocks, pool has M": the block size is what turns
    `context` tokens into N / concurrency blocks."""
    m = _SKIP_BLOCKS.search(str(cell.get("skip", "")))
    if not m:
        return None
    per_seq = int(m.group(1)) // cell["concurrency"]
    if per_seq <= 0:
        return None
    return int(m.group(2)) * math.ceil(cell["context"] / per_seq)


def pool_tokens(report: dict) -> dict[tuple[str, str], object]:
    """{(shape, kv): pool tokens} from a report's `capacity` records (one memory budget)."""
    return {(c.get("shape"), c.get("kv")): c.get("tokens")
            for c in report.get("capacity") or [] if isinstance(c, dict)}


def load_reports(paths: Iterable[str | Path]) -> list[tuple[str, dict]]:
    """(file name, parsed report) per path, in order: a file that cannot be read or parsed is
    one ReportError naming it (cells_from_report validates the cells)."""
    reports = []
    paths = [Path(p) for p in paths]
    # A file is named by its base name, unless another file of the list has the same one
    # (throughput-DATE.json of two machines, in two directories): then by its path as given.
    # Cells are grouped into runs by that name, so two runs of one base name were taken for
    # one -- a ratio across them judged by throughput_targets and left unmarked in the table.
    shared = {n for n in {path.name for path in paths}
              if len({str(path) for path in paths if path.name == n}) > 1}
    for path in paths:
        try:
            text = path.read_text()
        except OSError as e:
            raise ReportError(f"cannot read {path}: {e.strerror or e}") from None
        try:
            report = json.loads(text)
        except ValueError as e:
            raise ReportError(f"{path} is not valid JSON ({e})") from None
        reports.append((str(path) if path.name in shared else path.name, report))
    return reports


def report_cells(reports: Iterable[tuple[str, dict]]) -> list[dict]:
    """The cells of (file name, report) pairs (load_reports), in order (cells_from_report)."""
    return [cell for name, report in reports for cell in cells_from_report(report, name)]


def load_cells(paths: Iterable[str | Path]) -> list[dict]:
    """The cells of one or more throughput JSONs, in file order (see cells_from_report)."""
    return report_cells(load_reports(paths))


def _select(cells: list[dict], shape: str) -> dict[tuple[str, int, int], dict]:
    """(kv, concurrency, context) -> cell for one shape; a later cell replaces an earlier one,
    except that a skip never replaces a measurement (as in throughput_targets.judge and kernels
    --summary: a later run whose pool could not fit the cell made the table read "does not
    fit" for a cell that the judges, from the same files, reported measured)."""
    out: dict[tuple[str, int, int], dict] = {}
    for c in cells:
        if c["shape"] == shape:
            key = (c["kv"], c["concurrency"], c["context"])
            if not measured(c) and measured(out.get(key)):
                continue
            out[key] = c
    if not out:
        shapes = sorted({c["shape"] for c in cells})
        raise ReportError(f"no cells for shape {shape!r} (the files hold: "
                          f"{', '.join(shapes) or 'no cells'})")
    dtypes = sorted({c["dtype"] for c in out.values()})
    if len(dtypes) > 1:
        raise ReportError(f"the files mix model dtypes ({', '.join(dtypes)}) for {shape}: make "
                          "one table per dtype")
    return out


def _unquantized(sel: dict[tuple[str, int, int], dict]) -> str:
    """FP16 or BF16: the dtype of the unquantized arm's KV cache (the model's)."""
    dtype = next(iter(sel.values()))["dtype"]
    return DTYPE_NAMES.get(dtype, dtype)


def _weights(sel: dict[tuple[str, int, int], dict]) -> str:
    """The weights' format: FP8 where the run kept an FP8 checkpoint's linears in FP8
    (`fp8_weights` in its cells), else the model dtype."""
    return "FP8" if any(c.get("fp8_weights") for c in sel.values()) else _unquantized(sel)


def _columns(sel: dict[tuple[str, int, int], dict]) -> list[tuple[str, str, str]]:
    kv16 = _unquantized(sel)
    return [(kv, f"{kv16} KV" if kv == "fp16" else title, colour)
            for kv, title, colour in KV_COLUMNS]


def _rows(sel: dict[tuple[str, int, int], dict]) -> list[tuple[int, int]]:
    """(concurrency, context) pairs, sorted by context, then concurrency."""
    return sorted({(conc, ctx) for _, conc, ctx in sel}, key=lambda r: (r[1], r[0]))


def _pool(n: int) -> str:
    """879472 -> 879K, 1758224 -> 1.76M."""
    if n >= 1_000_000:
        return f"{n / 1e6:.2f}M"
    return f"{round(n / 1000)}K" if n >= 10_000 else f"{n:,}"


def row_label(conc: int, ctx: int) -> str:
    """16 x 1K for 16 x 1024 tokens (contexts count in KiB as the README does)."""
    return f"{conc} x {f'{ctx // 1024}K' if ctx % 1024 == 0 else ctx}"


def measured(cell: dict | None) -> bool:
    return cell is not None and "skip" not in cell


def _skip_text(cell: dict) -> str:
    if _SKIP_BLOCKS.search(str(cell["skip"])):
        pool = cell.get("pool_tokens")
        return f"does not fit ({_pool(pool)}-token pool)" if pool else "does not fit"
    return f"skipped: {cell['skip']}"


def _cell_text(cell: dict | None, fp16: dict | None, ratio: bool, kv16: str = "FP16") -> str:
    if cell is None:
        return "not run"
    if not measured(cell):
        return _skip_text(cell)
    text = f"{cell['decode_tok_s']:,.0f}"
    if ratio and measured(fp16):
        cross = cell["source"] != fp16["source"]  # two runs: marked, see markdown_table
        base = fp16["decode_tok_s"]  # (no ratio to a rate of 0: nan, as to a NaN one)
        value = cell["decode_tok_s"] / base if base else math.nan
        text += f" ({value:.2f}x{CROSS_RUN if cross else ''})"
    elif ratio and (cell.get("fits_only_in_e4m3") or fp16 is not None):
        text += f" ({kv16} does not fit)"
    return text


def _each(cells: Iterable[dict], fmt: str) -> str:
    """`fmt` filled from each cell, distinct values in first-seen order, comma-joined."""
    return ", ".join(dict.fromkeys(fmt.format(**c) for c in cells))


def markdown_table(cells: list[dict], shape: str = DEFAULT_SHAPE) -> str:
    """Decode tok/s per (concurrency x context), one column per KV mode; E4M3 columns carry
    the ratio to FP16 in parentheses. The last line names the source files and commits."""
    sel = _select(cells, shape)
    kv16, columns = _unquantized(sel), _columns(sel)
    lines = ["| concurrency x context | " + " | ".join(t for _, t, _ in columns) + " |",
             "| --- |" + " --- |" * len(columns)]
    for conc, ctx in _rows(sel):
        fp16 = sel.get(("fp16", conc, ctx))
        texts = [_cell_text(sel.get((kv, conc, ctx)), fp16, ratio=kv != "fp16", kv16=kv16)
                 for kv, _, _ in columns]
        lines.append(f"| {row_label(conc, ctx)} | " + " | ".join(texts) + " |")
    cs = list(sel.values())
    lines += ["", f"{shape} ({_weights(sel)} weights) decode tok/s (E4M3/{kv16} in parentheses), "
              f"{_each(cs, '{gpu}')}, {_each(cs, '{date}')}; source: "
              f"{_each(cs, '`{source}` (commit {commit})')}"]
    if any(CROSS_RUN in line for line in lines[2:-2]):
        lines[-1] += (f". {CROSS_RUN}: the two cells of this ratio come from different runs "
                      "(kvcap bench throughput_targets compares arms of one run only)")
    return "\n".join(lines)


def _title(sel: dict[tuple[str, int, int], dict], shape: str) -> str:
    cs = list(sel.values())
    commits = _each(cs, "{commit}")
    return (f"kvcap decode throughput: {_each(cs, '{gpu}')}, {shape} ({_weights(sel)} "
            f"weights), {_each(cs, '{date}')}, commit{'s' if ',' in commits else ''} {commits}")


def plot(cells: list[dict], out_png: str | Path, shape: str = DEFAULT_SHAPE) -> Path:
    """Grouped bars of decode tok/s per (concurrency x context), one bar per KV mode, each
    labelled with its roofline fraction; log y where the values span more than 10x. Written
    atomically (a temporary sibling, then a rename)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    sel = _select(cells, shape)
    rows = _rows(sel)
    fig = Figure(figsize=(max(6.0, 1.9 * len(rows) + 2), 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    columns = _columns(sel)
    width = 0.8 / len(columns)
    values = [c["decode_tok_s"] for c in sel.values() if measured(c)]
    log = bool(values) and min(values) > 0 and max(values) / min(values) > 10
    for i, (kv, label, colour) in enumerate(columns):
        xs, hs, fracs = [], [], []
        for j, (conc, ctx) in enumerate(rows):
            x = j + (i - (len(columns) - 1) / 2) * width
            cell = sel.get((kv, conc, ctx))
            if measured(cell):
                xs.append(x)
                hs.append(cell["decode_tok_s"])
                fracs.append(cell.get("roofline_fraction"))
            else:  # an empty slot says why, from the bottom of the axes up
                text = "not run" if cell is None else _skip_text(cell)
                ax.text(x, 0.02, text, transform=ax.get_xaxis_transform(), rotation=90,
                        ha="center", va="bottom", fontsize=6, color="0.35")
        bars = ax.bar(xs, hs, width, label=label, color=colour)
        ax.bar_label(bars, labels=["" if f is None else f"{f:.2f}" for f in fracs],
                     fontsize=6, padding=1)
    if log:
        ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.margins(y=0.12)
    ax.set_xticks(range(len(rows)), [row_label(*r) for r in rows])
    ax.set_xlabel("concurrency x context")
    ax.set_ylabel("decode tok/s" + (" (log)" if log else ""))
    ax.set_title(_title(sel, shape), fontsize=9)
    ax.legend(fontsize=7, loc="upper left", title="KV cache (bar labels: roofline fraction)",
              title_fontsize=7)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_png(out, fig, dpi=120)
    return out


def main(argv: list[str] | None = None) -> int:
    # (`kvcap bench` puts the suite's name in sys.argv[0]; under `python -m` it is a path)
    ap = argparse.ArgumentParser(prog=sys.argv[0] if sys.argv[0].startswith("kvcap bench")
                                 else "python -m kvcap.bench.throughput_report",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", metavar="FILE.json", help="kvcap.bench.throughput JSONs")
    ap.add_argument("--png", default=None, metavar="OUT.png", help="also write the bar chart")
    ap.add_argument("--shape", default=DEFAULT_SHAPE, help=f"default {DEFAULT_SHAPE}")
    args = ap.parse_args(argv)
    try:
        cells = load_cells(args.files)
        table = markdown_table(cells, args.shape)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    replaced = sum(c["shape"] == args.shape for c in cells) - len(_select(cells, args.shape))
    if replaced:
        print(f"note: {replaced} cell(s) appear in more than one file; the later file's are used "
              "(a skip never replaces a measurement)", file=sys.stderr)
    print_report(table)
    if args.png:
        try:
            plot(cells, args.png, shape=args.shape)
        except OSError as e:
            print(f"error: cannot write {args.png}: {e.strerror or e}", file=sys.stderr)
            return 2
        print_report(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
