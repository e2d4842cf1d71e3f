"""User-facing sampling parameters; every bad value raises ConfigError with a one-line reason."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcap.config import is_int, is_number
from kvcap.errors import ConfigError
from kvcap.sampling.json_grammar import Grammar
from kvcap.sampling.json_schema import (
    SchemaError,
    choice_grammar,
    compile_schema,
    object_grammar,
    regex_grammar,
)
from kvcap.sampling.reasoning_gate import REASONING_STYLES

# Temperatures below this sample greedily, as in vLLM (its _SAMPLING_EPS): logits / t
# overflows float32 for tiny t (|logit| > 3.4e38 * t), every such token clamps to the same
# FLT_MAX and the lowest index among them won instead of the arg-max.
GREEDY_BELOW = 1e-5

# The fields a checkpoint's generation_config.json may give defaults for (kvcap serve
# --generation-config auto; models.loader.read_sampling_defaults).
FLT_MAX = 3.4028234663852886e38  # the largest finite FP32 value: logits are divided in FP32
CHECKPOINT_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0  # no EOS, stop token or stop string before this many tokens
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # the text: a stop string or stop token's own text kept at its end (vLLM's
    # include_stop_str_in_output), special tokens' text kept (skip_special_tokens=False)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each generated token
    prompt_logprobs: int | None = None  # top-N logprobs at each prompt position (teacher forcing)
    # logit adjustments before sampling (kvcap/sampling/penalties.py)
    presence_penalty: float = 0.0  # [-2, 2], over the output so far
    frequency_penalty: float = 0.0  # [-2, 2], times each token's count in the output
    repetition_penalty: float = 1.0  # > 0, over prompt and output tokens (1 = off)
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    # structured output (kvcap/engine/structured.py), at most one of:
    json_object: bool = False  # one JSON object, then EOS
    json_schema: dict | bool | str | None = None  # one JSON value valid under this schema
    choice: list[str] | None = None  # exactly one of these strings
    regex: str | None = None  # text the regular expression matches whole
    # a reasoning model's style ("qwen3" | "deepseek_r1"): the format above applies to the
    # answer after its <think> ... </think> (kvcap/sampling/reasoning_gate.py)
    reasoning: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"invalid SamplingParams: {msg}")

        # (`not >= 0` also refuses NaN, which would pass `< 0` and sample garbage; past FP32's
        # range the logits are divided by inf: uniform sampling, an inf logit turned NaN)
        if not is_number(self.temperature) or not 0 <= self.temperature <= FLT_MAX:
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            bad(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], got "
                f"{self.min_tokens!r}")
        if self.seed is not None and not is_int(self.seed):
            bad(f"seed must be an integer, got {self.seed!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "ignore_eos",
                     "json_object"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 0):
                bad(f"{name} must be a non-negative integer, got {v!r}")
        if not isinstance(self.stop, (list, tuple)) or any(
                not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        # (the engine checks them against the vocabulary: under min_tokens each is masked
        # by index, and a bad one would fail the whole step)
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be a list of token ids (integers >= 0), got "
                f"{self.stop_token_ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_number(v) or not -2.0 <= v <= 2.0:
                bad(f"{name} must be in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not is_number(r) or not 0.0 < r < float("inf"):
            bad(f"repetition_penalty must be a positive number (1 = off), got {r!r}")
        asked = [n for n, on in (("json_object", self.json_object),
                                 ("json_schema", self.json_schema is not None),
                                 ("choice", self.choice is not None),
                                 ("regex", self.regex is not None)) if on]
        if len(asked) > 1:
            bad(f"{' and '.join(asked)} are each a whole output format: give one")
        if asked and (self.ignore_eos or self.min_tokens):
            bad(f"{asked[0]} ends the output with EOS once it is complete: it cannot be "
                f"combined with ignore_eos or min_tokens")
        if self.reasoning is not None and self.reasoning not in REASONING_STYLES:
            bad(f"reasoning must be one of {', '.join(REASONING_STYLES)}, got "
                f"{self.reasoning!r}")
        if asked:
            try:
                self.grammar()
            except SchemaError as e:
                bad(f"{asked[0]}: {e}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            bad(f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
        for tok, b in (self.logit_bias or {}).items():
            if not is_int(tok) or tok < 0:
                bad(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
            if not is_number(b) or not -100.0 <= b <= 100.0:
                bad(f"logit_bias values must be in [-100, 100], got {b!r} for token {tok}")

    @property
    def adjusts_logits(self) -> bool:
        """Any logit bias or penalty to apply before sampling."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 \
            or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def adjusts_logits_after(self, num_output_tokens: int) -> bool:
        """Whether sampling the next token, after that many, adjusts logits: bias or
        penalties, or stop tokens masked while under min_tokens."""
        return self.adjusts_logits or num_output_tokens < self.min_tokens

    @property
    def structured(self) -> bool:
        """The output must follow a grammar (JSON object, JSON schema, choice or regex)."""
        return self.json_object or self.json_schema is not None or self.choice is not None \
            or self.regex is not None

    def grammar(self) -> Grammar | None:
        """The grammar the output follows (compiled once per distinct schema), or None."""
        if self.json_schema is not None:
            return compile_schema(self.json_schema)
        if self.choice is not None:
            return choice_grammar(self.choice)
        if self.regex is not None:
            return regex_grammar(self.regex)
        return object_grammar() if self.json_object else None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
