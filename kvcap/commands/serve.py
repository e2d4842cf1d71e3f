"""`kvcap serve`: the OpenAI-compatible HTTP server.

The LLM is built first, so the E4M3 scale gate (missing or corrupt overlay, missing
checkpoint scales) refuses with its one-line message and a non-zero exit before any port is
bound. SIGTERM / Ctrl-C: stop accepting connections, let in-flight requests finish for
`--shutdown-timeout` seconds, abort the rest, exit 0.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket

from kvcap.commands.common import (
    add_engine_arguments,
    engine_kwargs,
    non_negative_float,
    non_negative_int,
    port_number,
)
from kvcap.server.reasoning import PARSERS as REASONING_PARSERS
from kvcap.server.tool_parsers import PARSERS

HELP = "serve the OpenAI-compatible HTTP API (completions, chat, models, health, metrics)"

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVCAP_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        "(default: $KVCAP_API_KEY; unset or empty = no check)",
    )
    p.add_argument(
        "--max-queue",
        type=non_negative_int,
        default=256,
        help="requests that may wait beyond --max-num-seqs running ones; more -> 429",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients must send (default: the --model value)",
    )
    p.add_argument(
        "--generation-config",
        choices=("auto", "none"),
        default="auto",
        help="auto: the checkpoint's generation_config.json sampling values (temperature, "
        "top_p, top_k, min_p, repetition_penalty) are the defaults of requests that leave them "
        "out; none: OpenAI's defaults (temperature 1, no filtering)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default=None,
        help="the syntax the model writes tool calls in, for tool_choice 'auto' (OpenAI's "
        "default with tools): hermes (<tool_call> blocks: Qwen2.5/3, Hermes), llama3_json "
        "(Llama 3.x JSON calls), mistral ([TOOL_CALLS]) or pythonic ([f(a=1)]: Llama 3.2 / 4 "
        "pythonic templates); unset: 'auto' is refused, 'required' and named tools still work",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split a reasoning model's <think> ... </think> into the reply's "
        "reasoning_content: qwen3 (the reply may open <think>) or deepseek_r1 (the template "
        "opens it in the prompt)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )


def check_api_key(key: str | None) -> None:
    """A key clients can send: `--api-key ""` turned the check off without a word, and a key
    with spaces at its ends (the header's token is stripped) or outside printable ASCII (what
    HTTP clients send in a header) never matched, so every request was a 401."""
    from kvcap.errors import ConfigError

    if key is None:
        return
    if not key.strip():
        raise ConfigError("--api-key is empty: give a key, or leave --api-key out (and "
                          "$KVCAP_API_KEY unset) to serve without one")
    if key != key.strip() or not all(" " <= c <= "~" for c in key):
        raise ConfigError("--api-key must be printable ASCII without spaces at its ends (what "
                          "an 'Authorization: Bearer KEY' header can carry)")


def check_listen_address(host: str, port: int) -> None:
    """Fail before the model loads (minutes for a large one) when the server could not listen
    where asked: an unknown host, or a port another process holds. Bound as uvicorn binds it
    (SO_REUSEADDR) and released at once."""
    from kvcap.errors import ConfigError

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r}: {e.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as e:
            # (an address of another machine was told to pick another --port)
            what = (f"--host {host!r} is not an address of this machine: use 127.0.0.1 (this "
                    "machine only), 0.0.0.0 (every interface) or one of its own addresses"
                    if e.errno == errno.EADDRNOTAVAIL else
                    "pick another --port, or stop what holds it")
            raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}): {what}") from None


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvcap.errors import ConfigError
    from kvcap.llm import LLM
    from kvcap.server.app import create_app

    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {args.max_queue}")
    check_api_key(args.api_key)
    if args.served_model_name is not None and not args.served_model_name.strip():
        # (an empty name fell back to --model without a word)
        raise ConfigError("--served-model-name is empty: give the name clients send, or leave "
                          "it out to use the --model value")
    check_listen_address(args.host, args.port)
    defaults = {}
    if args.generation_config == "auto":
        from kvcap.models.loader import DUMMY_PREFIX, read_sampling_defaults, resolve_model_dir

        # read before the model loads (minutes for a large one): a generation_config.json
        # value out of range was refused only after the load
        if not str(args.model).startswith(DUMMY_PREFIX):
            defaults = read_sampling_defaults(resolve_model_dir(args.model))
    llm = LLM(**engine_kwargs(args))  # runs the gate; raises before the port is bound
    if defaults:
        logger.info("sampling defaults from the checkpoint's generation_config.json: %s "
                    "(requests override them; --generation-config none ignores them)",
                    defaults)
    app = create_app(
        llm,
        served_model_name=args.served_model_name or args.model,
        api_key=args.api_key,
        max_pending=args.max_num_seqs + args.max_queue,
        shutdown_grace_s=args.shutdown_timeout,
        sampling_defaults=defaults,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=args.shutdown_timeout,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it caught once it has shut down gracefully; a Python-level
    # SIGTERM handler turns that into a normal return (exit 0) instead of death by signal.
    previous = signal.signal(signal.SIGTERM, _graceful_done)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        llm.shutdown()  # tensor-parallel workers, if any
    if not server.started:
        logger.error("the server did not start (see the messages above)")
        return 1
    return 0


def _graceful_done(signum: int, frame) -> None:
    logger.info("shut down after signal %d", signum)
