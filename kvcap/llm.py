"""The offline API: `LLM(model=...)` composes loader, gate, KV pool, backend and engine.

With `tensor_parallel_size=N > 1` this process is rank 0 of N (kvcap.distributed): it starts
N-1 worker processes that build the same LLM on their shard of the model (their own KV pool and
scale gate) and then follow this process's scheduler step by step. `shutdown()` (or leaving a
`with LLM(...)` block, or interpreter exit) stops them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvcap.attention.base import AttentionBackend
from kvcap.config import (
    EngineConfig,
    ModelSpec,
    is_int,
    is_integral,
    resolve_dtype,
    resolve_kv_dtype,
)
from kvcap.engine.block_manager import BlockManager
from kvcap.engine.cuda_graph import graphs_disabled
from kvcap.engine.engine import Engine, RequestOutput
from kvcap.engine.model_runner import ModelRunner
from kvcap.engine.ngram import NgramProposer
from kvcap.engine.scheduler import Scheduler
from kvcap.errors import ConfigError, ScaleGateError
from kvcap.kv_cache.pool import KVCachePool
from kvcap.kv_cache.spec import KVCacheSpec, admissible_concurrency, peak_blocks
from kvcap.models import loader
from kvcap.models.fp8_linear import large_batch_note, resolve_keep
from kvcap.models.registry import load_model
from kvcap.models.text_prompt import TemplateRefused, chat_ids, chat_messages, encode_prompt
from kvcap.qsa import enable as qsa_wiring
from kvcap.qsa.config import QSAConfig
from kvcap.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_GIB = 1.0
# kept back from the GPU KV budget for the decode CUDA graphs' private memory pool
CUDA_GRAPH_RESERVE_BYTES = 512 * 2**20


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: Triton kernels on CUDA, the eager torch reference on CPU."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("attention_backend 'triton' needs a CUDA device "
                              "(or TRITON_INTERPRET=1 for the CPU interpreter)")
        from kvcap.attention.triton_backend import TritonBackend

        backend: AttentionBackend = TritonBackend()
    else:
        from kvcap.attention.torch_ref import TorchReferenceBackend

        backend = TorchReferenceBackend()
    logger.info("attention backend: %s", backend.name)
    return backend


def _resolve_device(device: str | torch.device | None) -> torch.device:
    """None: the GPU where torch sees one, else the CPU. A named device must exist."""
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r}: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: torch {torch.__version__} sees no CUDA GPU "
                              "(a CPU build, or no GPU visible); use --device cpu or leave it "
                              "out")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: only {torch.cuda.device_count()} CUDA "
                              "device(s) visible")
    elif dev.type != "cpu":
        raise ConfigError(f"device {device!r}: kvcap runs on cuda or cpu")
    return dev


def _max_model_len(spec: ModelSpec, requested: int | None) -> int:
    """The engine's sequence limit: the request, at most the model's position limit."""
    limit = spec.position_limit
    if requested is not None and requested > limit:
        logger.warning("max_model_len %d exceeds the model's position limit "
                       "(max_position_embeddings %d, YaRN included): using %d", requested, limit,
                       limit)
    return min(requested or limit, limit)


def _check_kernel_head_dim(head_dim: int, attention_backend: str, device: torch.device) -> None:
    """kvcap's Triton kernels (attention, and on CUDA the fused RoPE / cache write) tile the
    head dimension whole: a power of two from 16 to 256. Say so before the weights load rather
    than fail inside a kernel's compile."""
    if device.type != "cuda" and attention_backend != "triton":
        return
    if 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0:
        return
    raise ConfigError(f"head_dim {head_dim}: kvcap's Triton kernels need a power-of-two head "
                      "dimension from 16 to 256 (64, 128 and 256 are the measured ones); this "
                      "model runs only on CPU, with the torch attention backend")


def check_text(text: str, what: str) -> None:
    """A text the tokenizer can encode: a lone surrogate (an argv or file byte that is not
    UTF-8, decoded with surrogateescape) was a TypeError from inside the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} is not valid UTF-8 text (character {e.start}: "
                          f"{text[e.start]!r}, an undecodable byte?)") from None


def _is_seq(x) -> bool:
    """A list, tuple, range, ... of items; not a text or bytes."""
    return isinstance(x, Sequence) and not isinstance(x, (str, bytes, bytearray))


def _ids_of(p) -> list[int] | None:
    """One prompt's token ids: a sequence of integers, or a 1-D integer tensor / array; None
    for anything else (floats, bools, texts of digits, bytes)."""
    if isinstance(p, torch.Tensor) or type(p).__module__ == "numpy":
        dt = str(p.dtype)
        if p.ndim != 1 or not any(k in dt for k in ("int", "uint")) or "bool" in dt:
            return None
        p = p.tolist()
    if _is_seq(p) and all(is_integral(t) for t in p):
        return [int(t) for t in p]
    return None


def _describe(x) -> str:
    if isinstance(x, torch.Tensor) or type(x).__module__ == "numpy":
        return f"a {type(x).__name__} of shape {tuple(x.shape)} and dtype {x.dtype}"
    if _is_seq(x):
        bad = next((t for t in x if not is_integral(t)), None)
        return f"a {type(x).__name__} holding {type(bad).__name__} {bad!r}"[:120]
    return f"{type(x).__name__} {x!r}"[:120]


def _layer_list(layers: tuple[int, ...]) -> str:
    return f"{layers[0]}-{layers[-1]}" if layers == tuple(range(layers[0], layers[-1] + 1)) \
        else ", ".join(map(str, layers))


class LLM:
    def __init__(
        self,
        model: str = "default",
        dtype: str | torch.dtype = "auto",
        kv_cache_dtype: str = "auto",
        kv_scales: str | os.PathLike | Mapping[str, torch.Tensor | float] | None = None,
        device: str | torch.device | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        num_blocks: int | None = None,
        kv_cache_memory_gib: float | None = None,
        gpu_memory_utilization: float = 0.90,
        enable_prefix_caching: bool = True,
        attention_backend: str = "auto",
        kv_observer=None,
        enforce_eager: bool = False,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        qsa: QSAConfig | str | None = None,
        chat_template: str | os.PathLike | None = None,
        num_speculative_tokens: int = 0,
        prompt_lookup_max: int = 4,
        prompt_lookup_min: int = 2,
        speculative_disable_by_batch_size: int | None = None,
        # FP8-weight checkpoints: "auto" keeps them FP8 on CUDA GPUs of compute capability
        # 8.0+ where the layout allows, "keep" / "dequantize" (kvcap.models.fp8_linear)
        fp8_weights: str = "auto",
    ):
        # What a tensor-parallel worker needs to build the same LLM (taken before any local).
        worker_args = {k: v for k, v in locals().items()
                       if k not in ("self", "device", "kv_observer", "tensor_parallel_size")}
        self.device = _resolve_device(device)
        # torch.manual_seed's range (dummy weights draw from it): past it, or not an integer,
        # the seed failed deep inside the weight init
        if not is_int(seed) or not -2**63 <= seed < 2**64:
            raise ConfigError(f"seed must be an integer in [-2**63, 2**64), got {seed!r}")
        if isinstance(dtype, torch.dtype) and dtype not in (torch.float32, torch.float16,
                                                            torch.bfloat16):
            # (the KV cache's "auto" dtype and the kernels know these three only)
            raise ConfigError(f"dtype {dtype} is not supported: use float32, float16 or "
                              "bfloat16")
        if not isinstance(model, (str, os.PathLike)):  # (a TypeError from inside pathlib)
            raise ConfigError(f"model must be 'default', a directory or 'dummy:CONFIG', got "
                              f"{model!r}")
        for name, flag in (("enable_prefix_caching", enable_prefix_caching),
                           ("enforce_eager", enforce_eager)):
            if not isinstance(flag, bool):  # ("no" was true)
                raise ConfigError(f"{name} must be True or False, got {flag!r}")
        if kv_observer is not None and not callable(getattr(kv_observer, "observe",
                                                            kv_observer)):
            raise ConfigError(f"kv_observer must have an observe(layer, k, v) method or be "
                              f"callable, got {type(kv_observer).__name__}")
        if not is_int(tensor_parallel_size) or tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got "
                              f"{tensor_parallel_size!r}")
        # query-aware sparse attention (docs/qsa.md): a QSAConfig, a preset such as "every4"
        self.qsa = qsa_wiring.resolve_qsa(qsa, tensor_parallel_size)
        self.tp = None  # kvcap.distributed.launch.TPRuntime when tensor_parallel_size > 1
        self._observer_obj = None
        self.config = EngineConfig(
            block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            num_blocks=num_blocks, kv_cache_memory_gib=kv_cache_memory_gib,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching, attention_backend=attention_backend,
            enforce_eager=enforce_eager, num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_max=prompt_lookup_max, prompt_lookup_min=prompt_lookup_min,
            speculative_disable_by_batch_size=speculative_disable_by_batch_size)
        self.config.validate()
        if self.qsa is not None and num_speculative_tokens:
            # The indexer's side caches fold in every key written (running min/max bounds, a
            # ring per block): a rejected draft's key would stay in them.
            raise ConfigError("speculative decoding (num_speculative_tokens) cannot run with "
                              "QSA: its indexer caches would keep the keys of rejected drafts; "
                              "use one or the other")

        if str(model).startswith(loader.DUMMY_PREFIX):
            hf_cfg = loader.dummy_config(str(model))
            self.model_dir: Path | None = None
            self.spec = ModelSpec.from_hf_config(hf_cfg)
            self.tokenizer = None
        else:
            self.model_dir = loader.resolve_model_dir(model)
            self.spec = loader.read_spec(self.model_dir)
        self.max_model_len = _max_model_len(self.spec, max_model_len)
        # an FP8 checkpoint's linear weights: kept FP8 (auto on CUDA sm_80+, keep) or dequantized
        self.keep_fp8 = resolve_keep(fp8_weights, self.spec, self.device, tensor_parallel_size)
        note = large_batch_note(self.keep_fp8, fp8_weights, max_num_seqs)
        if note is not None:
            logger.info(note)
        if self.qsa is not None and self.spec.sliding_window is not None:
            # QSA's selection ranks every cached block; past a layer's window it would pick
            # blocks the model never attends to.
            raise ConfigError(f"QSA cannot serve a sliding-window model (layers "
                              f"{_layer_list(self.spec.sliding_layers)} attend to the last "
                              f"{self.spec.sliding_window} tokens only): drop qsa=")
        if self.qsa is not None:
            qsa_wiring.check_budget(self.qsa, self.max_model_len)
        if self.model_dir is not None:
            # Tensor-parallel workers never detokenize: rank 0 does.
            self.tokenizer = (None if tensor_parallel_size > 1 and _in_tp_worker()
                              else loader.load_tokenizer(self.model_dir))
        if chat_template is not None and self.tokenizer is not None:
            self.tokenizer.chat_template = loader.read_chat_template(chat_template)
        elif chat_template is not None and self.model_dir is None:
            raise ConfigError("chat_template: dummy models have no tokenizer")
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, self.dtype)
        _check_kv_scales_arg(kv_scales, self.kv_dtype, self.model_dir)
        if tensor_parallel_size > 1:
            from kvcap.distributed.launch import attach_llm

            self.tp = attach_llm(tensor_parallel_size, self.device, self.spec, self.model_dir,
                                 worker_args)
            self.device = self.tp.device
        try:
            self._build(kv_scales, kv_observer, attention_backend, enforce_eager, seed)
        except BaseException as e:
            if self.tp is None or not self.tp.is_driver:
                raise
            err = self.tp.fail(e)  # stops every rank; a dead worker's own story wins
            if err is e:
                raise
            raise err from e

    def _build(self, kv_scales, kv_observer, attention_backend: str, enforce_eager: bool,
               seed: int) -> None:
        mp = None
        if self.tp is not None:
            self.tp.comm.setup_allreduce(self.dtype)
            mp = self.tp.model_parallel(self.spec)
        max_num_seqs = self.config.max_num_seqs
        _check_kernel_head_dim(self.spec.head_dim, attention_backend, self.device)
        self.model, found_scales = load_model(self.spec, self.model_dir, self.device,
                                              self.dtype, dummy_seed=seed, tp=mp,
                                              keep_fp8=self.keep_fp8)
        backend = select_backend(attention_backend, self.device)
        # decode graphs get memory kept back from the KV budget only when they will be captured
        self._graphs_planned = (self.device.type == "cuda" and not enforce_eager
                                and not graphs_disabled()
                                and (self.qsa is None or qsa_wiring.path_graph_refusal(
                                    self.qsa.resolved_path(self.device.type)) is None))
        self._activation_bytes = self._profile_activations(backend)
        if self.qsa is not None:  # QSA's transient buffers (the profile runs dense)
            self._activation_bytes += qsa_wiring.qsa_activation_bytes(
                self.qsa, self.spec, self.config.max_num_batched_tokens, self.max_model_len)
        self.pool = self._make_pool()
        if self.kv_dtype == "fp8_e4m3":
            if self.tp is None:
                self._run_gate(found_scales, kv_scales)
            else:  # every rank runs the gate on its own copy; all must pass
                self.tp.agree(lambda: self._run_gate(found_scales, kv_scales))
        if self.kv_dtype == "fp8_e4m3" and backend.name == "triton" \
                and self.device.type == "cuda":
            from kvcap.kernels.common import hardware_e4m3_encode
            from kvcap.kernels.decode import fp8_decoders
            from kvcap.kernels.decoder_check import check_e4m3_decoders, check_e4m3_encoder

            # the E4M3 conversions this GPU will read the cache with, on all 256 codes, and
            # the hardware encoder its cache write uses on SM89+
            check_e4m3_decoders(self.device, set(fp8_decoders(self.device, backend.fp8_mode)))
            if hardware_e4m3_encode(self.device, backend.fp8_mode):
                check_e4m3_encoder(self.device)
        if self.keep_fp8 and self.device.type == "cuda":
            from kvcap.kernels.common import use_software_fp8
            from kvcap.kernels.decoder_check import check_e4m3_decoders

            # the conversion the FP8-weight GEMM decodes the weights with, on all 256 codes
            check_e4m3_decoders(self.device, {use_software_fp8(self.device)})

        if self.tp is not None and self.tp.is_driver:
            from kvcap.distributed.runner import DriverRunner

            self.runner = DriverRunner(self.model, backend, self.pool, self.device,
                                       driver=self.tp)
        else:
            self.runner = ModelRunner(self.model, backend, self.pool, self.device)
        self.runner.set_context_classes(self.max_model_len)
        if self.qsa is not None:  # before capture: the decode graphs record the QSA backend
            qsa_wiring.enable_qsa(self, self.qsa)
        self.runner.set_token_buckets(self.config.max_num_batched_tokens)  # after QSA's swap
        if self.tp is not None:
            # Every rank must pad a step to the same rows (its forward's all-reduces and
            # gathers), but the buckets follow this rank's parameter count, and uneven shards
            # can fall on both sides of a cap (a step past the lower cap then ran unpadded on
            # one rank and padded on another: a collective size mismatch). All take rank 0's:
            # it holds the largest shard, hence the lowest cap.
            self.runner.token_buckets = self.tp.comm.all_gather_object(
                self.runner.token_buckets)[0]
        no_graphs = qsa_wiring.graph_refusal(self.runner.backend)
        if self._graphs_planned and no_graphs is None:
            self.runner.enable_cuda_graphs(max_num_seqs, self.max_model_len,
                                           self.config.num_speculative_tokens,
                                           piecewise=self.tp is None)
        elif self.device.type == "cuda":
            logger.info("CUDA graphs off (%s): eager decode",
                        no_graphs or "enforce_eager / KVCAP_ENFORCE_EAGER=1")
        if kv_observer is not None:  # after capture: under TP this messages the workers
            self.set_kv_observer(kv_observer)
        released = self.pool.spec.released_window
        self.block_manager = BlockManager(self.pool.num_blocks, self.config.block_size,
                                          enable_prefix_caching=self.config.enable_prefix_caching,
                                          window=released)
        if self.spec.sliding_window is not None:
            logger.info("sliding-window attention: layers %s attend to the last %d tokens (%s)",
                        _layer_list(self.spec.sliding_layers), self.spec.sliding_window,
                        "blocks behind the window go back to the pool" if released else
                        "the full layers read every token: the cache keeps them all")
        eos = set(self.spec.eos_token_ids)
        eos.update(loader.read_generation_eos(self.model_dir, self.spec.vocab_size))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.config = dataclasses.replace(self.config, max_model_len=self.max_model_len)
        c = self.config
        proposer = (NgramProposer(c.num_speculative_tokens, c.prompt_lookup_max,
                                  c.prompt_lookup_min) if c.num_speculative_tokens else None)
        self.scheduler = Scheduler(c, self.block_manager, eos_token_ids=eos, proposer=proposer)
        if proposer is not None:
            logger.info("speculative decoding: prompt lookup, up to %d draft tokens per step "
                        "(n-grams %d..%d); steps with drafts run eager, without overlap",
                        c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max)
        self.runner.eos_token_ids = eos
        self.runner.tokenizer = self.tokenizer
        self.engine = Engine(self.runner, self.tokenizer, self.block_manager, self.scheduler,
                             self.max_model_len, seed=seed)

    # --- tensor parallelism -------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (no-op for a single-process LLM); idempotent."""
        if self.tp is not None and self.tp.is_driver:
            self.tp.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def collect_kv_stats(self, per_rank: bool = False):
        """Statistics of the last KVStatsObserver attached (also after detaching it), over every
        tensor-parallel rank: one merged KVStats, or with `per_rank=True` a list in rank order
        (None for ranks that record nothing)."""
        if self.tp is not None:
            return self.runner.collect_stats(per_rank)
        if not hasattr(self._observer_obj, "stats"):
            raise ConfigError("no KVStatsObserver was attached (set_kv_observer)")
        return [self._observer_obj.stats()] if per_rank else self._observer_obj.stats()

    # --- construction helpers ---------------------------------------------------------------
    def _kv_spec(self, kv_dtype: str) -> KVCacheSpec:
        """This rank's cache geometry (its KV heads only under tensor parallelism)."""
        cspec = KVCacheSpec.for_model(self.spec, self.config.block_size, kv_dtype)
        if self.qsa is not None:  # the indexer's FP16 side caches share the budget
            cspec = dataclasses.replace(cspec, side_bytes_per_token=qsa_wiring.
                                        qsa_side_bytes_per_token(self.qsa, self.spec,
                                                                 self.config.block_size))
        if self.tp is not None:
            cspec = dataclasses.replace(cspec, num_kv_heads=self.model.shard.num_kv_heads)
        return cspec

    def _pool_blocks(self, cspec: KVCacheSpec) -> int:
        """Blocks of this rank's pool: num_blocks as given, else what the KV budget holds."""
        if self.config.num_blocks is not None:
            return self._addressable(cspec, int(self.config.num_blocks))
        gib = self.config.kv_cache_memory_gib
        # the knob that set the budget (the CPU default always holds a block)
        knob = "kv_cache_memory_gib" if gib is not None else "gpu_memory_utilization"
        if gib is None:
            gib = self._default_kv_gib(cspec)
        # (kv_cache_memory_gib=1e300: gib * 2**30 is inf, and int() an OverflowError)
        budget = gib * 2**30
        budget = int(budget) if math.isfinite(budget) else 2**64
        num_blocks = cspec.num_blocks_for(budget)
        if num_blocks < 1:
            raise ConfigError(f"the KV cache budget ({budget / 2**20:.2f} MiB) holds no block "
                              f"({self.config.block_size} tokens x {cspec.bytes_per_token} B = "
                              f"{cspec.bytes_per_block / 2**20:.2f} MiB): raise {knob} or "
                              "lower block_size")
        return self._addressable(cspec, num_blocks)

    def _addressable(self, cspec: KVCacheSpec, num_blocks: int) -> int:
        """num_blocks, or the "does not fit" ConfigError for a pool past 2^63 bytes: torch
        cannot even describe its tensors (kv_cache_memory_gib=1e30 or num_blocks=2**63 was a
        TypeError from torch.zeros, num_blocks=2**62 "Storage size calculation overflowed",
        not the one-line error of a pool too large for memory)."""
        if (num_blocks + 1) * cspec.bytes_per_block >= 2**63:
            raise ConfigError(f"the KV cache ({num_blocks} blocks, "
                              f"{num_blocks * cspec.bytes_per_block / 2**30:.3g} GiB) does not "
                              f"fit in {self.device.type} memory: lower num_blocks or "
                              "kv_cache_memory_gib")
        return num_blocks

    def _make_pool(self) -> KVCachePool:
        cspec = self._kv_spec(self.kv_dtype)
        num_blocks = self._pool_blocks(cspec)
        if self.tp is not None:  # rank 0's block ids address every rank's pool
            num_blocks = self.tp.comm.min_int(num_blocks)
        need = self._longest_sequence_blocks(cspec)
        if num_blocks < need:
            logger.warning("KV pool holds %d tokens (%d blocks), fewer than the %d blocks a "
                           "max_model_len %d sequence needs: requests that need more are "
                           "refused; lower max_model_len or give the KV cache more memory",
                           num_blocks * self.config.block_size, num_blocks, need,
                           self.max_model_len)
        try:
            pool = KVCachePool(cspec, num_blocks, self.device)
        except RuntimeError as e:  # torch.OutOfMemoryError on CUDA, a plain one from the CPU's
            if not isinstance(e, torch.OutOfMemoryError) and "can't allocate" not in str(e):
                raise
            raise ConfigError(f"the KV cache ({num_blocks} blocks, "
                              f"{num_blocks * cspec.bytes_per_block / 2**30:.2f} GiB) does not "
                              f"fit in {self.device.type} memory: lower num_blocks or "
                              "kv_cache_memory_gib") from None
        # Max concurrency: the max_model_len sequences the scheduler runs at once, its
        # admission watermark counted (num_blocks // need promised one more than ran, e.g.
        # 2 for a pool of exactly two sequences that ran one after the other).
        logger.info("KV cache: %d tokens (%.2f GiB, %s, block size %d); max concurrency at %d "
                    "tokens: %d", pool.num_tokens, num_blocks * cspec.bytes_per_block / 2**30,
                    self.kv_dtype, self.config.block_size, self.max_model_len,
                    admissible_concurrency(num_blocks, need))
        return pool

    def _longest_sequence_blocks(self, cspec: KVCacheSpec) -> int:
        """Blocks a sequence at max_model_len holds at its peak (fewer than all of them when
        every layer slides and the blocks behind the window go back to the pool)."""
        return peak_blocks(self.max_model_len, self.config.block_size, cspec.released_window,
                           self.config.max_num_batched_tokens)

    def _default_kv_gib(self, cspec: KVCacheSpec) -> float:
        if self.device.type != "cuda":
            # Whole blocks for one max_model_len sequence: its bytes alone, floored to blocks,
            # left the pool a block short when max_model_len is not a multiple of block_size.
            blocks = self._longest_sequence_blocks(cspec)
            return max(CPU_DEFAULT_KV_GIB, blocks * cspec.bytes_per_block / 2**30)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free  # weights, the CUDA context, other processes
        graphs = CUDA_GRAPH_RESERVE_BYTES if self._graphs_planned else 0
        budget = total * self.config.gpu_memory_utilization - used_by_others
        budget -= self._activation_bytes + graphs
        logger.info("KV budget: %.2f GiB = %.0f%% of %.1f GiB - %.2f GiB in use - %.2f GiB peak "
                    "activations - %.2f GiB graphs", budget / 2**30,
                    100 * self.config.gpu_memory_utilization, total / 2**30,
                    used_by_others / 2**30, self._activation_bytes / 2**30, graphs / 2**30)
        if budget <= 0:
            raise ConfigError("no GPU memory left for the KV cache; lower max_num_batched_tokens "
                              "or raise gpu_memory_utilization")
        return budget / 2**30

    @torch.inference_mode()
    def _profile_activations(self, backend: AttentionBackend) -> int:
        """Peak activation bytes of the largest step (a warm-up: no observer sees it)."""
        if self.device.type != "cuda":
            return 0
        from kvcap.attention.metadata import AttentionMetadata
        from kvcap.models.llama import ForwardContext

        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        bs = self.config.block_size
        cspec = self._kv_spec(resolve_kv_dtype("auto", self.dtype))
        tmp = KVCachePool(cspec, -(-n // bs), self.device)
        meta = AttentionMetadata.build([n], [n], [list(range(-(-n // bs)))], bs, self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.arange(n, device=self.device)
        hidden = self.model(ids, pos, ForwardContext(backend, tmp, meta))
        self.model.compute_logits(hidden[: self.config.max_sample_rows])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del tmp, hidden
        torch.cuda.empty_cache()
        return int(peak)

    def _run_gate(self, found: dict[str, torch.Tensor], kv_scales) -> None:
        from kvcap.scales.gate import run_gate

        if kv_scales is not None and found:
            raise ScaleGateError("the checkpoint already carries K/V scales and kv_scales was "
                                 "given too; use one source")
        if isinstance(kv_scales, Mapping):
            found = {}
            for k, v in kv_scales.items():
                found[k] = _programmatic_scale(v)
                if found[k] is None:
                    raise ScaleGateError(f"kv_scales[{k!r}] = {v!r} is not a number or a "
                                         "float tensor")
            source = "programmatic scales"
        elif kv_scales is not None:  # (on a real checkpoint: _check_kv_scales_arg)
            from kvcap.scales.overlay import describe_scale_source, load_overlay_scales

            found = load_overlay_scales(self.model_dir, Path(kv_scales))
            source = describe_scale_source(kv_scales).replace("checkpoint", "overlay pack", 1)
        elif self.model_dir is None:
            source = "dummy weights (no checkpoint)"
        else:
            from kvcap.scales.overlay import describe_scale_source

            source = describe_scale_source(self.model_dir)
        k, v = run_gate(self.spec, found, source)
        self.pool.set_scales(k, v, source)

    @staticmethod
    def _observer_fn(obs):
        if obs is None:
            return None
        return obs.observe if hasattr(obs, "observe") else obs

    def set_kv_observer(self, obs) -> None:
        if obs is not None and not callable(getattr(obs, "observe", obs)):
            # (was a TypeError from inside the next forward)
            raise ConfigError(f"a KV observer must have an observe(layer, k, v) method or be "
                              f"callable, got {type(obs).__name__}")
        if obs is not None:
            self._observer_obj = obs
        if self.tp is not None:  # every rank records its own KV heads (DriverRunner)
            self.runner.set_observer(obs)
        else:
            self.runner.kv_observer = self._observer_fn(obs)

    # --- generation -------------------------------------------------------------------------
    def _to_token_ids(self, prompts) -> list[list[int]]:
        """A text, one token-id list, or a list of texts and token-id lists -> id lists; as
        in vLLM, a prompt may also be {"prompt": text} or {"prompt_token_ids": ids}. Any
        other shape is refused by name (bytes were read as ids, floats truncated to them)."""
        if isinstance(prompts, torch.Tensor) or type(prompts).__module__ == "numpy":
            raise ConfigError(f"prompts: a {type(prompts).__name__}; pass token ids as a list "
                              "of ints (.tolist())")
        if isinstance(prompts, (str, Mapping)) or (_is_seq(prompts) and prompts
                                                   and is_integral(prompts[0])):
            prompts = [prompts]
        if not _is_seq(prompts):
            raise ConfigError(f"prompts must be a string, a list of token ids, or a list of "
                              f"strings and token-id lists, got {_describe(prompts)}")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, Mapping):
                p = _unwrap_prompt(p, i)
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ConfigError("dummy models have no tokenizer: pass token ids")
                check_text(p, f"prompt {i}")
                out.append(encode_prompt(self.tokenizer, p))
            elif (tok := _ids_of(p)) is not None:
                out.append(tok)
            else:
                raise ConfigError(f"prompt {i} must be a string or a list of integer token "
                                  f"ids, got {_describe(p)}")
        return out

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, want_prompt_logits: bool = False
                 ) -> list[RequestOutput]:
        ids = self._to_token_ids(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if _is_seq(params) else [params] * len(ids)
        if len(plist) != len(ids):
            raise ConfigError(f"{len(ids)} prompts but {len(plist)} SamplingParams")
        for p in plist:  # (a dict was an AttributeError from inside the engine)
            if not isinstance(p, SamplingParams):
                raise ConfigError(f"params must be a SamplingParams or a list of them, one per "
                                  f"prompt, got {type(p).__name__}")
        rids = [f"gen-{uuid.uuid4().hex[:12]}" for _ in ids]
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm or len(ids) < 2)
        try:
            for i, (rid, tok, p) in enumerate(zip(rids, ids, plist, strict=True)):
                try:  # a refused prompt aborts those queued before it (they ran in the next call)
                    self.engine.add_request(rid, tok, p, want_prompt_logits=want_prompt_logits,
                                            stream=False)  # only the final outputs are read
                except ConfigError as e:
                    if len(ids) == 1:
                        raise
                    raise ConfigError(f"prompt {i}: {e}") from None
            mine = set(rids)  # (a step also reports requests an earlier call aborted)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished and out.request_id in mine:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in rids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in rids]

    def chat(self, messages, params: SamplingParams | None = None, use_tqdm: bool = True
             ) -> list[RequestOutput]:
        """messages: one conversation (list of {role, content}) or a list of them, as the
        server's chat route takes them (text content parts, `developer`, tool calls with JSON
        arguments); other keys of a message reach the chat template as given."""
        if self.tokenizer is None:
            raise ConfigError("dummy models have no tokenizer or chat template")
        if not _is_seq(messages):
            raise ConfigError(f"chat: messages must be a list of {{'role', 'content'}} dicts "
                              f"(or a list of such lists), got {type(messages).__name__}")
        convs = [messages] if messages and isinstance(messages[0], Mapping) else messages
        for c in convs:  # (a string was transformers' TypeError from inside the template)
            if not _is_seq(c) or not all(isinstance(m, Mapping) for m in c):
                raise ConfigError("chat: each message must be a {'role', 'content'} dict and a "
                                  "conversation a list of them, got "
                                  f"{c!r}"[:200])
        # the server's messages work here too: text parts, `developer`, tool calls' JSON
        # arguments; all checked before the first conversation renders
        norm = []
        for k, c in enumerate(convs):
            try:
                norm.append(chat_messages(c))
            except ConfigError as e:
                raise ConfigError(f"chat: conversation {k}: {e}" if len(convs) > 1
                                  else f"chat: {e}") from None
        ids = [self._template_ids(c) for c in norm]
        return self.generate(ids, params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation) -> list[int]:
        """The prompt ids `chat` generates from for one conversation. It reads the messages as
        `chat` does (text content parts, `developer`, tool calls' JSON arguments): it rendered
        them raw, so content parts were refused and `developer` reached the template as an
        unknown role -- other ids than `chat` and the server sent the model."""
        if self.tokenizer is None:
            raise ConfigError("chat: dummy models have no tokenizer; pass token ids to generate")
        if not _is_seq(conversation) or not all(isinstance(m, Mapping) for m in conversation):
            raise ConfigError("chat: a conversation must be a list of {'role', 'content'} "
                              f"dicts, got {conversation!r}"[:200])
        return self._template_ids(chat_messages(conversation))

    def _template_ids(self, conversation: list[dict]) -> list[int]:
        """A conversation already read by chat_messages, through the chat template."""
        if self.tokenizer is None:
            raise ConfigError("chat: dummy models have no tokenizer; pass token ids to generate")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"chat: the tokenizer of {self.model_dir} has no chat template (a "
                              "base model?); give one with chat_template= (--chat-template "
                              "FILE), or send plain text without --chat")
        try:
            return chat_ids(self.tokenizer, conversation, add_generation_prompt=True)
        except TemplateRefused as e:
            raise ConfigError(f"chat: the chat template refused the conversation: {e}"
                              ) from None

    def prompt_logits(self, prompts: Sequence[Sequence[int]], use_tqdm: bool = False
                      ) -> list[torch.Tensor]:
        """Teacher-forced logits [T_i, V] (FP32, CPU) at every prompt position."""
        ids = [_ids_of(p) for p in prompts] if _is_seq(prompts) else [None]
        if None in ids:  # (a text was a ValueError from int('h'), flat ids a TypeError)
            raise ConfigError("prompt_logits takes a list of token-id lists (encode text "
                              f"first), got {_describe(prompts)}")
        outs = self.generate(ids, SamplingParams(max_tokens=1, temperature=0.0),
                             use_tqdm=use_tqdm, want_prompt_logits=True)
        return [o.prompt_logits for o in outs]


def _programmatic_scale(v) -> torch.Tensor | None:
    """A kv_scales value as an FP32 tensor, or None where it is no scale: a bool or an integer
    tensor (True became 1.0, the unit scale the gate exists to refuse), a string (a TypeError
    from inside torch) or any other non-number."""
    number = v.is_floating_point() if isinstance(v, torch.Tensor) else \
        isinstance(v, numbers.Real) and not isinstance(v, bool)
    if not number:
        return None
    try:
        return torch.as_tensor(v, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        return None


def _unwrap_prompt(prompt: Mapping, i: int):
    """vLLM's dict prompts: {"prompt": text} or {"prompt_token_ids": ids}, and nothing else
    (multimodal data, a cache salt ... would be dropped without a word)."""
    keys = set(prompt)
    kind = {"prompt", "prompt_token_ids"} & keys
    if len(kind) != 1 or keys - kind:
        raise ConfigError(f"prompt {i}: a dict prompt takes one key, 'prompt' (a text) or "
                          f"'prompt_token_ids' (a list of token ids), got keys "
                          f"{sorted(map(str, keys))}")
    (key,) = kind
    value = prompt[key]
    if (key == "prompt") != isinstance(value, str):  # (a text under prompt_token_ids, ...)
        raise ConfigError(f"prompt {i}: {key} must be "
                          f"{'a string' if key == 'prompt' else 'a list of integer token ids'}"
                          f", got {_describe(value)}")
    return value


def _check_kv_scales_arg(kv_scales, kv_dtype: str, model_dir: Path | None) -> None:
    """What can be said of kv_scales before the weights load (minutes for a large model, and
    the workers started under tensor parallelism): these were refused only after the load and
    the KV pool's allocation, and a scale argument of the wrong type was a TypeError from
    inside pathlib there."""
    if kv_scales is None:
        return
    if not isinstance(kv_scales, (str, os.PathLike, Mapping)):
        raise ConfigError(f"kv_scales must be an overlay pack directory or a dict of scale "
                          f"name -> scale, got {type(kv_scales).__name__}")
    if kv_dtype != "fp8_e4m3":
        raise ConfigError(f"kv_scales were given but kv_cache_dtype is {kv_dtype}; pass "
                          "kv_cache_dtype='fp8_e4m3' to use them")
    if model_dir is None and not isinstance(kv_scales, Mapping):
        raise ConfigError("a scale overlay needs a real checkpoint, not dummy weights")
    if not isinstance(kv_scales, Mapping):
        from kvcap.scales.overlay import read_manifest

        # a missing folder or one that is no overlay pack (a typo, the base itself) was found
        # out by the gate after the load; its binding to the base is still checked there
        read_manifest(Path(kv_scales))


def _in_tp_worker() -> bool:
    from kvcap.distributed.launch import in_worker_process

    return in_worker_process()
