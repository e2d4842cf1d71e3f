"""Arguments shared by commands: the engine's, and argparse types for positive numbers."""

from __future__ import annotations

import argparse
import math


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (a budget, a size), else a one-line usage error."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number > 0")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a length, a count), else a one-line usage error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0-65535 (0: any free port)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port number 0-65535")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (a timeout), else a one-line usage error."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number >= 0")
    return value


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (embedded SmolLM2-135M-Instruct), an HF-format directory, "
                        "or dummy:/path/config.json for random weights")
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp16 | bf16 | fp32 | fp8_e4m3")
    p.add_argument("--kv-scales", default=None,
                   help="scale overlay pack directory (for fp8_e4m3 on a base checkpoint)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if present)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-gib", type=float, default=None)
    p.add_argument("--attention-backend", default="auto", help="auto | torch | triton")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (GPUs, or CPU processes) to split the model over; rank 0 is "
                        "this process (KVCAP_ALLREDUCE=nccl|symm picks the all-reduce)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        kv_scales=args.kv_scales, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_gib=args.kv_cache_memory_gib, attention_backend=args.attention_backend,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
    )
