"""`kvcap bench <suite> [args]`: run a benchmark script (each also runs as python -m)."""

from __future__ import annotations

import argparse
import importlib
import sys

from kvcap.errors import ConfigError

SUITES = ("throughput", "throughput_report", "throughput_targets", "kernels", "sampler",
          "serving", "qsa", "step_overhead", "step_profile", "gemm", "structured", "speculative",
          "verify_cost", "mixed_steps", "provenance")
HELP = (f"run a benchmark: {' | '.join(SUITES)} (see docs/benchmarks; throughput_targets: the "
        "decode targets judged per cell from throughput JSONs; kernels --summary FILE...: the "
        "attention kernel's targets judged from its JSONs; provenance: the source digest "
        "every result records, here or at a git revision)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", choices=SUITES)
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the suite (--help)")


def run(args: argparse.Namespace) -> int:
    try:
        mod = importlib.import_module(f"kvcap.bench.{args.suite}")
    except ModuleNotFoundError as e:
        raise ConfigError(f"benchmark suite {args.suite!r} is not available: {e}") from None
    # (a suite's parser takes its name from sys.argv[0]: its usage read "usage: kvcap [-h]
    # [--shapes ...]" and its errors "kvcap: error: argument --concurrency: ...", a command
    # line that does not exist)
    argv0, sys.argv[0] = sys.argv[0], f"kvcap bench {args.suite}"
    try:
        return int(mod.main(args.args) or 0)
    finally:
        sys.argv[0] = argv0
