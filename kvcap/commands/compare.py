"""`kvcap compare`: FP16-KV reference vs calibrated E4M3 vs unit-scale control, same token ids."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvcap.commands.common import non_negative_int, positive_int, refuse_dummy, set_threads
from kvcap.errors import ConfigError

HELP = ("A/B quality of the calibrated E4M3 KV cache against the unquantized reference (and a "
        "unit-scale negative control): held-out KL/top-1/perplexity, greedy generation, "
        "retrieval, per-layer attention error, and with --qsa the QSA selection/output quality; "
        "writes report.json, report.md and plots")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="base checkpoint: 'default' or an HF dir")
    p.add_argument("--overlay", required=True, type=Path, help="calibrated scale overlay pack")
    p.add_argument("--tasks", default="heldout,internals,generation,retrieval",
                   help="comma-separated subset of heldout, internals, generation, retrieval "
                        "(and qsa, which --qsa adds)")
    p.add_argument("--quick", action="store_true",
                   help="small budgets (a few minutes on a 2-core CPU)")
    p.add_argument("--out", type=Path, default=Path("kvcap-compare"), help="report directory")
    p.add_argument("--control", type=Path, default=None,
                   help="unit-scale control pack (default: written under --out)")
    p.add_argument("--no-control", action="store_true", help="skip the negative-control arm")
    p.add_argument("--calibration-manifest", type=Path, default=None,
                   help="calibration-corpus.json for the disjointness check (default: searched "
                        "next to the overlay)")
    p.add_argument("--baseline-kv", default="auto",
                   help="KV dtype of the reference arm: auto (the model dtype: FP32 on CPU, "
                        "BF16/FP16 on GPU; default) | fp16 | bf16 | fp32")
    p.add_argument("--contexts", type=positive_int, nargs="+", default=None,
                   help="retrieval context lengths (tokens, <= the model's window)")
    p.add_argument("--retrieval-tasks", default=None, help="comma-separated: passkey,kv")
    p.add_argument("--heldout-tokens", type=positive_int, default=None)
    p.add_argument("--record-tokens", type=positive_int, default=None)
    p.add_argument("--prompts", type=non_negative_int, default=None,
                   help="generation prompts per kind (plain and chat)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None)
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads for torch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--qsa", default=None, metavar="PRESET",
                   help="run every arm with QSA (e.g. all-but-3, every4:1024) and add the QSA "
                        "section: selection overlap and attention-output agreement vs the "
                        "reference arm, dense attention-mass recall (docs/qsa.md)")
    p.add_argument("--qsa-context", type=positive_int, default=None,
                   help="tokens per QSA record (default: twice the QSA budget, <= the window)")
    p.add_argument("--qsa-records", type=positive_int, default=None,
                   help="teacher-forced QSA records (default 1 with --quick, else 4)")


def overrides(args: argparse.Namespace) -> dict:
    """The budget fields the user set (their argparse types refuse values under 1, --prompts
    under 0)."""
    out: dict = {}
    if args.contexts:
        out["contexts"] = tuple(args.contexts)
    if args.retrieval_tasks:
        # strip before dropping empties: "passkey, " means passkey, not passkey and ''
        out["retrieval_tasks"] = tuple(t.strip() for t in args.retrieval_tasks.split(",")
                                       if t.strip())
    for name in ("heldout_tokens", "record_tokens", "max_new_tokens", "qsa_context",
                 "qsa_records"):
        value = getattr(args, name)
        if value is not None:
            out[name] = value
    if args.prompts is not None:
        out["plain_prompts"] = out["chat_prompts"] = args.prompts
    return out


def print_summary(report: dict, paths: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="calibrated E4M3 vs reference (goals from issue 4)")
    for col in ("goal", "target", "calibrated E4M3", "unit-scale control", "status"):
        table.add_column(col)

    from kvcap.eval.report import goal_figure

    for g in report["goals"]:
        status = {True: "[green]met[/]", False: "[red]MISSED[/]", None: "not run"}[g["met"]]
        table.add_row(g["description"], g["target"], goal_figure(g["value"], g["target"]),
                      goal_figure(g["control_value"], g["target"]), status)
    console = Console()
    console.print(table)
    if "qsa" in report["results"]:
        console.print(qsa_table(report["results"]["qsa"], Table))
    console.print(f"disjointness: {report['data']['disjointness']['summary']}")
    console.print(f"report: {paths['md']} (+ report.json, plots) in "
                  f"{report['timings']['total']:.0f} s")


def qsa_table(section: dict, table_cls):
    from kvcap.eval.qsa_quality import SUMMARY_HEADER, summary_rows

    table = table_cls(title=f"QSA {section['preset']} vs the reference arm (goals from issue 9)")
    for col in SUMMARY_HEADER:
        table.add_column(col)
    for row in summary_rows(section):
        table.add_row(*row)
    return table


def run(args: argparse.Namespace) -> int:
    from kvcap.eval.runner import CompareConfig, parse_tasks, run_compare

    if args.no_control and args.control is not None:  # (--control was dropped without a word)
        raise ConfigError("--control and --no-control contradict each other: give one")
    refuse_dummy(args.model, "compare")
    set_threads(args.threads)
    cfg = CompareConfig(model=args.model, overlay=args.overlay, out=args.out,
                        tasks=parse_tasks(args.tasks), quick=args.quick, control=args.control,
                        no_control=args.no_control, calibration_manifest=args.calibration_manifest,
                        baseline_kv=args.baseline_kv, device=args.device, seed=args.seed,
                        qsa=args.qsa, overrides=overrides(args))
    report, paths = run_compare(cfg)
    print_summary(report, paths)
    return 0
