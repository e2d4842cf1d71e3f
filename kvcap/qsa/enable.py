"""Turn QSA on for an `LLM`: presets, capacity planning, and the backend swap.

`LLM(qsa=...)` (kvcap/llm.py) calls three things from here, in this order:
  resolve_qsa(value, tp)        None | QSAConfig | preset string -> QSAConfig or None; refuses
                                tensor parallelism before any worker starts;
  qsa_side_bytes_per_token(...) added to `KVCacheSpec.side_bytes_per_token` *before* the pool
                                is sized (explicit num_blocks, kv_cache_memory_gib, and the GPU
                                profiled budget all go through `LLM._kv_spec`), and
                                qsa_activation_bytes(...) added to the profiled activation peak
                                (check_budget first: no budget past the context);
  enable_qsa(llm, cfg)          after the runner exists and before CUDA-graph capture, so the
                                decode graphs record the QSA backend (`graph_refusal` says when
                                they cannot: the torch path reads host-side lengths).
Side bytes per token slot (all QSA layers):
    side_bytes_per_token = ceil(L_qsa * (R + rows * bs/R) * Hk * dk * 2 / bs)
(rows = 2 for the min/max summary, which needs no ring; Hk x dk = 1 x d_index for a trained
indexer, Hkv x head_dim for the training-free one). `enable_qsa` on an already-built LLM
(tests, benches) still works: its side caches then sit on top of the planned budget.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from kvcap.errors import ConfigError
from kvcap.qsa.backend import SCORE_WORKSPACE_BYTES, QSABackend
from kvcap.qsa.config import QSAConfig
from kvcap.qsa.indexer import QSASideCaches, side_bytes_per_token

if TYPE_CHECKING:
    from kvcap.config import ModelSpec
    from kvcap.llm import LLM

logger = logging.getLogger(__name__)

_SIDE_DTYPES = {"fp16": 2, "bf16": 2}

DEFAULT_BUDGET = 2048  # tokens per query row (512 groups of 4), SYSTEM.md §6
PRESET_HELP = ("QSA preset: 'every<N>' (every Nth layer, e.g. every4) or 'all-but-<N>' (every "
               "layer after the first N, e.g. all-but-2), optionally ':<tokens>' for the "
               f"budget (a multiple of 4, at most the context or {DEFAULT_BUDGET}; default "
               f"{DEFAULT_BUDGET}, e.g. every4:1024); "
               "training-free indexer, min/max group bounds")
# ASCII digits only: \d alone took any Unicode digit (Arabic-Indic "every\u0664", full-width
# "every\uff14:\uff11\uff10\uff12\uff14" were read as every4 / every4:1024), outside the grammar
_PRESET = re.compile(r"^(?:every(\d+)|all-but-(\d+))(?::(\d+))?$", re.ASCII)


def parse_preset(name: str) -> QSAConfig:
    """A preset string -> the training-free QSAConfig it names (see PRESET_HELP). The
    presets use the design chosen by measured recall (docs/qsa.md): min/max bound keys per
    group, query heads summed per KV head."""
    m = _PRESET.match(name.strip().lower())
    budget = int(m.group(3)) if m and m.group(3) else DEFAULT_BUDGET
    if m is None or budget < 4 or budget % 4 or (m.group(1) and int(m.group(1)) < 1):
        raise ConfigError(f"bad QSA preset {name!r}; {PRESET_HELP}")
    rule = (dict(layer_rule="every_nth", every_n=int(m.group(1))) if m.group(1) else
            dict(layer_rule="all_but_first", first_dense=int(m.group(2))))
    return QSAConfig(**rule, topk_groups=budget // 4, summary="minmax", head_reduce="sum")


def resolve_qsa(value: QSAConfig | str | None, tensor_parallel_size: int = 1
                ) -> QSAConfig | None:
    """`LLM(qsa=value)` -> a validated QSAConfig (or None: dense attention)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = parse_preset(value)
    if not isinstance(value, QSAConfig):
        raise ConfigError(f"qsa must be None, a QSAConfig or a preset string, got "
                          f"{type(value).__name__}; {PRESET_HELP}")
    if tensor_parallel_size > 1:
        raise ConfigError("QSA does not support tensor parallelism yet: pass "
                          "tensor_parallel_size=1 or drop qsa=")
    return _check_servable(value)


def _check_servable(config: QSAConfig) -> QSAConfig:
    if config.validate().indexer != "training_free":
        raise ConfigError("LLM QSA serves llama-family checkpoints, which have no trained "
                          "indexer: use indexer='training_free' (kvcap.qsa.model builds a "
                          "model with a trained indexer)")
    return config


def check_budget(config: QSAConfig, max_model_len: int) -> None:
    """Refuse a budget past the context. A row never sees more than `max_model_len` tokens,
    so a larger budget selects nothing more, while the selection rows (int32 [tokens, heads,
    budget]) and the activation reserve grow with it (every4:4000000 reserved terabytes).
    Budgets up to DEFAULT_BUDGET pass at any context, so the presets run on short models."""
    r = config.compress_ratio
    limit = max(max_model_len, DEFAULT_BUDGET) // r  # groups
    if config.topk_groups > limit:
        raise ConfigError(f"QSA budget {config.token_budget} tokens ({config.topk_groups} "
                          f"groups of {r}) exceeds the context (max_model_len "
                          f"{max_model_len}), where it selects every token anyway: use at "
                          f"most {limit * r} tokens (topk_groups <= {limit})")


def qsa_activation_bytes(config: QSAConfig, spec: ModelSpec, max_num_batched_tokens: int,
                         max_model_len: int) -> int:
    """Upper bound of one QSA layer's transient buffers in the largest step, for the GPU
    activation budget (the profiling forward is dense and short, so it does not see them):
    FP32 scores (capped by SCORE_WORKSPACE_BYTES) + half as much for the two-stage top-k
    candidates + the int32 selected-token rows."""
    heads = 1 if config.indexer == "trained" else spec.num_kv_heads
    groups = max(max_model_len // config.compress_ratio, 1)
    scores = min(SCORE_WORKSPACE_BYTES, 4 * max_num_batched_tokens * heads * groups)
    return scores + scores // 2 + 4 * max_num_batched_tokens * heads * config.width


def graph_refusal(backend) -> str | None:
    """Why decode CUDA graphs cannot record `backend` (None: they can)."""
    return path_graph_refusal(backend.path) if isinstance(backend, QSABackend) else None


def path_graph_refusal(path: str) -> str | None:
    """graph_refusal of a QSA backend on that (resolved) path: known before the backend
    exists, so the KV budget keeps memory for graphs only where they will be captured."""
    if path == "torch":
        return ("the QSA torch path reads host-side sequence lengths, which a CUDA graph "
                "would freeze; use QSAConfig(path='triton' or 'auto') for graphs")
    return None


def qsa_side_bytes_per_token(config: QSAConfig, spec: ModelSpec, block_size: int,
                             index_dim: int = 128) -> int:
    """Side-cache bytes per token slot for `spec` under `config` (see the module docstring)."""
    config.validate().check_block_size(block_size)
    n = len(config.qsa_layers(spec.num_layers))
    if config.indexer == "trained":
        heads, dim = 1, index_dim
    else:
        heads, dim = spec.num_kv_heads, spec.head_dim
    return side_bytes_per_token(n, heads, dim, config.compress_ratio, block_size,
                                _SIDE_DTYPES[config.side_dtype],
                                bounds=config.indexer == "training_free"
                                and config.summary == "minmax")


def enable_qsa(llm: LLM, config: QSAConfig) -> QSABackend:
    """Swap `llm.runner.backend` for a QSABackend (training-free indexer: llama-family
    checkpoints carry no index projections). Re-captures decode CUDA graphs if they exist."""
    import torch

    _check_servable(config)
    if getattr(llm, "tp", None) is not None:
        raise ConfigError("QSA with tensor parallelism is not supported yet")
    if llm.spec.sliding_window is not None:  # as LLM(qsa=...) refuses it
        raise ConfigError(f"QSA cannot serve a sliding-window model (it attends to the last "
                          f"{llm.spec.sliding_window} tokens only): use a dense LLM")
    if llm.config.num_speculative_tokens:  # as LLM(qsa=...) refuses it
        # the side caches fold in every key a verify step writes: a rejected draft's key
        # stays in its group's bounds / ring, and later selections differ from plain decode
        raise ConfigError("speculative decoding (num_speculative_tokens) cannot run with "
                          "QSA: its indexer caches would keep the keys of rejected drafts; "
                          "use one or the other")
    check_budget(config, llm.max_model_len)
    pool = llm.pool
    cspec = pool.spec
    config.check_block_size(cspec.block_size)
    layers = config.qsa_layers(llm.spec.num_layers)
    inner = llm.runner.backend
    if isinstance(inner, QSABackend):
        inner = inner.inner
    dtype = torch.float16 if config.side_dtype == "fp16" else torch.bfloat16
    side = QSASideCaches(layers, pool.num_blocks, cspec.block_size, config.compress_ratio,
                         cspec.num_kv_heads, cspec.head_dim, dtype, pool.device,
                         bounds=config.summary == "minmax")
    backend = QSABackend(inner, config, side, pool.device)
    llm.runner.backend = backend
    # Blocks already in the prefix cache have no rows in these new side caches (a hit would
    # select from zeros) and hold deeper layers' K/V computed by another attention: drop them.
    _reset_prefix_cache(llm)
    gib = side.bytes_per_token * pool.num_tokens / 2**30
    if cspec.side_bytes_per_token >= side.bytes_per_token:
        logger.info("QSA side caches: %d B/token (%.3f GiB), counted in the KV budget",
                    side.bytes_per_token, gib)
    else:
        logger.info("QSA side caches: %d B/token (%.3f GiB) on top of the planned KV budget "
                    "(LLM(qsa=...) counts them)", side.bytes_per_token, gib)
    _recapture(llm)
    return backend


def _reset_prefix_cache(llm: LLM) -> None:
    block_manager = getattr(llm, "block_manager", None)  # LLM(qsa=...) gets here before it
    if block_manager is not None:
        block_manager.reset_prefix_cache()


def _recapture(llm: LLM) -> None:
    """Re-record existing decode (and piecewise) graphs with the current backend, or drop
    them if it cannot be recorded."""
    if llm.runner.graphs is None:
        return
    llm.runner.graphs = None
    # The piecewise (prefill / mixed step) graphs hold the backend they were captured with and
    # call it for every attention: left in place when the new backend cannot be recorded, they
    # ran prefill through the old one (QSA's side rows never written, or QSA never left).
    llm.runner.piecewise = None
    reason = graph_refusal(llm.runner.backend)
    if reason:
        logger.info("CUDA graphs off (%s): eager decode", reason)
    else:
        llm.runner.enable_cuda_graphs(llm.config.max_num_seqs, llm.max_model_len)


def disable_qsa(llm: LLM) -> None:
    """Restore the wrapped backend (the side caches and the prefix cache are dropped)."""
    backend = llm.runner.backend
    if isinstance(backend, QSABackend):
        llm.runner.backend = backend.inner
        _reset_prefix_cache(llm)  # cached blocks hold K/V computed through QSA layers
        _recapture(llm)
