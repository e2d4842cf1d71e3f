"""Arguments shared by commands: the engine's, and argparse types for positive numbers."""

from __future__ import annotations

import argparse
import math


def _number_type(convert, accept, expected: str, name: str):
    """An argparse type: `convert` the text, keep it if `accept` holds, else a one-line usage
    error saying what was expected."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
        return value
    parse.__name__ = name
    return parse


# a budget or a size; a length or a count; a TCP port (0: any free one); a timeout; a bound
# that may be 0 (e.g. no queue)
positive_float = _number_type(float, lambda v: v > 0 and math.isfinite(v),
                              "a finite number > 0", "positive_float")
positive_int = _number_type(int, lambda v: v >= 1, "an integer >= 1", "positive_int")
port_number = _number_type(int, lambda v: 0 <= v <= 65535, "a port number 0-65535",
                           "port_number")
non_negative_float = _number_type(float, lambda v: v >= 0 and math.isfinite(v),
                                  "a finite number >= 0", "non_negative_float")
non_negative_int = _number_type(int, lambda v: v >= 0, "an integer >= 0", "non_negative_int")
# a memory budget in GiB whose bytes an int holds (1e300 overflowed capacity's int())
memory_gib = _number_type(float, lambda v: 0 < v <= 2**30, "a number of GiB in (0, 2^30]",
                          "memory_gib")
fraction = _number_type(float, lambda v: 0 < v <= 1, "a number in (0, 1]", "fraction")
# the engine's paged blocks (EngineConfig.validate refuses the rest, deep inside; capacity
# would print a table for a size no engine can use)
block_size = _number_type(int, lambda v: v >= 1 and not v & (v - 1), "a power of two",
                          "block_size")


def list_type(item, expected: str, name: str):
    """An argparse type for comma-separated values, each one `item` (an argparse type above):
    a value it refuses is a one-line usage error naming the whole list."""
    def parse(text: str) -> list:
        try:
            return [item(x) for x in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}") from None
    parse.__name__ = name
    return parse


# a benchmark's batches, contexts, ... ("1,4,8"); draft counts where 0 is the reference run
positive_int_list = list_type(positive_int, "comma-separated integers >= 1, e.g. 1,4,8",
                               "positive_int_list")
non_negative_int_list = list_type(non_negative_int, "comma-separated integers >= 0, e.g. 0,2,4",
                                   "non_negative_int_list")
# where in a context a needle sits, in percent of it (the QSA needle and recall probes)
percent_list = list_type(_number_type(int, lambda v: 0 <= v <= 100, "an integer 0-100", "percent"),
                         "comma-separated integers 0-100, e.g. 0,50,100", "percent_list")


def require_cuda(parser: argparse.ArgumentParser, hint: str = "") -> None:
    """A usage error (exit 2) for a command that measures on a CUDA GPU when none is visible,
    instead of a traceback from deep inside torch.cuda; `hint` is appended."""
    import torch

    if not torch.cuda.is_available():
        parser.error("measures on a CUDA GPU and none is visible (torch.cuda.is_available() "
                     "is False)" + hint)


def refuse_dummy(model: str, command: str) -> None:
    """Commands that read a checkpoint's files: `dummy:CONFIG` (random weights, no checkpoint)
    was "model path 'dummy:...' does not exist", of a config that exists."""
    from kvcap.errors import ConfigError
    from kvcap.models.loader import DUMMY_PREFIX

    if str(model).startswith(DUMMY_PREFIX):
        raise ConfigError(f"{command}: {model} is random weights, not a checkpoint; {command} "
                          "needs 'default' or an HF-format directory")


def set_threads(threads: int | None) -> None:
    """--threads (an argparse positive_int): torch's CPU threads, or torch's own choice."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (embedded SmolLM2-135M-Instruct), an HF-format directory, "
                        "or dummy:/path/config.json for random weights")
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp16 | bf16 | fp32 | fp8_e4m3")
    p.add_argument("--kv-scales", default=None,
                   help="scale overlay pack directory (for fp8_e4m3 on a base checkpoint)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if present)")
    p.add_argument("--max-model-len", type=positive_int, default=None)
    p.add_argument("--max-num-seqs", type=positive_int, default=64)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--kv-cache-memory-gib", type=positive_float, default=None)
    p.add_argument("--attention-backend", default="auto", help="auto | torch | triton")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="ranks (GPUs, or CPU processes) to split the model over; rank 0 is "
                        "this process (KVCAP_ALLREDUCE=nccl|symm picks the all-reduce)")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.90,
                   help="share of the GPU's memory kvcap may use; the KV pool gets what the "
                        "weights and a profiled warm-up leave of it (default 0.90)")
    p.add_argument("--block-size", type=block_size, default=16,
                   help="tokens per KV block (a power of two)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs, decode or piecewise prefill (eager launches every step)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV blocks of a shared prompt prefix")
    p.add_argument("--seed", type=int, default=0,
                   help="engine seed, from which requests that give no seed of their own "
                        "draw theirs (the same --seed samples the same text)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) instead of the "
                        "checkpoint's, or for a checkpoint without one")
    p.add_argument("--num-speculative-tokens", type=non_negative_int, default=0, metavar="K",
                   help="speculative decoding by prompt lookup: up to K draft tokens per step, "
                        "copied from where the last tokens occurred before in the prompt or "
                        "output, verified in one forward (same output; default 0: off)")
    p.add_argument("--prompt-lookup-max", type=positive_int, default=4, metavar="N",
                   help="longest n-gram matched for drafts (default 4)")
    p.add_argument("--prompt-lookup-min", type=positive_int, default=2, metavar="N",
                   help="shortest n-gram matched for drafts (default 2)")
    p.add_argument("--speculative-disable-by-batch-size", type=positive_int, default=None,
                   metavar="N", help="no drafts while more than N requests run (default: "
                                     "drafts at any batch size)")
    p.add_argument("--fp8-weights", default="auto",
                   choices=["auto", "keep", "dequantize"],
                   help="an FP8 (E4M3) weight checkpoint's linears: kept in FP8 -- half the "
                        "weight memory and bytes per step -- or dequantized to --dtype as they "
                        "load (auto, the default: keep on CUDA GPUs of compute capability 8.0+ "
                        "wherever the layout allows, else dequantize)")
    p.add_argument("--qsa", default=None, metavar="PRESET",
                   help="query-aware sparse attention: every4, all-but-2, ... with an optional "
                        ":TOKENS budget (default 2048), e.g. every4:1024 (docs/qsa.md)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        kv_scales=args.kv_scales, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_gib=args.kv_cache_memory_gib, attention_backend=args.attention_backend,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
        enforce_eager=args.enforce_eager, enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed, qsa=args.qsa, chat_template=args.chat_template,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min,
        speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
        fp8_weights=args.fp8_weights,
    )
