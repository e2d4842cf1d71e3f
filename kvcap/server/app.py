"""The FastAPI app: OpenAI `/v1/completions`, `/v1/chat/completions`, `/v1/models` (and
`/v1/models/{id}`), vLLM's `/tokenize`, `/detokenize` and `/version`, plus `/health` and
Prometheus `/metrics` (the only routes an API key does not guard: probes and scrapers carry
none).

The two completion routes' work is in `completions.py`. `create_app(llm, ...)` wraps an
already-built LLM (the E4M3 gate has run by then). The engine
loop starts with the app's lifespan and shuts down gracefully with it. Errors always use the
OpenAI body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvcap import __version__
from kvcap.server import protocol as P
from kvcap.server.async_engine import AsyncEngine
from kvcap.server.completions import chat_completion, completion
from kvcap.server.metrics import CONTENT_TYPE, ServerInfo, ServerMetrics
from kvcap.server.serving import OpenAIServing

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")


class GuardMiddleware:
    """Pure ASGI (keeps streaming and disconnects intact): the API key on every route but
    OPEN_PATHS, status counts."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServerMetrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    def _auth_error(self, scope: Scope) -> P.APIError | None:
        if not self.api_key or scope["path"] in OPEN_PATHS:
            return None
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if not auth:
            return P.APIError(
                401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            return P.APIError(401, "incorrect API key", code="invalid_api_key")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            err = self._auth_error(scope)
            if err is not None:
                await JSONResponse(err.body(), err.status)(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            self.metrics.count_http(scope["path"], status)


def create_app(
    llm,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_pending: int = 256,
    shutdown_grace_s: float = 30.0,
    poll_s: float = 1.0,
    sampling_defaults: dict[str, Any] | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """`max_pending`: unfinished requests admitted at once (running + queued); more -> 429.
    `sampling_defaults`: temperature / top_p / top_k / min_p / repetition_penalty for requests
    that leave them out (the checkpoint's generation config: loader.read_sampling_defaults).
    `tool_call_parser`: the syntax tool_choice "auto" parses (kvcap/server/tool_parsers.py);
    `reasoning_parser`: how a reply's thinking is split off (kvcap/server/reasoning.py)."""
    from kvcap.models.loader import load_tokenizer

    name = served_model_name or "default"
    aeng = AsyncEngine(llm.engine, max_pending=max_pending)
    # The engine thread detokenizes with llm.tokenizer; the event loop gets its own instance.
    tokenizer = load_tokenizer(llm.model_dir) if llm.model_dir is not None else None
    if tokenizer is not None and llm.tokenizer is not None:  # e.g. set by --chat-template
        tokenizer.chat_template = llm.tokenizer.chat_template
    serving = OpenAIServing(
        aeng, tokenizer, name, llm.max_model_len, llm.spec.vocab_size, poll_s=poll_s,
        sampling_defaults=sampling_defaults, tool_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
    )
    pool = llm.pool
    info = ServerInfo(
        model=name,
        kv_dtype=llm.kv_dtype,
        gate_status="passed" if pool.is_fp8 and pool.scales_finalized else "not_required",
        scale_source=str(pool.scale_source or "none"),
    )
    metrics = ServerMetrics(info)
    logger.info(
        "serving %s as '%s' (KV %s, gate %s, admission limit %d)",
        llm.model_dir,
        name,
        info.kv_dtype,
        info.gate_status,
        max_pending,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        aeng.start()
        yield
        await aeng.shutdown(shutdown_grace_s)

    app = FastAPI(title="kvcap", lifespan=lifespan)
    app.add_middleware(GuardMiddleware, api_key=api_key, metrics=metrics)
    app.state.async_engine, app.state.metrics, app.state.serving = aeng, metrics, serving

    @app.exception_handler(P.APIError)
    async def _api_error(_: Request, e: P.APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # Keep the exception's headers: a 405 must say which methods the route takes (Allow).
        return JSONResponse(
            P.APIError(e.status_code, str(e.detail)).body(),
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(_: Request, e: ClientDisconnect) -> JSONResponse:
        # The client left while sending its body: nothing was submitted. Without this the
        # catch-all below answered 500 -- two tracebacks logged and a server error counted in
        # /metrics for every client that hung up. 499 as `collect` counts a client that left.
        return JSONResponse(P.APIError(499, "client disconnected").body(), status_code=499)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(P.APIError(500, f"internal error: {e}").body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = aeng.healthy
        return JSONResponse(
            {"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(
            metrics.render(aeng.stats(), aeng.in_flight), media_type=CONTENT_TYPE
        )

    def card() -> P.ModelCard:
        return P.ModelCard(id=name, created=P.now(), max_model_len=llm.max_model_len)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return P.ModelList(data=[card()]).model_dump()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        """OpenAI's retrieve-model call (`client.models.retrieve`)."""
        serving.check_model(model)
        return card().model_dump()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = P.parse_request(await request.body(), P.CompletionRequest)
        return await completion(serving, name, max_pending, req, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = P.parse_request(await request.body(), P.ChatCompletionRequest)
        return await chat_completion(serving, name, max_pending, req, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's token counting route: a prompt or chat messages -> token ids."""
        req = P.parse_request(await request.body(), P.TokenizeRequest)
        if req.model is not None:
            serving.check_model(req.model)
        if req.chat_template is not None:  # (was ignored: tokens of another prompt counted)
            raise P.APIError(400, "chat_template: only the default value is supported by kvcap",
                             param="chat_template", code="unsupported_parameter")
        if (req.prompt is None) == (req.messages is None):
            raise P.APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            if req.add_special_tokens:
                raise P.APIError(400, "add_special_tokens: applies to a prompt; with messages the "
                                 "chat template writes the special tokens itself",
                                 param="add_special_tokens")
            ids = serving.chat_prompt(req)
        elif serving.tokenizer is None:
            raise P.APIError(400, "prompt: this model has no tokenizer", param="prompt")
        else:
            ids = serving.completion_prompts(req.prompt, req.add_special_tokens is not False)[0]
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = P.parse_request(await request.body(), P.DetokenizeRequest)
        if req.model is not None:
            serving.check_model(req.model)
        if any(not 0 <= t < llm.spec.vocab_size for t in req.tokens):
            raise P.APIError(400, f"tokens: token ids must be in [0, {llm.spec.vocab_size})",
                             param="tokens")
        if serving.tokenizer is None:
            raise P.APIError(400, "tokens: this model has no tokenizer", param="tokens")
        return {"prompt": serving.tokenizer.decode(req.tokens)}

    return app
