"""The two completion routes: OpenAI `/v1/completions` (echo, logprobs, n choices per prompt)
and `/v1/chat/completions`, each answered as one JSON response or as server-sent events
(`OpenAIServing.stream`)."""

from __future__ import annotations

import dataclasses

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from kvcap.engine.engine import RequestOutput
from kvcap.server import protocol as P
from kvcap.server.chat_reply import ChoiceStream, chat_message
from kvcap.server.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from kvcap.server.serving import OpenAIServing
from kvcap.server.tool_parsers import KEEPS_SPECIAL_TOKENS, PARSERS

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _PromptOnly:
    """A request's outputs without what it generated: echo with max_tokens 0 (as vLLM and
    OpenAI's legacy completions take it) scores a prompt -- its text and logprobs alone. The
    engine samples one token, which no output shows or counts."""

    def __init__(self, stream):
        self._stream = stream

    @property
    def finished(self) -> bool:
        return self._stream.finished

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        out = await self._stream.next(timeout)
        if out is None:
            return None
        return dataclasses.replace(out, token_ids=[], text="",
                                   logprobs=None if out.logprobs is None else [],
                                   finish_reason="length" if out.finished else None)

    def abort(self) -> None:
        self._stream.abort()


async def completion(serving: OpenAIServing, name: str, max_pending: int,
                     req: P.CompletionRequest, request: Request) -> Response:
    """`name`: the served model's name; `max_pending`: the admission limit."""
    serving.check_model(req.model)
    prompt_only = req.max_tokens == 0
    if prompt_only and not req.echo:
        raise P.APIError(400, "max_tokens: 0 needs echo: true (the prompt alone, with its "
                         "logprobs); to generate, at least 1", param="max_tokens")
    prompts = serving.completion_prompts(req.prompt, req.add_special_tokens)
    if len(prompts) * req.n > max_pending:
        raise P.APIError(400, f"prompt: at most {max_pending} prompts x n choices per "
                         "request", param="prompt")
    max_tokens = 1 if prompt_only else req.max_tokens
    params = [serving.params_for(req, ids, max_tokens, "prompt") for ids in prompts]
    streams = serving.submit(serving.choices(list(zip(prompts, params, strict=True)), req.n),
                             stream=req.stream)
    if prompt_only:
        streams = [_PromptOnly(s) for s in streams]
    echoes = serving.prompt_texts(req.prompt, prompts) if req.echo else None
    rid, created = P.new_id("cmpl"), P.now()
    texts = serving.token_texts
    offsets = [TextOffsets() for _ in streams]  # where each choice's next token text starts

    def logprobs(i: int, ids: list[int], lps: list) -> P.CompletionLogprobs | None:
        if req.logprobs is None or not ids:
            return None
        return completion_logprobs(texts, ids, lps, offsets[i])

    def response(choices: list[P.CompletionChoice], usage: P.UsageInfo | None = None):
        return P.CompletionResponse(id=rid, created=created, model=name, choices=choices,
                                    usage=usage)

    def opening(i: int, out: RequestOutput, usage: P.UsageInfo | None) -> P.CompletionResponse:
        return response([P.CompletionChoice(
            index=i, text=echoes[i // req.n],
            logprobs=logprobs(i, out.prompt_token_ids, out.prompt_logprobs or []))], usage)

    def chunk(i: int | None, text: str = "", finish: str | None = None, role: bool = False,
              usage: P.UsageInfo | None = None, out: RequestOutput | None = None,
              span: tuple[int, int] = (0, 0)):
        if role:
            return None
        if i is None:
            return response([], usage)
        lp = logprobs(i, out.token_ids[slice(*span)], out.logprobs[slice(*span)]) \
            if out is not None and out.logprobs is not None else None
        return response([P.CompletionChoice(index=i, text=text, finish_reason=finish,
                                            logprobs=lp)], usage)  # continuous usage, or None

    if req.stream:
        return _sse(serving, streams, req, chunk, [len(p) for p in prompts for _ in range(req.n)],
                    opening if req.echo else None)
    outs = await serving.collect(streams, request)
    choices = []
    for i, o in enumerate(outs):
        echo = echoes[i // req.n] if req.echo else ""
        lp = None
        if req.logprobs is not None:
            head = (o.prompt_token_ids, o.prompt_logprobs) if req.echo else ([], [])
            lp = logprobs(i, head[0] + o.token_ids, head[1] + o.logprobs)
        choices.append(P.CompletionChoice(index=i, text=echo + o.text, logprobs=lp,
                                          finish_reason=o.finish_reason))
    return JSONResponse(response(choices, _usage(outs, req.n)).model_dump())


async def chat_completion(serving: OpenAIServing, name: str, max_pending: int,
                          req: P.ChatCompletionRequest, request: Request) -> Response:
    serving.check_model(req.model)
    plan = req.tool_plan()
    auto = plan is not None and plan.mode == "auto"
    if auto and serving.tool_parser is None:
        raise P.APIError(
            400, "tool_choice: 'auto' (the default with tools) needs the server started with "
            f"--tool-call-parser ({' | '.join(PARSERS)}: the syntax the model writes calls in); "
            "or send tool_choice 'required' or {\"type\": \"function\", \"function\": "
            "{\"name\": ...}} (the output is then constrained to the tools' schemas), or 'none'",
            param="tool_choice", code="unsupported_parameter")
    ids = serving.chat_prompt(req)
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    if req.n > max_pending:
        raise P.APIError(400, f"n: at most {max_pending} choices per request", param="n")
    params = serving.params_for(req, ids, max_tokens, "messages")
    if serving.reasoning_parser is not None and params.structured:  # think first, then the
        params = dataclasses.replace(params, reasoning=serving.reasoning_parser)  # format
    if auto and serving.tool_parser in KEEPS_SPECIAL_TOKENS:  # its calls open with a control
        params = dataclasses.replace(params, skip_special_tokens=False)  # token: keep its text
    calls = plan if plan is not None and plan.mode != "none" else None
    streams = serving.submit(serving.choices([(ids, params)], req.n), stream=req.stream)
    rid, created = P.new_id("chatcmpl"), P.now()
    top_n = req.top_logprobs or 0
    shaped = calls is not None or serving.reasoning_parser is not None
    held: dict[int, ChoiceStream] = {}

    def logprobs(out: RequestOutput, span: tuple[int, int]) -> P.ChatLogprobs | None:
        if out.logprobs is None:
            return None
        return chat_logprobs(serving.token_texts, out.token_ids[slice(*span)],
                             out.logprobs[slice(*span)], top_n)

    def chunk(i: int | None, text: str = "", finish: str | None = None, role: bool = False,
              usage: P.UsageInfo | None = None, out: RequestOutput | None = None,
              span: tuple[int, int] = (0, 0)):
        delta = (
            {"role": "assistant", "content": ""} if role else {"content": text} if text else {}
        )
        if shaped and i is not None and not role:
            shaper = held.setdefault(i, ChoiceStream(calls, serving.tool_parser,
                                                     serving.reasoning_parser))
            delta, finish, span = shaper.event(text, finish, span)
            if delta is None:
                return None
        lp = logprobs(out, span) if out is not None and span[0] < span[1] else None
        choices = (
            [] if i is None else
            [P.ChunkChoice(index=i, delta=delta, finish_reason=finish, logprobs=lp)]
        )
        return P.ChatCompletionChunk(
            id=rid, created=created, model=name, choices=choices, usage=usage
        )

    if req.stream:
        return _sse(serving, streams, req, chunk, [len(ids)] * req.n)
    outs = await serving.collect(streams, request)
    return JSONResponse(
        P.ChatCompletionResponse(
            id=rid,
            created=created,
            model=name,
            choices=[
                P.ChatChoice(index=i, **chat_message(o.text, o.finish_reason, calls,
                                                     serving.tool_parser,
                                                     serving.reasoning_parser),
                             logprobs=logprobs(o, (0, len(o.token_ids))))
                for i, o in enumerate(outs)
            ],
            usage=_usage(outs, req.n),
        ).model_dump()
    )


def _sse(serving, streams, req, chunk, prompt_lens, opening=None) -> StreamingResponse:
    """The server-sent-events response both completion routes stream through; `prompt_lens`:
    each stream's prompt length, for the usage every event carries with continuous usage."""
    return StreamingResponse(
        serving.stream(streams, req.stop_list, chunk, req.include_usage, opening, req.n,
                       prompt_lens if req.continuous_usage else None),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


def _usage(outs, n: int) -> P.UsageInfo:
    """Every n outputs share a prompt (n choices): its tokens count once."""
    return P.UsageInfo.of(
        sum(len(o.prompt_token_ids) for o in outs[::n]), sum(len(o.token_ids) for o in outs)
    )
