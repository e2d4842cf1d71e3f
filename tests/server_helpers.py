"""Helpers for the server tests: a tiny real HF checkpoint, an in-thread uvicorn, metrics."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from kvcap.bench.serving import parse_metrics

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


def make_tiny_model(src: Path, dst: Path, max_position_embeddings: int = 256) -> Path:
    """A 2-layer random Llama with the embedded model's real tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((src / "config.json").read_text())
    cfg.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=max_position_embeddings)
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k != "kvcap_source"}
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


@contextmanager
def tiny_client(llm) -> Iterator:
    """An in-process TestClient of `llm`'s OpenAI app as the server tests run it (model name
    "tiny", 8 pending requests, 0.2 s polls); a server error comes back as a response."""
    from fastapi.testclient import TestClient

    from kvcap.server.app import create_app

    app = create_app(llm, served_model_name="tiny", max_pending=8, poll_s=0.2)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


class StepDelay:
    """Slows every engine step (instance attribute over Engine.step) so requests stay alive."""

    def __init__(self, engine):
        self.delay, self._step = 0.0, engine.step
        engine.step = self

    def __call__(self):
        if self.delay:
            time.sleep(self.delay)
        return self._step()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class ThreadedServer:
    """uvicorn serving `app` on a free loopback port in a daemon thread."""

    def __init__(self, app, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None,
                                access_log=False, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        wait_until(lambda: self.server.started, 60, "server start")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def wait_drained(url: str, timeout: float = 30) -> dict[str, float]:
    """Until nothing is in flight and every KV block is free again; returns the metrics."""
    box: dict[str, dict[str, float]] = {}

    def drained() -> bool:
        m = box["m"] = metrics(url)
        return (m["kvcap_requests_in_flight"] == 0
                and m["kvcap_kv_blocks_free"] == m["kvcap_kv_blocks_total"])

    wait_until(drained, timeout, "requests to drain and KV blocks to be freed")
    return box["m"]
