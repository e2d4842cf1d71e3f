"""Frozen configuration objects. Every user-facing value is validated here, failing closed."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvcap.errors import ConfigError
from kvcap.models.fp8_weights import FP8Weights, read_weight_quant

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # Phi-3 / Phi-4: Llama's layers with q/k/v and gate/up stored fused (models/phi3.py)
    "Phi3ForCausalLM": "phi3",
}
# transformers' defaults for what a config.json may leave out (its LlamaConfig, MistralConfig,
# ... classes): a missing rms_norm_eps read as another architecture's moves every logit
# What transformers' config classes take for a key config.json leaves out (a key present as
# null is another matter: num_key_value_heads null means one KV head per query head).
# num_key_value_heads None: as many as the query heads.
CONFIG_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
              "num_key_value_heads": None, "sliding_window": None},
    "mistral": {"rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
                "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
              "num_key_value_heads": 32, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
              "num_key_value_heads": 32, "sliding_window": 4096, "max_window_layers": 28,
              "head_dim": 128},
    "phi3": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
             "num_key_value_heads": None, "sliding_window": None},
}


def is_int(v) -> bool:
    """An int and not a bool (True is an int to Python: top_k=True would mean top_k=1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_integral(v) -> bool:
    """An integer of any integral type (numpy's too) and not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_number(v) -> bool:
    """An int or a float and not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def env_flag(name: str) -> bool:
    """True when environment variable `name` holds a true value: anything but unset, "", "0",
    "false" or "no" (any case). Switches are read at each use, so tests can flip them.
    (kvcap.kernels.common keeps its own copy: kernels import nothing else of kvcap.)"""
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no")


def env_rows(name: str, default: int) -> int:
    """A row-count switch (for measurements): environment variable `name` as an integer >= 0
    (a negative one reads as 0), `default` when unset or blank; a ValueError naming it when it
    is not an integer. (kvcap.kernels.common.pdl_max_rows keeps its own copy, as for
    env_flag.)"""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer row count") from None


KV_CACHE_DTYPES = ("auto", "fp16", "bf16", "fp32", "fp8_e4m3")
_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_KV_TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts kvcap needs, read from a HF `config.json`."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES' values
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    layer_prefix: str = "model.layers"
    eos_token_ids: tuple[int, ...] = ()
    # The attention window of the model's sliding-window layers (None: every layer attends to
    # the whole context) and which layers slide: a query at position p of such a layer sees
    # positions p - sliding_window + 1 .. p (transformers' sliding_window_overlay).
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # Linear weights stored in FP8 (E4M3) with scales (fp8_weights.py): kept as FP8 or
    # dequantized at load per LLM(fp8_weights=...), whose "auto" keeps them on CUDA sm_80+.
    fp8_weights: FP8Weights | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelSpec:
        archs = cfg.get("architectures") or []
        if isinstance(archs, str):  # one name, not a list of them
            archs = [archs]
        known = [SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES]
        arch = known[0] if known else None
        if arch is None:
            model_type = cfg.get("model_type")
            by_type = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                       "phi3": "phi3"}
            arch = by_type.get(model_type)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}: kvcap supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        fp8_weights = read_weight_quant(cfg.get("quantization_config"))
        defaults = CONFIG_DEFAULTS[arch]
        try:
            num_heads = _positive_int("num_attention_heads", cfg["num_attention_heads"])
            hidden = _positive_int("hidden_size", cfg["hidden_size"])
            num_layers = _positive_int("num_hidden_layers", cfg["num_hidden_layers"])
            # absent: the config class's default (Qwen3's is 128, not hidden / heads); null:
            # hidden / heads, as transformers derives it
            head_dim = _positive_int("head_dim", cfg.get("head_dim", defaults.get("head_dim"))
                                     or hidden // num_heads)
            if head_dim % 2:  # (transformers refuses it too; rotate_half failed mid-forward)
                raise ValueError(f"head_dim {head_dim} is odd: RoPE rotates pairs of dimensions")
            # rope_scaling ahead of rope_parameters, as transformers 5 reads them: a config it
            # saved carries rope_parameters {"rope_type": "default"}, and the rope_scaling a
            # user adds afterwards (Qwen2.5's card: yarn for long context) was ignored
            params = cfg.get("rope_parameters") or {}
            rope = cfg.get("rope_scaling") or params or None
            # the rope dict's theta first (transformers 5), then the top-level one
            rope_theta = float(
                (rope or {}).get("rope_theta") or params.get("rope_theta")
                or cfg.get("rope_theta") or 10000.0
            )
            if arch == "phi3":
                _check_phi3_rope(cfg, rope)
            if rope is not None and rope.get("rope_type", rope.get("type")) in (None, "default"):
                rope = None
            if rope is not None and "original_max_position_embeddings" not in rope:
                # transformers' default: the config's own, else its position limit
                rope = {**rope, "original_max_position_embeddings": cfg.get(
                    "original_max_position_embeddings", cfg.get("max_position_embeddings",
                                                                defaults["max_position_embeddings"]))}
            if rope is not None and rope.get("rope_type", rope.get("type")) == "yarn":
                # position_limit multiplies these when the engine starts, before the RoPE
                # tables (which name a bad value) are built: "factor": "x" was a bare
                # ValueError traceback there
                for key in ("factor", "original_max_position_embeddings"):
                    value = rope.get(key)
                    if not is_number(value) and not (key == "factor" and value is None):
                        raise ValueError(f"rope_scaling of type 'yarn': {key} {value!r} is not "
                                         "a number")
            # (Qwen2's q/k/v biases are its architecture's, not a config switch)
            for key, what in (("attention_bias", "attention's output projection"),
                              ("mlp_bias", "MLP projections")):
                if arch != "qwen2" and cfg.get(key):
                    raise ConfigError(f"{key}: true gives the {what} biases kvcap's {arch} "
                                      "layers do not have; not supported")
            act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
            if act not in ("silu", "swish"):
                raise ConfigError(f"hidden_act {act!r} is not supported: kvcap's MLP is the "
                                  "SiLU-gated one of Llama, Mistral and Qwen (hidden_act 'silu')")
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            if not all(is_integral(i) for i in eos_ids):
                # (a dict or string id was a TypeError when the engine started, or an id that
                # never matched a token: generation that never stopped)
                raise ValueError(f"eos_token_id {eos!r} is not a token id or a list of them")
            window, sliding_layers = _sliding_window(cfg, arch, num_layers, defaults)
            spec = cls(
                architecture=arch,
                hidden_size=hidden,
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=_positive_int("num_key_value_heads", cfg.get(
                    "num_key_value_heads", defaults["num_key_value_heads"]) or num_heads),
                head_dim=head_dim,
                intermediate_size=_positive_int("intermediate_size",
                                                cfg["intermediate_size"]),
                vocab_size=_positive_int("vocab_size", cfg["vocab_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", defaults["rms_norm_eps"])),
                rope_theta=rope_theta,
                rope_scaling=dict(rope) if rope else None,
                max_position_embeddings=_positive_int("max_position_embeddings", cfg.get(
                    "max_position_embeddings", defaults["max_position_embeddings"])),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=arch == "qwen2",
                qk_norm=arch == "qwen3",
                eos_token_ids=eos_ids,
                sliding_window=window,
                sliding_layers=sliding_layers,
                fp8_weights=fp8_weights,
            )
            if window is not None and window >= spec.position_limit:
                # a window no sequence can outgrow (Mistral's default 4096 on a 4K model)
                # never takes effect: full attention, with everything it allows
                spec = replace(spec, sliding_window=None, sliding_layers=())
            return spec
        except KeyError as e:
            raise ConfigError(f"config.json lacks required field {e.args[0]!r}") from None

    def layer_window(self, layer: int) -> int | None:
        """The attention window of `layer` (None: it attends to the whole context)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def position_limit(self) -> int:
        """The longest sequence the model's positions serve: max_position_embeddings, or under
        YaRN original_max_position_embeddings x factor where that is more. Qwen's long-context
        configs keep max_position_embeddings at the trained 32K and add YaRN with factor 4 for
        128K (as vLLM reads them); capping at 32K would make the scaling pointless."""
        rs = self.rope_scaling or {}
        if rs.get("rope_type", rs.get("type")) == "yarn" and rs.get("factor"):
            extended = int(float(rs["original_max_position_embeddings"]) * float(rs["factor"]))
            return max(self.max_position_embeddings, extended)
        return self.max_position_embeddings

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    def scale_names(self) -> list[str]:
        """The overlay tensor names for every scaled layer, K then V per layer."""
        names = []
        for layer in range(self.num_layers):
            names.append(f"{self.layer_prefix}.{layer}.self_attn.k_scale")
            names.append(f"{self.layer_prefix}.{layer}.self_attn.v_scale")
        return names


def _positive_int(key: str, value: Any) -> int:
    """A size or count of config.json (`value`, read from `key`) as a positive integer, as
    transformers' config classes type them. A bool, a float, a string or a value < 1 used to
    pass through int() (True as 1, 1.5 as 1) or fail far from the config: a division by zero
    sizing the KV cache, an IndexError building it. A plain ValueError: read_spec and the
    overlay binding turn it into their one-line errors naming the file."""
    if not is_integral(value) or value < 1:
        raise ValueError(f"{key} is {value!r}, not a positive integer")
    return int(value)


def _check_phi3_rope(cfg: dict[str, Any], rope: dict[str, Any] | None) -> None:
    """Phi-3's RoPE variants kvcap does not compute: a partial rotary dimension (Phi-4-mini's
    0.75) and LongRoPE (the 128K Phi-3s; transformers reads their `su` and `yarn` as it)."""
    partial = (rope or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor {partial}: kvcap rotates the whole head "
                          "dimension (partial_rotary_factor 1.0) only")
    kind = (rope or {}).get("rope_type", (rope or {}).get("type"))
    if kind in ("su", "yarn", "longrope"):
        raise ConfigError(f"rope_scaling type {kind!r} is LongRoPE for Phi-3 (as transformers "
                          "reads it): not supported (supported: linear, llama3, yarn on Llama, "
                          "Mistral and Qwen)")


def _sliding_window(cfg: dict[str, Any], arch: str, num_layers: int, defaults: dict[str, Any]
                    ) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers that slide), as transformers reads the config: Mistral and Phi-3
    slide in every layer when `sliding_window` is set; Qwen2/Qwen3 only with
    `use_sliding_window`, in the layers `layer_types` marks (or from `max_window_layers` on);
    Llama never."""
    window = cfg.get("sliding_window", defaults["sliding_window"])
    if window is None or arch == "llama":
        return None, ()
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None, ()
    types = cfg.get("layer_types")
    if arch in ("mistral", "phi3"):
        layers = tuple(range(num_layers))
    elif types is not None:
        if len(types) != num_layers:
            raise ConfigError(f"config.json's layer_types lists {len(types)} layers, "
                              f"num_hidden_layers is {num_layers}")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        first = int(cfg.get("max_window_layers", defaults["max_window_layers"]))
        layers = tuple(range(first, num_layers))
    if not layers:
        return None, ()
    if not is_int(window) or window < 1:
        raise ConfigError(f"config.json's sliding_window {window!r} is not a positive integer")
    return window, layers


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` is FP32 on CPU and BF16 (FP16 where BF16 is missing) on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in _TORCH_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of auto, {', '.join(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[dtype]


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> str:
    """Return the canonical KV storage name: fp32 | fp16 | bf16 | fp8_e4m3."""
    aliases = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "float16": "fp16",
               "bfloat16": "bf16", "float32": "fp32"}
    kv = aliases.get(kv_cache_dtype, kv_cache_dtype)
    if kv == "fp8_e5m2":
        raise ConfigError("kv_cache_dtype fp8_e5m2 is not supported: kvcap's calibrated path is "
                          "E4M3 only (use fp8_e4m3)")
    if kv not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
    if kv == "auto":
        return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[model_dtype]
    return kv


def kv_storage_dtype(kv: str) -> torch.dtype:
    """Torch dtype of the cache tensors: uint8 for E4M3 (raw bytes), else the float type."""
    return torch.uint8 if kv == "fp8_e4m3" else _KV_TORCH[kv]


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler and cache sizing. `num_gpu_blocks=None` sizes the pool from memory."""

    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    num_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto | torch | triton
    enforce_eager: bool = False
    # speculative decoding by prompt lookup (kvcap/engine/ngram.py); 0 drafts: off
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # no drafts while more requests than this run (None: always); where verify rows stop
    # being nearly free (a batch large enough to load the GPU's compute)
    speculative_disable_by_batch_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def max_sample_rows(self) -> int:
        """Rows whose logits one step computes: one per sequence, or with drafts one per
        token a sequence verifies (never more than the step's tokens)."""
        return min(self.max_num_seqs * (1 + self.num_speculative_tokens),
                   max(self.max_num_batched_tokens, self.max_num_seqs))

    def validate(self) -> None:
        # Types first: through the Python API a float or string count used to pass the range
        # checks (2.5 seqs, 16.5 tokens) or fail deep inside with a TypeError.
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "num_blocks", "num_speculative_tokens", "prompt_lookup_max",
                     "prompt_lookup_min"):
            v = getattr(self, name)
            if v is None and name in ("max_model_len", "num_blocks"):  # unset: sized for you
                continue
            if not is_integral(v):
                raise ConfigError(f"{name} must be an integer, got {v!r}")
        for name, v in (("gpu_memory_utilization", self.gpu_memory_utilization),
                        ("kv_cache_memory_gib", 1.0 if self.kv_cache_memory_gib is None  # unset
                         else self.kv_cache_memory_gib)):
            if not isinstance(v, numbers.Real) or isinstance(v, bool):
                raise ConfigError(f"{name} must be a number, got {v!r}")
        if self.num_blocks is not None and self.kv_cache_memory_gib is not None:
            # (num_blocks won and the GiB budget was dropped without a word)
            raise ConfigError(f"num_blocks ({self.num_blocks}) and kv_cache_memory_gib "
                              f"({self.kv_cache_memory_gib}) both size the KV pool: give one")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1 (or unset to size the pool from "
                              f"memory), got {self.num_blocks}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError("max_num_batched_tokens must be >= block_size")
        if self.max_model_len is not None and self.max_model_len < 1:
            # (0 used to mean "the model's own limit" through an `or`: a silent fallback)
            raise ConfigError(f"max_model_len must be >= 1 (or unset for the model's limit), "
                              f"got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_memory_gib is not None and not (
                math.isfinite(self.kv_cache_memory_gib) and self.kv_cache_memory_gib > 0):
            raise ConfigError(f"kv_cache_memory_gib must be a finite number > 0 (or unset to "
                              f"size the pool from free memory), got {self.kv_cache_memory_gib}")
        from kvcap.engine.ngram import check_ngram_settings

        check_ngram_settings(self.num_speculative_tokens, self.prompt_lookup_max,
                             self.prompt_lookup_min)
        b = self.speculative_disable_by_batch_size
        # is_integral, as the counts above: `isinstance(b, int)` took True as a limit of 1
        # request and refused numpy's integers with "must be an integer ..., got 2"
        if b is not None and (not is_integral(b) or b < 1):
            raise ConfigError(f"speculative_disable_by_batch_size must be an integer >= 1 (or "
                              f"unset: drafts at any batch size), got {b!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError(
                f"attention_backend {self.attention_backend!r} is not one of auto, torch, triton"
            )
