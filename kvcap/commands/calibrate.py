"""`kvcap calibrate`: K/V statistics from FP16/FP32-KV forwards of the real model -> report.

Output directory (built in a staging dir, renamed atomically):
  calibration-corpus.json   corpus manifest: per shard record SHA-256s, provenance, tokens
  calibration-prompts.json  the frozen prompt token ids, per shard
  kv_stats.npz              raw statistics (mergeable: counts, histograms, max_abs per shard)
  calibration-report.json   the report (scales, saturation, percentiles, E4M3 range fractions)
  calibration-report.png    the report figure
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from kvcap.commands.common import positive_int, set_threads
from kvcap.errors import CalibrationError, ConfigError

HELP = "calibrate per-layer K/V scales on built-in or file corpora and write a report"
REPORT_NAME = "calibration-report.json"
FIGURE_NAME = "calibration-report.png"
STATS_NAME = "kv_stats.npz"
CORPUS_NAME = "calibration-corpus.json"
PROMPTS_NAME = "calibration-prompts.json"
CHUNK_TOKENS = 4096  # tokens handed to the engine per generate() call (progress granularity)

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="default",
        help="'default' (embedded SmolLM2-135M-Instruct) or an HF-format directory",
    )
    p.add_argument("--out", required=True, type=Path, help="output directory (must not exist)")
    p.add_argument(
        "--corpus",
        action="extend",
        nargs="+",
        default=None,
        metavar="NAME|FILE",
        help="shards: prose, code, chat, tool_json, chinese, or text files "
        "(default: every built-in shard available)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=200_000,
        help="total prompt tokens over all shards (default 200000)",
    )
    p.add_argument("--record-tokens", type=positive_int, default=1024, help="tokens per record")
    p.add_argument(
        "--policy",
        default="max",
        help="scale policy: max (ceil_fp32(max_abs/448), default) or percentile:Q",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        default="auto",
        help="model dtype: auto | float32 | float16 | bfloat16 (auto: FP32 on CPU)",
    )
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="GPUs; every rank records its own KV heads, merged afterwards")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for torch (default: torch's choice; 1 is faster on a "
                        "busy machine)")


def _chunks(records: list[list[int]]) -> list[list[list[int]]]:
    out: list[list[list[int]]] = [[]]
    size = 0
    for r in records:
        if size + len(r) > CHUNK_TOKENS and out[-1]:
            out.append([])
            size = 0
        out[-1].append(r)
        size += len(r)
    return [c for c in out if c]


def observe_shards(llm: Any, obs: Any, shards: list[Any]) -> float:
    """Prefill every record once (max_tokens=1) with the observer on; returns seconds."""
    from tqdm import tqdm

    from kvcap.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    total = sum(s.num_tokens for s in shards)
    start = time.perf_counter()
    with tqdm(total=total, desc="calibration forwards", unit="tok", smoothing=0.1) as bar:
        for shard in shards:
            obs.set_shard(shard.name)
            bar.set_postfix_str(shard.name)
            for chunk in _chunks(shard.records):
                llm.generate(chunk, params, use_tqdm=False)
                bar.update(sum(len(r) for r in chunk))
    return time.perf_counter() - start


def check_coverage(stats: Any, shards: list[Any]) -> None:
    """Every layer must have seen exactly every prompt token of every shard."""
    for shard in shards:
        got = stats.shards.get(shard.name)
        rows = got.rows.tolist() if got is not None else [0]
        bad = [(layer, r) for layer, r in enumerate(rows) if r != shard.num_tokens]
        if got is None or bad:
            layer, r = bad[0] if bad else (0, 0)
            raise CalibrationError(
                f"shard {shard.name!r}: layer {layer} observed {r} of "
                f"{shard.num_tokens} prompt tokens (observer not wired to "
                "every forward?)"
            )


def run(args: argparse.Namespace) -> int:
    from kvcap.eval import corpora
    from kvcap.llm import LLM
    from kvcap.scales.binding import BaseCheckpoint
    from kvcap.scales.figure import write_figure
    from kvcap.scales.fsutil import atomic_write_text, check_can_create, staged_dir
    from kvcap.scales.observer import KVStatsObserver
    from kvcap.scales.report import build_report, parse_policy

    if str(args.model).startswith("dummy:"):
        raise ConfigError("calibration needs a real checkpoint, not dummy weights")
    parse_policy(args.policy)  # fail before any work
    set_threads(args.threads)
    names = corpora.resolve_names(args.corpus)
    if args.record_tokens < corpora.MIN_RECORD_TOKENS:
        # (build_shards refuses it too, but only after minutes of model load)
        raise CalibrationError(f"--record-tokens {args.record_tokens} is below the "
                               f"{corpora.MIN_RECORD_TOKENS} tokens a corpus record needs")
    if args.out.exists() or args.out.is_symlink():  # (a dangling link too: staged_dir
        # refuses it, but only after the model load and the corpora)
        raise CalibrationError(f"output {args.out} already exists; refusing to overwrite it")
    check_can_create(args.out, CalibrationError)  # before minutes of model load and forwards
    tp = {"tensor_parallel_size": args.tensor_parallel_size} \
        if args.tensor_parallel_size != 1 else {}
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype="auto",
        device=args.device,
        max_model_len=args.record_tokens + 1,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.record_tokens),
        enable_prefix_caching=False,
        attention_backend=args.attention_backend,
        seed=args.seed,
        **tp,
    )
    if args.record_tokens + 1 > llm.max_model_len:
        # LLM caps max_model_len at the model's position limit; records that long would only be
        # refused later, one prompt at a time, after the corpora were built
        raise CalibrationError(
            f"--record-tokens {args.record_tokens} does not fit the model: its context holds "
            f"{llm.max_model_len} tokens (a record + 1 sampled token); use --record-tokens "
            f"{llm.max_model_len - 1} or less"
        )
    base = BaseCheckpoint.inspect(llm.model_dir)
    model = {
        **base.describe(),
        "path": str(llm.model_dir),
        "dtype": str(llm.dtype),
        "kv_cache_dtype": llm.kv_dtype,
        "device": str(llm.device),
    }
    # build_shards resolves names again and knows no `file:` prefix: hand it the paths back
    paths = [n.removeprefix("file:") for n in names]
    shards = corpora.build_shards(
        llm.tokenizer, paths, args.max_tokens, "calibration", args.record_tokens, seed=args.seed
    )
    # An empty shard would only be caught after every forward, as an observer-wiring error.
    empty = [s.name for s in shards if not s.records]
    if empty:
        raise CalibrationError(
            f"corpus shard(s) {', '.join(empty)} produced no records of at least "
            f"{corpora.MIN_RECORD_TOKENS} tokens (text too short, or --max-tokens "
            f"{args.max_tokens} too small for {len(shards)} shards); drop them or raise "
            "--max-tokens"
        )
    with staged_dir(args.out, CalibrationError) as stage:
        corpora.write_manifest(
            stage / CORPUS_NAME,
            shards,
            llm.tokenizer,
            "calibration",
            seed=args.seed,
            record_tokens=args.record_tokens,
        )
        atomic_write_text(
            stage / PROMPTS_NAME,
            json.dumps({"split": "calibration", "shards": {s.name: s.records for s in shards}})
            + "\n",
        )
        obs = KVStatsObserver(llm.spec.num_layers)
        llm.set_kv_observer(obs)
        seconds = observe_shards(llm, obs, shards)
        llm.set_kv_observer(None)
        stats = llm.collect_kv_stats()  # merged over tensor-parallel ranks
        check_coverage(stats, shards)
        stats.save(stage / STATS_NAME)
        t0 = time.perf_counter()
        tokens = sum(s.num_tokens for s in shards)
        extra = {
            "forward_seconds": seconds,
            "tokens_per_second": tokens / seconds,
            "record_tokens": args.record_tokens,
            "seed": args.seed,
        }
        report = build_report(stats, llm.spec, model, args.policy, extra)
        atomic_write_text(stage / REPORT_NAME, json.dumps(report, indent=1) + "\n")
        write_figure(report, stage / FIGURE_NAME)
        report_seconds = time.perf_counter() - t0
    _print_summary(report, args.out, tokens, seconds, report_seconds)
    return 0


def _print_summary(
    report: dict[str, Any], out: Path, tokens: int, seconds: float, report_seconds: float
) -> None:
    s = report["summary"]
    print(
        f"calibrated {report['num_layers']} layers on {tokens} tokens "
        f"({', '.join(f'{k}={v}' for k, v in report['shard_tokens'].items())})"
    )
    print(
        f"throughput: {tokens / seconds:.0f} tok/s ({seconds:.1f} s of forwards); "
        f"report + figure: {report_seconds:.2f} s"
    )
    print(
        f"scales {s['scale_range'][0]:.4g}..{s['scale_range'][1]:.4g}, max saturation "
        f"{s['max_saturation_ratio']:.3g}; underflow (<2^-10) at scale "
        f"{s['underflow_frac_range'][1]:.3%} max vs {s['unit_scale_underflow_frac_range'][1]:.3%}"
        f" at scale 1.0; subnormal max {s['subnormal_frac_range'][1]:.3%} vs "
        f"{s['unit_scale_subnormal_frac_range'][1]:.3%}"
    )
    ratio = s["shard_ratio_range"]
    if ratio[0] is not None:
        print(f"per-shard scale / global scale: {ratio[0]:.3f}..{ratio[1]:.3f}")
    print(f"wrote {out}/{REPORT_NAME}, {FIGURE_NAME}, {STATS_NAME}, {CORPUS_NAME}")
