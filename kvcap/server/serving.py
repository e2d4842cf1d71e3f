"""OpenAI request -> engine requests -> OpenAI response (JSON or SSE chunks).

`OpenAIServing` validates a parsed request against the model (served name, tokenization,
context length, KV pool size), submits it through the AsyncEngine and turns the outputs into
complete responses or `data: ...` server-sent events ending with `data: [DONE]`. A client that
goes away is noticed (stream cancellation, or polling for non-streamed requests) and its
requests are aborted, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from starlette.requests import Request

from kvcap.engine.engine import RequestOutput
from kvcap.engine.token_bytes import TokenTexts
from kvcap.models.text_prompt import TemplateRefused, chat_ids, encode_prompt
from kvcap.server import protocol as P
from kvcap.server.async_engine import (
    AsyncEngine,
    RequestFailed,
    RequestStream,
    ServerBusy,
    ServiceUnavailable,
)
from kvcap.server.reasoning import PARSERS as REASONING_PARSERS
from kvcap.server.tool_parsers import PARSERS

logger = logging.getLogger(__name__)

Item = tuple[int, RequestOutput] | None  # None: nothing arrived within the poll interval


async def merge(streams: list[RequestStream], poll_s: float) -> AsyncIterator[Item]:
    """Outputs of several streams as they come; raises the first RequestFailed. Whatever
    way the consumer leaves, unfinished requests are aborted."""
    q: asyncio.Queue[tuple[int, RequestOutput] | RequestFailed] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            while not s.finished:
                out = await s.next()
                if out is not None:
                    q.put_nowait((i, out))
        except RequestFailed as e:
            q.put_nowait(e)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            try:
                item = await asyncio.wait_for(q.get(), poll_s)
            except TimeoutError:
                yield None
                continue
            if isinstance(item, RequestFailed):
                raise item
            left -= item[1].finished
            yield item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


def text_delta(sent: str, text: str, finished: bool, stops: list[str]) -> str:
    """New text to send. While running, hold back a trailing U+FFFD (an incomplete UTF-8
    sequence) and any tail that could still grow into a stop string."""
    new = text[len(sent) :]  # byte-level BPE: decoded prefixes are stable once held back
    if finished:
        return new
    hold = len(new) - len(new.rstrip("\ufffd"))
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return new[: max(0, len(new) - hold)]


def sse(obj: Any) -> str:
    data = obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


# apply_chat_template's own arguments: not to be set through chat_template_kwargs
TEMPLATE_ARGUMENTS = {"conversation", "messages", "tools", "documents", "chat_template",
                      "add_generation_prompt", "continue_final_message", "tokenize",
                      "padding", "truncation", "max_length", "return_tensors", "return_dict"}


def check_template_controls(conv: list[dict[str, Any]], add_generation_prompt: bool,
                            continue_final: bool, template_kwargs: dict[str, Any] | None
                            ) -> dict[str, Any]:
    """The extra apply_chat_template arguments of a request, each bad one a 400."""
    extra = dict(template_kwargs or {})
    clash = sorted(set(extra) & TEMPLATE_ARGUMENTS)
    if clash:
        raise P.APIError(400, f"chat_template_kwargs: {clash} are set by the request itself, "
                              f"not through the template's variables",
                         param="chat_template_kwargs")
    if continue_final:
        if add_generation_prompt:
            raise P.APIError(400, "continue_final_message: needs add_generation_prompt: false "
                                  "(the reply continues the last message instead of opening a "
                                  "new one)", param="continue_final_message")
        if conv[-1]["role"] != "assistant":
            raise P.APIError(400, "continue_final_message: the last message must be the "
                                  "assistant's, to be continued", param="continue_final_message")
        extra["continue_final_message"] = True
    return extra


class OpenAIServing:
    def __init__(
        self,
        aeng: AsyncEngine,
        tokenizer,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
        poll_s: float = 1.0,
        sampling_defaults: dict[str, Any] | None = None,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
    ):
        self.aeng, self.tokenizer, self.model_name = aeng, tokenizer, model_name
        self.max_model_len, self.vocab_size, self.poll_s = max_model_len, vocab_size, poll_s
        self.bm = aeng.engine.block_manager
        self.chunk = aeng.engine.scheduler.max_num_batched_tokens  # see _blocks_for
        self.token_texts = TokenTexts(tokenizer)
        self.sampling_defaults = dict(sampling_defaults or {})
        if tool_parser is not None and tool_parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {tool_parser!r} (known: {PARSERS})")
        self.tool_parser = tool_parser
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r} (known: "
                             f"{REASONING_PARSERS})")
        self.reasoning_parser = reasoning_parser

    # ----------------------------------------------------------------- validation
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise P.APIError(  # 404 + model_not_found, as OpenAI answers an unknown model
                404,
                f"model: the model '{name}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
                err_type="invalid_request_error",  # OpenAI's type for this 404
            )

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids; with the tokenizer's special tokens (Llama's and Mistral's BOS)
        unless the request says otherwise, as transformers and vLLM encode a completion prompt."""
        if self.tokenizer is None:
            raise P.APIError(
                400, "prompt: this model has no tokenizer; send token ids", param="prompt"
            )
        return encode_prompt(self.tokenizer, text, add_special_tokens)

    def completion_prompts(self, prompt: str | list, add_special_tokens: bool = True
                           ) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self._encode(prompt, add_special_tokens)]
        if not prompt:
            raise P.APIError(400, "prompt: must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            prompts = [list(prompt)]
        elif isinstance(prompt[0], str):
            prompts = [self._encode(p, add_special_tokens) for p in prompt]
        else:
            prompts = [list(p) for p in prompt]
        for ids in prompts:
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise P.APIError(
                    400, f"prompt: token ids must be in [0, {self.vocab_size})", param="prompt"
                )
        return prompts

    def prompt_texts(self, prompt: str | list, prompts: list[list[int]]) -> list[str]:
        """What `echo` sends back: each prompt as given, or its token ids decoded."""
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], str):
            return list(prompt)
        if self.tokenizer is None:
            return [""] * len(prompts)
        return [self.tokenizer.decode(ids) for ids in prompts]

    @staticmethod
    def choices(pairs: list[tuple[list[int], Any]], n: int) -> list[tuple[list[int], Any]]:
        """Each (prompt, params) n times, in choice order (prompt p's choice j is p * n + j);
        with a seed, choice j samples with seed + j so the choices differ."""
        return [(ids, dataclasses.replace(params, seed=params.seed + j)
                 if j and params.seed is not None else params)
                for ids, params in pairs for j in range(n)]

    def chat_prompt(self, req: P.ChatCompletionRequest | P.TokenizeRequest) -> list[int]:
        """The chat request's messages (and tools) through the chat template, with its
        template controls."""
        conv = req.conversation() if hasattr(req, "conversation") else \
            P.conversation(req.messages)
        return self.render_chat(conv, req.add_generation_prompt, tools=req.tools,
                                continue_final=req.continue_final_message,
                                template_kwargs=req.chat_template_kwargs)

    def render_chat(self, conv: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[Any] | None = None, continue_final: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise P.APIError(
                400,
                "messages: this model has no chat template; use /v1/completions",
                param="messages",
            )
        extra = check_template_controls(conv, add_generation_prompt, continue_final,
                                        template_kwargs)
        try:
            return chat_ids(self.tokenizer, conv, tools=tools or None,
                            add_generation_prompt=add_generation_prompt, **extra)
        except TemplateRefused as e:
            raise P.APIError(
                400, f"messages: the chat template refused them: {e}", param="messages"
            ) from None

    def params_for(
        self, req: P._SamplingFields, ids: list[int], max_tokens: int | None, prompt_field: str
    ):
        n, ctx = len(ids), self.max_model_len
        if n == 0:
            raise P.APIError(400, f"{prompt_field}: the prompt is empty", param=prompt_field)
        if n >= ctx:
            raise P.APIError(
                400,
                f"{prompt_field}: the prompt has {n} tokens but the context "
                f"(max_model_len) is {ctx} tokens, leaving no room for a "
                "completion",
                param=prompt_field,
                code="context_length_exceeded",
            )
        if max_tokens is None:  # as many as fit: the context, and the KV pool too
            room = self._room()
            if n >= room:
                raise P.APIError(
                    400,
                    f"{prompt_field}: the prompt has {n} tokens but the KV pool holds "
                    f"{room} tokens, leaving no room for a completion",
                    param=prompt_field,
                )
            max_tokens = room - n
        params = req.sampling_params(max_tokens, self.sampling_defaults)
        if params.structured and self.tokenizer is None:
            raise P.APIError(400, "structured output (response_format, guided_json, "
                                  "guided_choice) needs the model's tokenizer",
                             param="response_format")
        if any(t >= self.vocab_size for t in params.logit_bias or {}):
            raise P.APIError(400, f"logit_bias: token ids must be in [0, {self.vocab_size})",
                             param="logit_bias")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise P.APIError(400, f"stop_token_ids: token ids must be in [0, {self.vocab_size})",
                             param="stop_token_ids")
        total, field = n + params.max_tokens, req.max_tokens_field
        if total > ctx:
            raise P.APIError(
                400,
                f"{field}: {n} prompt tokens + {params.max_tokens} "
                f"completion tokens exceed the context (max_model_len) of {ctx} "
                "tokens",
                param=field,
                code="context_length_exceeded",
            )
        if self._blocks_for(total) > self.bm.num_total_blocks:
            raise P.APIError(
                400,
                f"{field}: {total} tokens need "
                f"{self._blocks_for(total)} KV blocks but the pool has "
                f"{self.bm.num_total_blocks}",
                param=field,
            )
        return params

    def _blocks_for(self, num_tokens: int) -> int:
        """The KV blocks a sequence of `num_tokens` holds at most, as the scheduler counts
        them when it admits a request: all of them, or with a model whose every layer slides
        only the window's (BlockManager.peak_blocks)."""
        return self.bm.peak_blocks(num_tokens, self.chunk)

    def _room(self) -> int:
        """The longest sequence (prompt + completion) a request may ask for: the context,
        or what the KV pool holds where that is less (the engine starts with a pool smaller
        than max_model_len, with a warning). A request without max_tokens gets the rest;
        sizing it by the context alone refused every such request on that server."""
        if self._blocks_for(self.max_model_len) <= self.bm.num_total_blocks:
            return self.max_model_len
        return min(self.max_model_len, self.bm.num_total_blocks * self.bm.block_size)

    def submit(self, reqs: list[tuple[list[int], Any]], stream: bool = True
               ) -> list[RequestStream]:
        try:
            return self.aeng.submit(reqs, stream=stream)
        except ServerBusy as e:
            raise P.APIError(429, str(e), code="queue_full") from None
        except ServiceUnavailable as e:
            raise P.APIError(503, str(e)) from None

    # ----------------------------------------------------------------- responses
    async def collect(self, streams: list[RequestStream], request: Request) -> list[RequestOutput]:
        """Final outputs of every stream; aborts them if the client disconnects."""
        finals: list[RequestOutput | None] = [None] * len(streams)
        checked = time.monotonic()
        try:
            async with aclosing(merge(streams, self.poll_s)) as items:
                async for item in items:
                    if item is not None and item[1].finished:
                        finals[item[0]] = item[1]
                    if time.monotonic() - checked >= self.poll_s:
                        checked = time.monotonic()
                        if await request.is_disconnected():
                            logger.info("client disconnected; aborting %d request(s)", len(streams))
                            raise P.APIError(499, "client disconnected")
        except RequestFailed as e:
            raise P.APIError(e.status, e.message) from None
        return [f for f in finals if f is not None]

    async def stream(
        self,
        streams: list[RequestStream],
        stops: list[str],
        chunk: Callable[..., Any],
        include_usage: bool,
        opening: Callable[[int, RequestOutput, P.UsageInfo | None], Any] | None = None,
        n: int = 1,
        prompt_lens: list[int] | None = None,
    ) -> AsyncIterator[str]:
        """SSE events: `chunk(index, text=, finish=, role=, usage=, out=, span=)` builds each
        event; `span` is the range of generated tokens that event covers (for their logprobs):
        the tokens since the previous event, whose text may have been held back.
        `opening(index, out, usage)`, where given, builds an event sent before a choice's first
        text (completions' echo of the prompt). Every n streams share a prompt (n choices),
        which the final usage counts once. `prompt_lens` (each stream's prompt length) is
        given for stream_options.continuous_usage_stats: then every event with a choice
        carries that choice's usage so far as well."""
        sent = [""] * len(streams)
        sent_tokens = [0] * len(streams)
        opened = [opening is None] * len(streams)
        usage = [0, 0]

        def so_far(i: int, generated: int) -> P.UsageInfo | None:
            # As vLLM counts it: the choice's own prompt and the tokens generated up to and
            # including this event (not the request's totals, which only the last event
            # has). None, without continuous usage, leaves each event as it was (usage null).
            return None if prompt_lens is None else P.UsageInfo.of(prompt_lens[i], generated)

        try:
            for i in range(len(streams)):
                first = chunk(i, role=True, usage=so_far(i, 0))
                if first is not None:
                    yield sse(first)
            async with aclosing(merge(streams, self.poll_s)) as items:
                async for item in items:
                    if item is None:
                        yield ": keep-alive\n\n"
                        continue
                    i, out = item
                    if not opened[i]:
                        opened[i] = True
                        yield sse(opening(i, out, so_far(i, 0)))  # the prompt: none yet
                    delta = text_delta(sent[i], out.text, out.finished, stops)
                    sent[i] += delta
                    span = (sent_tokens[i], len(out.token_ids))
                    if delta:
                        event = chunk(i, text=delta, out=out, span=span,
                                      usage=so_far(i, span[1]))
                        if event is not None:  # None: held back by the route (tool calls)
                            yield sse(event)
                        sent_tokens[i] = span[1]
                    if out.finished:
                        span = (sent_tokens[i], len(out.token_ids))
                        yield sse(chunk(i, finish=out.finish_reason, out=out, span=span,
                                        usage=so_far(i, span[1])))
                        sent_tokens[i] = span[1]
                        usage[0] += len(out.prompt_token_ids) if i % n == 0 else 0
                        usage[1] += len(out.token_ids)
            if include_usage:
                yield sse(chunk(None, usage=P.UsageInfo.of(*usage)))
        except RequestFailed as e:
            yield sse(P.APIError(e.status, e.message).body())
        yield "data: [DONE]\n\n"
