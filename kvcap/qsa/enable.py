"""Turn QSA on for a built `LLM`: wrap its backend and allocate side caches sized to its pool.

Capacity planning. The side caches cost, per token slot of the pool (all QSA layers):
    side_bytes_per_token = ceil(L_qsa * (R + rows * bs/R) * Hk * dk * 2 / bs)
(`qsa_side_bytes_per_token`; rows = 2 for the min/max summary, else 1; Hk x dk = 1 x d_index
for a trained indexer, Hkv x head_dim for the training-free one). The planner must add it to
`KVCacheSpec.side_bytes_per_token` *before* sizing the pool; `LLM` builds its pool before QSA
exists, so `enable_qsa` allocates the side caches on top of the planned budget and logs how
much that is (the needed change in kvcap/llm.py is to accept a QSAConfig and pass this value
into `KVCacheSpec` in `_kv_spec`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvcap.errors import ConfigError
from kvcap.qsa.backend import QSABackend
from kvcap.qsa.config import QSAConfig
from kvcap.qsa.indexer import QSASideCaches, side_bytes_per_token

if TYPE_CHECKING:
    from kvcap.config import ModelSpec
    from kvcap.llm import LLM

logger = logging.getLogger(__name__)

_SIDE_DTYPES = {"fp16": 2, "bf16": 2}


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

    config.validate()
    if config.indexer != "training_free":
        raise ConfigError("enable_qsa serves llama-family checkpoints, which have no trained "
                          "indexer: use indexer='training_free' (kvcap.qsa.model builds a "
                          "model with a trained indexer)")
    if getattr(llm, "tp", None) is not None:
        raise ConfigError("QSA with tensor parallelism is not supported yet")
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
    extra = side.bytes_per_token * pool.num_tokens
    logger.info("QSA side caches: %d B/token on top of %d B/token of K/V (%.3f GiB over the "
                "planned KV budget; the planner does not count them yet)",
                side.bytes_per_token, cspec.bytes_per_token, extra / 2**30)
    if llm.runner.graphs is not None:
        llm.runner.graphs = None
        llm.runner.enable_cuda_graphs(llm.config.max_num_seqs, llm.max_model_len)
    return backend


def disable_qsa(llm: LLM) -> None:
    """Restore the wrapped backend (the side caches are dropped)."""
    backend = llm.runner.backend
    if isinstance(backend, QSABackend):
        llm.runner.backend = backend.inner
        if llm.runner.graphs is not None:
            llm.runner.graphs = None
            llm.runner.enable_cuda_graphs(llm.config.max_num_seqs, llm.max_model_len)
