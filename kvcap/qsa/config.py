"""QSA configuration: which layers are sparse, the group size and budget, the indexer source.

QSA (query-aware sparse attention, SYSTEM.md §6): every query row of a QSA layer reads only
`topk_groups` groups of `compress_ratio` tokens chosen by an indexer, plus the 0..ratio-1
tokens of its open tail group. Dense layers are untouched. `KVCAP_DISABLE_QSA=1` turns every
layer back to dense attention at the next forward (the rollback switch).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcap.config import env_flag, is_int
from kvcap.errors import ConfigError

ENV_DISABLE_QSA = "KVCAP_DISABLE_QSA"

LAYER_RULES = ("every_nth", "all_but_first", "explicit")
INDEXERS = ("trained", "training_free")
SUMMARIES = ("mean", "minmax")
HEAD_REDUCTIONS = ("sum", "max")
PATHS = ("auto", "torch", "triton")


def qsa_disabled() -> bool:
    """True when `KVCAP_DISABLE_QSA` is set to a true value (read at every forward)."""
    return env_flag(ENV_DISABLE_QSA)


@dataclass(frozen=True)
class QSAConfig:
    """Frozen QSA settings; `validate()` fails closed with a ConfigError.

    layer_rule:   "every_nth"     layers n-1, 2n-1, ... (every_n = 4: 3, 7, 11, ...)
                  "all_but_first" every layer from `first_dense` on
                  "explicit"      exactly `layers`
    compress_ratio: tokens per group (4); the cache block size must be a multiple of it.
    topk_groups:  groups selected per query row (512 -> a 2,048-token budget).
    include_tail: attend to the open tail group's 0..ratio-1 tokens (the causal tail rule;
                  required for ratio > 1: it holds the row's own token).
    indexer:      "trained" (index q/k projections of the checkpoint; needs a model that
                  passes them, see kvcap.qsa.model) or "training_free" (the layer's own keys
                  summarised per group and KV head, scored with the layer's own queries).
    summary:      training-free group summary: "mean" key or "minmax" bound keys.
    head_reduce:  training-free: how a KV head's query heads combine ("sum" or "max").
    side_dtype:   "fp16" | "bf16" storage of the indexer caches (never quantized).
    path:         "torch" reference, "triton" kernels, or "auto" (triton on CUDA).
    """

    layer_rule: str = "every_nth"
    every_n: int = 4
    first_dense: int = 2
    layers: tuple[int, ...] = ()
    compress_ratio: int = 4
    topk_groups: int = 512
    include_tail: bool = True
    indexer: str = "training_free"
    summary: str = "mean"
    head_reduce: str = "sum"
    side_dtype: str = "fp16"
    path: str = "auto"

    def resolved_path(self, device_type: str) -> str:
        """`path` on a device of that type: "auto" is triton on CUDA, torch elsewhere."""
        if self.path == "auto":
            return "triton" if device_type == "cuda" else "torch"
        return self.path

    @property
    def token_budget(self) -> int:
        return self.topk_groups * self.compress_ratio

    @property
    def width(self) -> int:
        """Selected-token row width: budget plus the open tail (reference: 2,051)."""
        return self.token_budget + (self.compress_ratio - 1 if self.include_tail else 0)

    def validate(self) -> QSAConfig:
        # sizes and layer ids are used as tensor shapes and ranges: a float or a string would
        # otherwise fail deep inside the first forward
        for name in ("every_n", "first_dense", "compress_ratio", "topk_groups"):
            if not is_int(getattr(self, name)):
                raise ConfigError(f"QSA {name} must be an integer, got "
                                  f"{getattr(self, name)!r}")
        if not isinstance(self.include_tail, bool):  # ("no" is truthy)
            raise ConfigError(f"QSA include_tail must be true or false, got "
                              f"{self.include_tail!r}")
        if not isinstance(self.layers, (tuple, list)) or not all(map(is_int, self.layers)):
            raise ConfigError(f"QSA layers must be a tuple of layer indices, got "
                              f"{self.layers!r}")
        if self.layers and self.layer_rule != "explicit":
            raise ConfigError(f"QSA layers={tuple(self.layers)} is only read with "
                              f"layer_rule='explicit' (layer_rule is {self.layer_rule!r}): "
                              "pass layer_rule='explicit' or drop layers")
        if not self.include_tail and self.compress_ratio > 1:
            # without the open tail a row never attends to its own token, and rows before the
            # first complete group attend to nothing (softmax over no key: NaN)
            raise ConfigError("QSA include_tail=False drops each row's own token (the first "
                              f"{self.compress_ratio - 1} positions attend to nothing): keep "
                              "include_tail=True")
        if self.layer_rule not in LAYER_RULES:
            raise ConfigError(f"QSA layer_rule {self.layer_rule!r} is not one of {LAYER_RULES}")
        if self.indexer not in INDEXERS:
            raise ConfigError(f"QSA indexer {self.indexer!r} is not one of {INDEXERS}")
        if self.summary not in SUMMARIES:
            raise ConfigError(f"QSA summary {self.summary!r} is not one of {SUMMARIES}")
        if self.head_reduce not in HEAD_REDUCTIONS:
            raise ConfigError(f"QSA head_reduce {self.head_reduce!r} is not one of "
                              f"{HEAD_REDUCTIONS}")
        if self.side_dtype not in ("fp16", "bf16"):
            raise ConfigError(f"QSA side_dtype must be fp16 or bf16, got {self.side_dtype!r}")
        if self.path not in PATHS:
            raise ConfigError(f"QSA path {self.path!r} is not one of {PATHS}")
        if self.compress_ratio < 1 or self.compress_ratio & (self.compress_ratio - 1):
            raise ConfigError(f"QSA compress_ratio must be a power of two, got "
                              f"{self.compress_ratio}")
        if self.topk_groups < 1:
            raise ConfigError(f"QSA topk_groups must be >= 1, got {self.topk_groups}")
        if self.every_n < 1 or self.first_dense < 0:
            raise ConfigError("QSA every_n must be >= 1 and first_dense >= 0")
        if self.layer_rule == "explicit" and not self.layers:
            raise ConfigError("QSA layer_rule 'explicit' needs a non-empty `layers`")
        return self

    def qsa_layers(self, num_layers: int) -> tuple[int, ...]:
        """The sorted layer indices that run QSA in a model of `num_layers` layers."""
        if self.layer_rule == "every_nth":
            out = tuple(range(self.every_n - 1, num_layers, self.every_n))
        elif self.layer_rule == "all_but_first":
            out = tuple(range(self.first_dense, num_layers))
        else:
            bad = [i for i in self.layers if not 0 <= i < num_layers]
            if bad:
                raise ConfigError(f"QSA layers {bad} are outside 0..{num_layers - 1}")
            out = tuple(sorted(set(self.layers)))
        if not out:
            raise ConfigError(f"QSA config selects no layer of a {num_layers}-layer model")
        return out

    def check_block_size(self, block_size: int) -> None:
        if block_size % self.compress_ratio:
            raise ConfigError(f"cache block size {block_size} is not a multiple of the QSA "
                              f"compress ratio {self.compress_ratio}")
