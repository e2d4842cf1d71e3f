"""`kvcap capacity`: KV tokens and max concurrency at a memory budget, FP16 vs E4M3."""

from __future__ import annotations

import argparse

from kvcap.commands.common import block_size, memory_gib, positive_int
from kvcap.config import ModelSpec
from kvcap.errors import ConfigError
from kvcap.kv_cache.spec import KVCacheSpec, peak_blocks

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block (the engine's default too)

HELP = "print KV-cache capacity (tokens, max concurrency) for FP16 vs E4M3 at a memory budget"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default', an HF directory, or dummy:/path/config.json")
    p.add_argument("--memory-gib", type=memory_gib, required=True,
                   help="KV-cache memory budget (up to 2^30 GiB)")
    p.add_argument("--block-size", type=block_size, default=DEFAULT_BLOCK_SIZE,
                   help="tokens per KV block (a power of two)")
    p.add_argument("--context", type=positive_int, nargs="+",
                   default=[1024, 4096, 16384, 32768, 131072])


def capacity_rows(spec: ModelSpec, memory_gib: float, block_size: int,
                  contexts: list[int]) -> list[dict]:
    budget = int(memory_gib * 2**30)
    rows = []
    for kv in ("fp16", "fp8_e4m3"):
        cs = KVCacheSpec.for_model(spec, block_size, kv)
        rows.append({"kv_dtype": kv, "bytes_per_token": cs.bytes_per_token,
                     "tokens": cs.tokens_for(budget),
                     "max_concurrency": {c: cs.max_concurrency(budget, c) for c in contexts}})
    return rows


def check_holds_a_block(spec: ModelSpec, memory_gib: float, block_size: int) -> None:
    """Refuse a budget that holds no FP16 block (the E4M3 / FP16 ratio would divide by
    nothing); `kvcap demo` checks its --memory-gib with it before its first step."""
    cs = KVCacheSpec.for_model(spec, block_size, "fp16")
    if cs.tokens_for(int(memory_gib * 2**30)) == 0:
        block = cs.bytes_per_token * block_size
        raise ConfigError(f"--memory-gib {memory_gib:g} holds no FP16 block "
                          f"({block_size} tokens x {cs.bytes_per_token} B = "
                          f"{block / 2**20:.2f} MiB): raise --memory-gib or lower --block-size")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    from kvcap.models import loader

    if str(args.model).startswith(loader.DUMMY_PREFIX):
        spec = ModelSpec.from_hf_config(loader.dummy_config(args.model))
    else:
        spec = loader.read_spec(loader.resolve_model_dir(args.model))
    check_holds_a_block(spec, args.memory_gib, args.block_size)
    rows = capacity_rows(spec, args.memory_gib, args.block_size, args.context)
    limit = spec.position_limit
    table = Table(title=f"KV capacity at {args.memory_gib:g} GiB ({spec.num_layers} layers, "
                        f"{spec.num_kv_heads} KV heads x {spec.head_dim})")
    # (rich cut a cell that did not fit the console to a prefix and an ellipsis: at 80
    # columns, a pipe's width, the README's command printed "fp8_e4" and "bytes/", and with
    # more --context values the counts themselves, "17" for 1728): cells never wrap or
    # shrink, headers break at their newline, and a table wider than the console widens it)
    table.add_column("KV dtype", no_wrap=True)
    table.add_column("bytes/\ntoken", justify="right", no_wrap=True)
    table.add_column("tokens", justify="right", no_wrap=True)
    for c in args.context:
        table.add_column(f"seqs @\n{c}", justify="right", no_wrap=True)
    for r in rows:
        # (a context past the model's position limit is one it never runs: no count)
        table.add_row(r["kv_dtype"], str(r["bytes_per_token"]), f"{r['tokens']:,}",
                      *[str(r["max_concurrency"][c]) if c <= limit else "-"
                        for c in args.context])
    ratio = rows[1]["tokens"] / rows[0]["tokens"]
    console = Console()
    need = Measurement.get(console, console.options.update_width(2**20), table).maximum
    if need > console.width:
        console = Console(width=need)
    console.print(table)
    console.print(f"E4M3 / FP16 tokens: {ratio:.3f}x")
    console.print("seqs @ L: sequences of L tokens run at once, as the scheduler admits them "
                  "(1% of the blocks kept free)")
    if max(args.context) > limit:
        console.print(f"-: longer than the model's position limit ({limit:,} tokens)")
    window = KVCacheSpec.for_model(spec, args.block_size, "fp16").released_window
    if window is not None:  # (the longest sequence the model takes: its position limit)
        most = peak_blocks(limit, args.block_size, window, 1)
        console.print(f"every layer slides over {window:,} tokens: a decoding sequence holds "
                      f"at most {most} blocks whatever its length (the blocks behind its window "
                      "go back to the pool)")
    return 0
