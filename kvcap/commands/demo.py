"""`kvcap demo`: the main job, end to end on the embedded model, no arguments needed.

calibrate -> overlay -> materialize -> gate (verify) -> E4M3 generation -> compare --quick ->
capacity table, then a summary table and where the artifacts are. Every step is the same Python
function the individual command runs.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from kvcap.commands.common import memory_gib, positive_int, refuse_dummy, set_threads

HELP = ("run the whole calibrated-E4M3 chain on the embedded model (calibrate, overlay, "
        "materialize, gate, generate, compare --quick, capacity) and summarize it")
CPU_CALIB_TOKENS = 16_384
GPU_CALIB_TOKENS = 200_000
DEMO_PROMPT = "Explain in two sentences why a KV cache speeds up text generation."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' or an HF-format directory")
    p.add_argument("--out", type=Path, default=Path("kvcap-demo"),
                   help="parent directory; each run writes a new timestamped folder in it")
    p.add_argument("--calib-tokens", type=positive_int, default=None,
                   help=f"calibration tokens (default {CPU_CALIB_TOKENS} on CPU, "
                        f"{GPU_CALIB_TOKENS} on GPU)")
    p.add_argument("--memory-gib", type=memory_gib, default=8.0,
                   help="KV memory budget for the capacity table")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads for torch")
    p.add_argument("--skip-compare", action="store_true", help="skip the A/B comparison")


def _command_args(module: Any, argv: list[str]) -> argparse.Namespace:
    """Parse `argv` with the command's own parser, so its defaults and checks apply."""
    parser = argparse.ArgumentParser(prog=f"kvcap {module.__name__.rsplit('.', 1)[-1]}")
    module.add_arguments(parser)
    return parser.parse_args(argv)


class _Steps:
    def __init__(self, console: Any):
        self.console = console
        self.rows: list[tuple[str, str, float]] = []

    def run(self, name: str, fn: Callable[[], str]) -> None:
        from kvcap.errors import KvcapError

        self.console.rule(f"[bold]{name}")
        t = time.perf_counter()
        try:
            result = fn()
        except KvcapError as e:
            # The step's own message names that command's flags (--max-tokens, --record-tokens),
            # not demo's: say which step refused. Same exception, so the CLI's gate hint stays.
            e.args = (f"demo step {name.split(' (')[0]}: {e}",)
            raise
        self.rows.append((name, result, time.perf_counter() - t))


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _device_default(device: str | None) -> str:
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def _generate(derived: Path, device: str) -> str:
    from kvcap.llm import LLM
    from kvcap.sampling_params import SamplingParams

    llm = LLM(model=str(derived), kv_cache_dtype="fp8_e4m3", device=device, num_blocks=64,
              max_model_len=1024)
    out = llm.chat([{"role": "user", "content": DEMO_PROMPT}],
                   SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)[0]
    from rich.console import Console

    Console().print(f"[dim]prompt:[/] {DEMO_PROMPT}\n[dim]E4M3 KV, greedy:[/] {out.text}")
    return f"{len(out.token_ids)} tokens ({out.finish_reason})"


def _capacity(model: str, gib: float) -> str:
    from kvcap.commands import capacity
    from kvcap.models import loader

    capacity.run(_command_args(capacity, ["--model", model, "--memory-gib", str(gib)]))
    spec = loader.read_spec(loader.resolve_model_dir(model))
    rows = capacity.capacity_rows(spec, gib, capacity.DEFAULT_BLOCK_SIZE, [4096])
    return (f"{rows[0]['tokens']:,} fp16 vs {rows[1]['tokens']:,} E4M3 tokens at {gib:g} GiB "
            f"({rows[1]['tokens'] / max(rows[0]['tokens'], 1):.2f}x)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvcap.commands import calibrate, compare, materialize, overlay, verify
    from kvcap.errors import ConfigError
    from kvcap.models.loader import resolve_model_dir
    from kvcap.scales.fsutil import lies_within, make_dirs

    # A bad --model must fail before the run folder exists, not leave an empty one behind.
    refuse_dummy(args.model, "demo")
    base = resolve_model_dir(args.model)
    # Inside the base the calibration step wrote its minutes of output into the checkpoint
    # (which is never modified) before the overlay step refused that place.
    if lies_within(args.out.resolve(), Path(base).resolve()):
        raise ConfigError(f"--out {args.out} lies inside the base checkpoint {base}; give a "
                          "directory of its own")
    # the capacity table is the last step: a --memory-gib that holds no KV block was refused
    # there, after minutes of calibration and comparison, and the summary never printed
    from kvcap.commands.capacity import DEFAULT_BLOCK_SIZE, check_holds_a_block
    from kvcap.models.loader import read_spec

    check_holds_a_block(read_spec(base), args.memory_gib, DEFAULT_BLOCK_SIZE)
    console = Console()
    set_threads(args.threads)
    device = _device_default(args.device)
    tokens = args.calib_tokens or (GPU_CALIB_TOKENS if device.startswith("cuda")
                                   else CPU_CALIB_TOKENS)
    run_dir = args.out / datetime.now().strftime("run-%Y%m%d-%H%M%S")
    cal, pack, derived, cmp_dir = (run_dir / "calibration", run_dir / "overlay",
                                   run_dir / "derived-checkpoint", run_dir / "compare")
    make_dirs(args.out, ConfigError)  # --out a file: one line, not a mkdir traceback
    try:
        run_dir.mkdir()
    except FileExistsError:  # a second demo started within the same second
        raise ConfigError(f"{run_dir} already exists (another demo run?); try again") from None
    dev = ["--device", device]
    steps = _Steps(console)
    start = time.perf_counter()

    def _calibrate() -> str:
        calibrate.run(_command_args(calibrate, ["--model", args.model, "--out", str(cal),
                                                "--max-tokens", str(tokens),
                                                "--record-tokens", "512", *dev]))
        return f"{tokens} tokens -> {(cal / calibrate.REPORT_NAME).relative_to(run_dir)}"

    def _overlay() -> str:
        overlay.run(_command_args(overlay, ["--model", args.model, "--report", str(cal),
                                            "--out", str(pack)]))
        return str(pack.relative_to(run_dir))

    def _materialize() -> str:
        materialize.run(_command_args(materialize, ["--model", args.model, "--overlay",
                                                    str(pack), "--out", str(derived)]))
        return str(derived.relative_to(run_dir))

    def _verify() -> str:
        verify.run(_command_args(verify, ["--model", str(derived), *dev]))
        return "gate passed (all K/V scales present, finite, > 0)"

    def _compare() -> str:
        from kvcap.eval.runner import CompareConfig, parse_tasks, run_compare

        report, paths = run_compare(CompareConfig(
            model=args.model, overlay=pack, out=cmp_dir, quick=True, device=device,
            tasks=parse_tasks("heldout,internals,generation,retrieval"),
            calibration_manifest=cal / calibrate.CORPUS_NAME))
        compare.print_summary(report, paths)
        goals = report["goals"]
        met = sum(g["met"] is True for g in goals)
        return f"{met}/{len(goals)} goals met -> {Path(paths['md']).relative_to(run_dir)}"

    # SIGTERM (`timeout`, a job scheduler) killed the process inside a step's staged_dir and
    # left its hidden staging directory; stale ones are only swept by a later write to the
    # same output, which a demo (a new run folder each time) never makes. Unwind as Ctrl-C does.
    main = threading.current_thread() is threading.main_thread()  # (signal's own rule)
    previous = signal.signal(signal.SIGTERM, _terminated) if main else None
    try:
        steps.run("1. calibrate (FP16/FP32-KV forwards, K/V statistics)", _calibrate)
        steps.run("2. overlay (revision-bound scale pack)", _overlay)
        steps.run("3. materialize (derived checkpoint)", _materialize)
        steps.run("4. gate (kvcap verify)", _verify)
        steps.run("5. generate with the E4M3 KV cache", lambda: _generate(derived, device))
        if not args.skip_compare:
            steps.run("6. compare --quick (reference vs E4M3 vs unit-scale control)", _compare)
        steps.run("7. capacity", lambda: _capacity(args.model, args.memory_gib))
    except BaseException:
        # a first step that refused (bad --device, too few --calib-tokens) left the run folder
        # empty: a rerun would only add another empty one beside it
        if not any(run_dir.iterdir()):
            run_dir.rmdir()
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)

    table = Table(title=f"kvcap demo on {device} ({time.perf_counter() - start:.0f} s)")
    table.add_column("step")
    # paths relative to the run folder, folded: an 80-column terminal cut every absolute path
    # in this column to "/tmp/.../run-2026…"
    table.add_column("result", overflow="fold")
    table.add_column("seconds", justify="right")
    for name, result, secs in steps.rows:
        table.add_row(name, result, f"{secs:.1f}")
    console.rule("[bold]summary")
    console.print(table)
    # soft_wrap: rich broke a long path over two lines (in a log file too)
    console.print(f"artifacts (the paths above are inside it): {run_dir}", soft_wrap=True)
    return 0
