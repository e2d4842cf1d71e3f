"""Host overhead of the engine's decode step, by phase (schedule, prepare, forward, sample,
update, output), at several concurrencies.

Runs the real LLM/Engine on a random-weight model (`dummy:` config; by default a tiny 2-layer,
hidden-64 Llama so the forward costs little and the host work shows) and times every decode
step with the engine's optional StepTimer (kvcap/engine/timing.py). `overhead` is the step time
minus the forward phase: what the host adds around the model.

On CUDA the default mode measures the real, overlapped step (the forward is a graph replay that
runs while the host goes on); the GPU's forward time comes from CUDA events and `exposed` =
step - gpu_forward is the host time the GPU does not hide. `--sync` synchronizes at every phase
boundary so each phase is attributable (`overhead` = step - forward then means host time).

    python -m kvcap.bench.step_overhead                       # CPU, tiny model
    python -m kvcap.bench.step_overhead --device cuda \
        --config kvcap/bench/configs/llama-3.1-8b.json --both --out step_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvcap.bench.throughput import weight_bytes
from kvcap.commands.common import (
    block_size,
    non_negative_int,
    positive_float,
    positive_int,
    set_threads,
)
from kvcap.engine.timing import PHASES, StepTimer
from kvcap.scales.fsutil import atomic_write_text

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def tiny_config_path() -> str:
    path = Path(tempfile.gettempdir()) / "kvcap-step-overhead-tiny.json"
    text = json.dumps(TINY_CONFIG)
    if not path.is_file() or path.read_text() != text:
        # staged and renamed: another process (a second pytest worker) may be reading it
        atomic_write_text(path, text)
    return str(path)


def build_llm(config: str, device: str, max_num_seqs: int, max_model_len: int,
              block_size: int, dtype: str, enforce_eager: bool):
    from kvcap.llm import LLM

    num_blocks = max_num_seqs * -(-max_model_len // block_size) + 8
    return LLM(model=f"dummy:{config}", device=device, dtype=dtype, block_size=block_size,
               max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_blocks=num_blocks,
               enforce_eager=enforce_eager)


def _stats(xs: list[float]) -> dict:
    return {"mean_ms": 1e3 * statistics.fmean(xs), "p50_ms": 1e3 * statistics.median(xs)}


def prefill_steps(llm, concurrency: int, context: int) -> int:
    """Steps until the last of `concurrency` prompts has been prefilled (an upper bound)."""
    budget = llm.config.max_num_batched_tokens - concurrency  # running requests decode too
    return -(-concurrency * context // max(budget, 1)) + 2


def measure(llm, concurrency: int, context: int, steps: int, warmup: int, sync: bool,
            temperature: float = 0.0, seed: int = 0, read_gbps: float | None = None) -> dict:
    """Decode `warmup + steps` tokens for `concurrency` prompts of `context` tokens; time the
    decode-only steps that run the whole batch (the first `warmup` of them are dropped)."""
    from kvcap import SamplingParams

    gen = torch.Generator().manual_seed(seed + concurrency)
    vocab = llm.spec.vocab_size
    ids = torch.randint(0, vocab, (concurrency, context), generator=gen).tolist()
    # Early requests decode while later ones prefill: give everyone enough tokens that the whole
    # batch still decodes together for warmup + steps steps once the last prompt is in.
    params = SamplingParams(temperature=temperature, ignore_eos=True,
                            max_tokens=prefill_steps(llm, concurrency, context) + warmup + steps)
    engine = llm.engine
    for i, p in enumerate(ids):
        engine.add_request(f"so-{concurrency}-{int(sync)}-{i}", p, params)
    timer = StepTimer(llm.device, sync=sync)
    engine.set_timer(timer)
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.set_timer(None)
    wall = time.perf_counter() - t0
    recs = [r for r in timer.records if r["decode_only"] and r["num_seqs"] == concurrency]
    recs = recs[warmup:warmup + steps]
    if not recs:
        raise RuntimeError("no full-batch decode step was recorded")
    out: dict = {"concurrency": concurrency, "context": context, "steps": len(recs),
                 "sync": sync, "overlap": engine.overlap and not sync, "run_wall_s": wall}
    for ph in PHASES:
        out[ph] = _stats([r.get(ph, 0.0) for r in recs])
    out["step"] = _stats([r["step"] for r in recs])
    out["overhead"] = _stats([r["step"] - r.get("forward", 0.0) for r in recs])
    if all("gpu_forward" in r for r in recs):
        out["gpu_forward"] = _stats([r["gpu_forward"] for r in recs])
        out["exposed"] = _stats([r["step"] - r["gpu_forward"] for r in recs])
    out["decode_tok_s"] = concurrency / (out["step"]["mean_ms"] / 1e3)
    if read_gbps:  # bytes every decode step must read: all weights + the batch's K/V
        kv = statistics.fmean(r["context_tokens"] for r in recs) * llm.pool.spec.bytes_per_token
        out["roofline_ms"] = 1e3 * (weight_bytes(llm) + kv) / (read_gbps * 1e9)
        out["roofline_frac"] = out["roofline_ms"] / out["step"]["mean_ms"]
    return out


COLUMNS = ["conc", "sync", *PHASES, "step", "overhead", "gpu_fwd", "exposed", "tok/s",
           "roofline"]


def format_header() -> str:
    return "  ".join(f"{c:>9}" for c in COLUMNS)


def format_row(r: dict) -> str:
    vals = [f"{r['concurrency']:>9}", f"{'yes' if r['sync'] else 'no':>9}"]
    for k in (*PHASES, "step", "overhead", "gpu_forward", "exposed"):
        vals.append(f"{r[k]['mean_ms']:9.3f}" if k in r else f"{'-':>9}")
    vals.append(f"{r['decode_tok_s']:9.0f}")
    vals.append(f"{100 * r['roofline_frac']:8.1f}%" if "roofline_frac" in r else f"{'-':>9}")
    return "  ".join(vals)


def format_table(rows: list[dict]) -> str:
    return "\n".join([format_header(), *map(format_row, rows)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None,
                    help="HF config.json of a random-weight model (default: tiny 2-layer Llama)")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=positive_int, default=1024,
                    help="prompt tokens per request")
    ap.add_argument("--steps", type=positive_int, default=32,
                    help="timed decode steps per concurrency")
    ap.add_argument("--warmup", type=non_negative_int, default=4,
                    help="untimed decode steps first")
    ap.add_argument("--block-size", type=block_size, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--sync", action="store_true",
                    help="CUDA: synchronize at phase boundaries (attributable phases)")
    ap.add_argument("--both", action="store_true", help="measure overlapped and --sync modes")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    ap.add_argument("--read-gbps", type=positive_float, default=None,
                    help="CUDA: memory read ceiling for the roofline (default: measured)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    cmax = max(args.concurrency)
    budget = 2048  # the engine's default max_num_batched_tokens
    if cmax >= budget:  # (the prefill bound below divides by what the decodes leave)
        ap.error(f"--concurrency {cmax}: at most {budget - 1} (the engine's {budget} tokens a "
                 "step must leave room for a prompt beside every decoding request)")
    set_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = args.config or tiny_config_path()
    prefill = -(-cmax * args.context // (budget - cmax)) + 2
    max_model_len = args.context + prefill + args.warmup + args.steps + args.block_size
    t0 = time.perf_counter()
    llm = build_llm(config, device, cmax, max_model_len, args.block_size, args.dtype,
                    args.enforce_eager)
    build_s = time.perf_counter() - t0
    modes = [False, True] if args.both else [args.sync]
    on_cuda = llm.device.type == "cuda"
    read_gbps = None
    if on_cuda:
        from kvcap.bench.throughput import read_ceiling_tbs

        read_gbps = args.read_gbps or 1e3 * read_ceiling_tbs(llm.device)
    print(f"step overhead: {Path(config).name} on {llm.device} ({llm.dtype}), context "
          f"{args.context}, {args.steps} decode steps, cuda graphs "
          f"{'on' if llm.runner.graphs is not None else 'off'}, built in {build_s:.1f} s; "
          f"ms per step (mean)" + (f"; roofline at {read_gbps:.0f} GB/s" if read_gbps else ""))
    print(format_header(), flush=True)
    doc = {"config": config, "device": device, "torch_device": str(llm.device),
           "dtype": str(llm.dtype), "threads": torch.get_num_threads(),
           "cuda_graphs": llm.runner.graphs is not None, "build_s": build_s,
           "args": vars(args), "results": []}
    if on_cuda:
        doc["gpu"] = torch.cuda.get_device_name(llm.device)
        doc["weight_bytes"] = weight_bytes(llm)
        doc["read_gbps"] = read_gbps
    for sync in modes:
        for c in args.concurrency:
            row = measure(llm, c, args.context, args.steps, args.warmup, sync,
                          args.temperature, read_gbps=read_gbps)
            doc["results"].append(row)
            print(format_row(row), flush=True)
            if args.out:  # after every cell: a cut-short run keeps what it measured
                atomic_write_text(Path(args.out), json.dumps(doc, indent=1))
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
