"""OpenAI API schemas (completions, chat completions, models, errors) as pydantic models.

Requests are parsed strictly (`"8"` is not an integer) and unknown fields are ignored, like the
OpenAI API. Fields that kvcap does not implement are accepted only at their neutral value;
anything else is refused with a 400 that names the field, never silently ignored.
`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos` and `stop_token_ids` are
accepted as extensions (vLLM style); penalties and `logit_bias` as in
kvcap/sampling/penalties.py. Structured output (`response_format` json_object / json_schema,
vLLM's `guided_json` / `guided_choice` / `structured_outputs`) as in
kvcap/server/structured_request.py. vLLM extensions kvcap does not implement (beam search,
grammar guidance, allowed_token_ids, bad_words, truncate_prompt_tokens, prompt_logprobs,
return_tokens_as_token_ids, guided_whitespace_pattern; chat's own chat_template, documents
and echo) and OpenAI's audio output (`modalities` other than ["text"], `audio`) are named so
that a request using them is refused rather than silently served without them, as are
OpenAI's deprecated `functions` / `function_call` (tools replace them). A field with a
default that the API declares nullable takes null as that default.
`n` choices per prompt run as n engine requests; with a `seed`, choice j samples with seed + j.
Log-probabilities (`logprobs`, chat's `top_logprobs`, up to MAX_LOGPROBS alternatives) and
completions' `echo` are formatted by `kvcap.server.logprobs`.
"""

from __future__ import annotations

import time
import types
import uuid
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvcap.errors import ConfigError
from kvcap.models.text_prompt import template_call
from kvcap.sampling_params import CHECKPOINT_SAMPLING_FIELDS, SamplingParams
from kvcap.server.structured_request import StructuredRequestError, structured_request
from kvcap.server.tools import ToolPlan, ToolRequestError, plan_tools

MAX_LOGPROBS = 20  # alternatives per token (OpenAI: 5 for completions, 20 for chat)
MAX_N = 128  # choices per prompt (also bounded by the server's admission limit)


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.err_type = err_type or _default_type(status)

    def body(self) -> dict[str, Any]:
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message, type=self.err_type, param=self.param, code=self.code
            )
        ).model_dump()


def _default_type(status: int) -> str:
    return {
        401: "authentication_error",
        404: "not_found_error",
        429: "rate_limit_error",
        503: "service_unavailable_error",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ----------------------------------------------------------------------------- requests
class _NullIsDefault(BaseModel):
    """A field with a default that the API reference declares nullable (`n`, `stream`,
    chat's `logprobs`, `echo`, ... "or null" in OpenAI's, Optional in vLLM's) takes null as
    its default: clients that spell out every field send null for "not set". (Fields whose
    own type admits None keep it: completions' `max_tokens: null` means as many as fit.)"""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        keep = _defaults_without_none(cls)
        return {k: v for k, v in data.items() if v is not None or k not in keep}


_NULL_DEFAULTS: dict[type, frozenset[str]] = {}


def _defaults_without_none(cls: type[BaseModel]) -> frozenset[str]:
    """The fields of `cls` with a default whose type does not admit None."""
    names = _NULL_DEFAULTS.get(cls)
    if names is None:
        names = _NULL_DEFAULTS[cls] = frozenset(
            name for name, f in cls.model_fields.items()
            if not f.is_required() and f.default is not None
            and not (get_origin(f.annotation) in (Union, types.UnionType)
                     and type(None) in get_args(f.annotation)))
    return names


class StreamOptions(_NullIsDefault):
    model_config = ConfigDict(extra="ignore")
    # True once stream_options is given at all, as in vLLM: {"continuous_usage_stats": true}
    # alone then streams usage (it streamed none); without stream_options there is none
    include_usage: bool = True
    # vLLM's extension: every chunk with a choice carries that choice's usage so far too
    continuous_usage_stats: bool = False


class _SamplingFields(_NullIsDefault):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}
    response_format: dict[str, Any] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # structured output, vLLM style (kvcap.server.structured_request)
    guided_json: Any = None
    guided_choice: Any = None
    guided_regex: Any = None
    structured_outputs: dict[str, Any] | None = None  # {"json": ...} | {"choice": [...]} ...
    include_stop_str_in_output: bool = False  # vLLM's: the stop string / token's text kept
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens' text
    # vLLM extensions not implemented: refused unless neutral (see `unsupported`)
    use_beam_search: bool = False
    guided_grammar: Any = None
    # (these change the answer too, and were dropped as unknown fields: a request with
    # allowed_token_ids or bad_words was sampled without them, one with
    # truncate_prompt_tokens was not truncated, prompt_logprobs came back without any)
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None
    # vLLM's: tokens written as "token_id:N" in logprobs (were answered as text, unasked)
    return_tokens_as_token_ids: bool = False
    # vLLM's: the whitespace a JSON output may hold (kvcap's grammar has its own)
    guided_whitespace_pattern: Any = None

    def unsupported(self) -> list[str]:
        bad = ["guided_grammar"] if self.guided_grammar is not None else []
        if self.use_beam_search:
            bad.append("use_beam_search")
        if self.return_tokens_as_token_ids:
            bad.append("return_tokens_as_token_ids")
        bad += [name for name in ("allowed_token_ids", "bad_words", "truncate_prompt_tokens",
                                  "prompt_logprobs", "guided_whitespace_pattern")
                if getattr(self, name) not in (None, [])]
        return bad

    @property
    def max_tokens_field(self) -> str:
        """The field the completion's length limit came from, for the errors about it."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """stream_options.continuous_usage_stats, which counts only with include_usage: vLLM
        (`should_include_usage`) ignores it without, and so does kvcap, to answer as it."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(self, max_tokens: int, defaults: dict[str, Any] | None = None
                        ) -> SamplingParams:
        """Build SamplingParams; every bad value raises APIError(400) naming its field.
        `defaults` (the checkpoint's generation config) fill the sampling fields the request
        leaves out, before OpenAI's own defaults."""
        checks: list[tuple[str, bool, str]] = [
            (self.max_tokens_field, max_tokens >= 1, f"must be at least 1, got {max_tokens}"),
            (
                "temperature",
                self.temperature is None or 0.0 <= self.temperature <= 2.0,
                f"must be in [0, 2], got {self.temperature}",
            ),
            (
                "top_p",
                self.top_p is None or 0.0 < self.top_p <= 1.0,
                f"must be in (0, 1], got {self.top_p}",
            ),
            (
                "top_k",
                self.top_k is None or self.top_k >= -1,
                f"must be -1, 0 or positive, got {self.top_k}",
            ),
            (
                "min_p",
                self.min_p is None or 0.0 <= self.min_p <= 1.0,
                f"must be in [0, 1], got {self.min_p}",
            ),
            ("stop", all(self.stop_list), "must be non-empty strings"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids or ()),
             f"must be token ids (integers >= 0), got {self.stop_token_ids}"),
            ("n", 1 <= self.n <= MAX_N, f"must be in [1, {MAX_N}], got {self.n}"),
            # (as OpenAI and vLLM: usage in a final chunk means nothing without chunks)
            ("stream_options", self.stream_options is None or self.stream,
             "needs stream: true"),
            ("min_tokens", 0 <= self.min_tokens <= max_tokens,
             f"must be in [0, max_tokens = {max_tokens}], got {self.min_tokens}"),
            *[(name, v is None or -2.0 <= v <= 2.0, f"must be in [-2, 2], got {v}")
              for name, v in (("presence_penalty", self.presence_penalty),
                              ("frequency_penalty", self.frequency_penalty))],
            (
                "repetition_penalty",
                self.repetition_penalty is None or 0.0 < self.repetition_penalty < float("inf"),
                f"must be a positive number (1 = off), got {self.repetition_penalty}",
            ),
            *self.logprob_checks(),
        ]
        for name, ok, why in checks:
            if not ok:
                raise APIError(400, f"{name}: {why}", param=name)
        for name in self.unsupported():
            raise APIError(
                400,
                f"{name}: only the default value is supported by kvcap",
                param=name,
                code="unsupported_parameter",
            )
        try:
            structured = structured_request(self)
        except StructuredRequestError as e:
            raise APIError(400, e.message, param=e.param, code=e.code) from None
        if structured and (self.ignore_eos or self.min_tokens):
            field = structured.pop("field")
            raise APIError(400, f"{field}: structured output ends with EOS once complete: it "
                                f"cannot be combined with ignore_eos or min_tokens",
                           param=field)
        structured.pop("field", None)
        logprobs, prompt_logprobs = self.logprob_counts()
        # the request's value, else the checkpoint's, else SamplingParams' own default
        sampling = {**(defaults or {}), **{
            name: getattr(self, name) for name in CHECKPOINT_SAMPLING_FIELDS
            if getattr(self, name) is not None}}
        return SamplingParams(
            **sampling,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop_list,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=float(self.presence_penalty or 0.0),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            logit_bias=self.token_biases(),
            **structured,
        )

    def token_biases(self) -> dict[int, float] | None:
        """logit_bias with its keys (token ids as strings, as OpenAI sends them) as integers."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            # isdecimal, not isdigit: int() refuses digits such as "²" that isdigit accepts
            if not key.strip().isdecimal():
                raise APIError(400, f"logit_bias: keys must be token ids, got {key!r}",
                               param="logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise APIError(400, f"logit_bias: values must be in [-100, 100], got {bias} "
                               f"for token {key}", param="logit_bias")
            out[int(key)] = float(bias)
        return out

    def logprob_checks(self) -> list[tuple[str, bool, str]]:
        return []

    def tool_structured(self) -> dict[str, Any] | None:
        """The output format tool calling asks for (chat only)."""
        return None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(alternatives per generated token, per prompt token); None: not asked for."""
        return None, None

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's BOS

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.best_of not in (None, 1, self.n):  # best_of == n returns every choice
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad

    def logprob_checks(self) -> list[tuple[str, bool, str]]:
        ok = self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS
        return [("logprobs", ok, f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")]

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, (self.logprobs if self.echo else None)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """An image, audio or file part gets its own error, not the union's three."""
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind is not None and kind != "text":
                    raise ValueError(f"content part {i} has type {kind!r}: this server's models "
                                     "read text only; send parts of type 'text'")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # OpenAI's deprecated function calling: refused (see tool_plan), never silently ignored
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # chat template controls, as vLLM has them
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # extend the last (assistant) message
    # vLLM's: true adds the tokenizer's BOS on top of the template; kvcap keeps only what the
    # template writes, so true is refused (it was silently ignored)
    add_special_tokens: bool = False
    # vLLM's, not implemented, refused unless neutral: a request's own chat template (the
    # prompt was rendered with the server's instead, without a word), RAG documents for the
    # template, and echo (the reply prefixed with the last message)
    chat_template: Any = None
    documents: Any = None
    echo: bool = False
    # OpenAI's audio output: a text model answers text only ("text" alone is the neutral ask)
    modalities: Any = None
    audio: Any = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.add_special_tokens:
            bad.append("add_special_tokens")
        bad += [name for name in ("chat_template", "documents", "audio")
                if getattr(self, name) not in (None, [])]
        if self.modalities not in (None, [], ["text"]):
            bad.append("modalities")
        if self.echo:
            bad.append("echo")
        return bad

    @property
    def max_tokens_field(self) -> str:
        """OpenAI's current name wins over the deprecated one (as chat_completion reads them);
        LangChain sends max_completion_tokens for its max_tokens."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def tool_plan(self) -> ToolPlan | None:
        """tools / tool_choice checked (kvcap/server/tools.py); None without tools."""
        for name, neutral in (("functions", (None, [])), ("function_call", (None, "none"))):
            if getattr(self, name) not in neutral:  # was served as text, the functions ignored
                raise APIError(400, f"{name}: OpenAI's deprecated function calling is not "
                                    "supported; send tools (and tool_choice) instead",
                               param=name, code="unsupported_parameter")
        try:
            return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolRequestError as e:
            raise APIError(400, e.message, param=e.param, code=e.code) from None

    def tool_structured(self) -> dict[str, Any] | None:
        plan = self.tool_plan()
        if plan is None or not plan.constrains:
            return None
        return {"field": "tool_choice", "json_schema": plan.schema}

    def logprob_checks(self) -> list[tuple[str, bool, str]]:
        n = self.top_logprobs
        return [("top_logprobs", n is None or 0 <= n <= MAX_LOGPROBS,
                 f"must be in [0, {MAX_LOGPROBS}], got {n}"),
                ("top_logprobs", n is None or self.logprobs, "needs logprobs: true")]

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)


def conversation(messages: list[ChatMessage] | None) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: OpenAI's `developer` role is a system one;
    an assistant turn's tool calls carry their arguments as a dict (what chat templates
    iterate over), a tool turn its call id."""
    if not messages:
        raise APIError(400, "messages: must contain at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                "content": m.text()}
        if m.tool_calls:
            turn["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]")
                                  for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        # a participant's name on any turn, as vLLM and LLM.chat pass it (it reached the
        # template on tool turns only: a template that renders names lost the user's)
        if m.name is not None:
            turn["name"] = m.name
        out.append(turn)
    return out


def _template_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    try:  # (shared with LLM.chat, which answers the same call the same way offline)
        return template_call(call, where)
    except ConfigError as e:
        raise APIError(400, str(e), param="messages") from None


class TokenizeRequest(_NullIsDefault):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None  # optional, as in vLLM: the served model
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # shown to the chat template, as on the chat route
    # vLLM's defaults: a prompt with the tokenizer's special tokens (as /v1/completions encodes
    # it), messages without (the chat template writes its own)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    chat_template: Any = None  # vLLM's own template per request: refused, as on the chat route


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None  # optional, as in vLLM: the served model
    tokens: list[int]


def parse_request(body: bytes, model: type[BaseModel]) -> Any:
    """Parse a JSON body; invalid JSON, wrong types or missing fields -> 400 (as OpenAI and
    vLLM answer them: clients catch a BadRequestError, which a 422 is not)."""
    try:
        return model.model_validate_json(body or b"", strict=True)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"invalid JSON body: {first['msg']}", code="invalid_json") from None
        if not first["loc"]:
            raise APIError(
                400, f"the request body must be a JSON object: {first['msg']}", code="invalid_json"
            ) from None
        field = str(first["loc"][0])
        msgs = list(dict.fromkeys(x["msg"].removeprefix("Value error, ") for x in errors
                                  if x["loc"][:1] == (field,)))
        raise APIError(
            400,
            f"{field}: {'; '.join(msgs[:3])}",
            param=field,
            code="invalid_type" if first["type"] != "missing" else "missing",
        ) from None


# ----------------------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt: int, completion: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    reasoning_content: str | None = None  # with kvcap serve --reasoning-parser


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kvcap"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def now() -> int:
    return int(time.time())
