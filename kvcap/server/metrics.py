"""Prometheus text exposition (format 0.0.4) of the server's counters and engine gauges."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from kvcap.server.async_engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
             "/version", "/tokenize", "/detokenize")
MODEL_ROUTE = "/v1/models/{model}"  # one label for every model name (bounded label values)


@dataclass(frozen=True)
class ServerInfo:
    model: str
    kv_dtype: str
    gate_status: str  # "passed" (E4M3 scales validated) | "not_required" (float KV cache)
    scale_source: str


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    """A sample value in full: `{value:g}` kept 6 significant digits, so a counter past a
    million (tokens, requests) was exported rounded (12345678 -> 1.23457e+07) and stood still
    between scrapes while it grew, which rate() read as no traffic and then a jump."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class ServerMetrics:
    """HTTP responses by endpoint and status; everything else comes from EngineStats."""

    def __init__(self, info: ServerInfo):
        self.info = info
        self._http: Counter[tuple[str, int]] = Counter()
        self._lock = threading.Lock()

    def count_http(self, path: str, status: int) -> None:
        if path in ENDPOINTS:
            endpoint = path
        elif path.startswith("/v1/models/"):
            endpoint = MODEL_ROUTE
        else:  # unknown paths (404s): one label, so scanners cannot grow the series set
            endpoint = "other"
        with self._lock:
            self._http[(endpoint, status)] += 1

    def http_counts(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return dict(self._http)

    def render(self, s: EngineStats, in_flight: int) -> str:
        lines: list[str] = []

        def metric(
            name: str, kind: str, doc: str, samples: list[tuple[dict[str, str], float]]
        ) -> None:
            lines.append(f"# HELP kvcap_{name} {doc}")
            lines.append(f"# TYPE kvcap_{name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                lines.append(
                    f"kvcap_{name}{{{lab}}} {_number(value)}" if lab
                    else f"kvcap_{name} {_number(value)}"
                )

        http = self.http_counts()
        metric(
            "http_requests_total",
            "counter",
            "HTTP responses by endpoint and status code.",
            [({"endpoint": e, "status": str(c)}, n) for (e, c), n in sorted(http.items())],
        )
        metric(
            "requests_total",
            "counter",
            "Engine requests that ended, by outcome.",
            [({"outcome": k}, s.finished.get(k, 0)) for k in ("stop", "length", "abort", "error")],
        )
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of ended requests.",
            [({}, s.prompt_tokens)],
        )
        metric(
            "generation_tokens_total",
            "counter",
            "Generated tokens of ended requests.",
            [({}, s.generation_tokens)],
        )
        metric("requests_in_flight", "gauge", "Admitted requests not yet ended.", [({}, in_flight)])
        metric("queue_length", "gauge", "Requests waiting for the scheduler.", [({}, s.waiting)])
        metric("requests_running", "gauge", "Requests in the running batch.", [({}, s.running)])
        metric(
            "kv_blocks_total", "gauge", "KV-cache blocks in the pool.", [({}, s.kv_blocks_total)]
        )
        metric(
            "kv_blocks_free",
            "gauge",
            "Free KV-cache blocks (incl. cached, unreferenced).",
            [({}, s.kv_blocks_free)],
        )
        metric(
            "kv_blocks_used",
            "gauge",
            "KV-cache blocks held by requests.",
            [({}, s.kv_blocks_total - s.kv_blocks_free)],
        )
        metric("engine_steps_total", "counter", "Engine steps run.", [({}, s.steps)])
        metric("spec_decode_draft_tokens_total", "counter",
               "Draft tokens verified (speculative decoding by prompt lookup).",
               [({}, s.draft_tokens)])
        metric("spec_decode_accepted_tokens_total", "counter",
               "Draft tokens kept: each one a token generated without a step of its own.",
               [({}, s.accepted_tokens)])
        metric(
            "engine_step_errors_total",
            "counter",
            "Engine steps that raised.",
            [({}, s.step_errors)],
        )
        i = self.info
        metric(
            "kv_cache_info",
            "gauge",
            "KV-cache dtype and scale source.",
            [({"model": i.model, "dtype": i.kv_dtype, "scale_source": i.scale_source}, 1)],
        )
        metric(
            "kv_scale_gate",
            "gauge",
            "E4M3 scale gate outcome at startup.",
            [({"status": i.gate_status}, 1)],
        )
        return "\n".join(lines) + "\n"
