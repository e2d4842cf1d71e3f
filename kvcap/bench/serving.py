"""Load generator for `kvcap serve` (loopback only).

    python -m kvcap.bench.serving --url http://127.0.0.1:8000 --num-requests 500 \
        --concurrency 32 --max-tokens 8 --disconnect-fraction 0.33 --output load.json

Every request streams (`stream_options.include_usage`), so TTFT (send -> first text), TPOT
((last chunk - first text) / (tokens - 1)) and token counts are measured from the wire.
Arrivals: Poisson or fixed-rate at `--rate` req/s (default: as fast as `--concurrency` allows),
bounded by `--num-requests` and `--duration`. A `--disconnect-fraction` of the clients (chosen
with `--seed`) close their connection right after the first text chunk. After the load the
server's /metrics are polled until nothing is in flight, then KV blocks free vs total and the
server's request outcomes are reported. Non-loopback hosts are refused.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import math
import random
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
from tqdm.auto import tqdm

from kvcap.commands.common import positive_float, positive_int
from kvcap.scales.fsutil import atomic_write_text

logger = logging.getLogger("kvcap.bench.serving")

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey yankee").split()


@dataclass
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id of /v1/models
    endpoint: str = "completions"  # completions | chat
    num_requests: int = 100
    concurrency: int = 32
    rate: float = math.inf  # requests per second
    arrival: str = "poisson"  # poisson | fixed
    duration_s: float | None = None  # stop issuing new requests after this long
    max_tokens: int = 8
    prompt_words: int = 16
    ignore_eos: bool = True
    disconnect_fraction: float = 0.0
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0
    drain_timeout_s: float = 120.0
    progress: bool = True


@dataclass
class Result:
    ok: bool = False
    disconnected: bool = False  # closed by this client on purpose
    error: str | None = None
    ttft: float | None = None
    latency: float | None = None
    tokens: int = 0
    tpot: float | None = None
    finish_reason: str | None = None
    extra: dict = field(default_factory=dict)


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        loop = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loop = False
    if not loop:
        raise ValueError(f"refusing to load {host or url!r}: only loopback hosts "
                         "(127.0.0.0/8, ::1, localhost) may be targeted")


def _body(cfg: LoadConfig, model: str, rng: random.Random) -> tuple[str, dict]:
    text = " ".join(rng.choice(WORDS) for _ in range(cfg.prompt_words))
    common = {"model": model, "max_tokens": cfg.max_tokens, "stream": True,
              "stream_options": {"include_usage": True}, "ignore_eos": cfg.ignore_eos,
              "seed": rng.randrange(2**31)}
    if cfg.endpoint == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**common, "prompt": text}


def _text_of(chunk: dict) -> tuple[str, str | None]:
    if not chunk.get("choices"):
        return "", None
    c = chunk["choices"][0]
    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
    return text or "", c.get("finish_reason")


async def one_request(client: httpx.AsyncClient, path: str, body: dict,
                      disconnect: bool) -> Result:
    res = Result()
    t0 = time.perf_counter()
    t_last = t0
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                res.error = f"HTTP {resp.status_code}"
                res.extra["body"] = resp.text[:300]
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {chunk['error'].get('message')}"
                    return res
                text, finish = _text_of(chunk)
                now = time.perf_counter()
                if text and res.ttft is None:
                    res.ttft = now - t0
                    if disconnect:
                        res.disconnected = True
                        return res  # leaving the block closes the connection mid-stream
                if text or finish:
                    t_last = now
                res.finish_reason = finish or res.finish_reason
                if chunk.get("usage"):
                    res.tokens = int(chunk["usage"]["completion_tokens"])
        res.latency = t_last - t0
        if res.tokens > 1 and res.ttft is not None:
            res.tpot = (t_last - t0 - res.ttft) / (res.tokens - 1)
        res.ok = res.finish_reason is not None
        if not res.ok:
            res.error = "stream ended without a finish_reason"
    except httpx.HTTPError as e:
        res.error = type(e).__name__
    return res


def _stats(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    xs = sorted(xs)

    def pct(p: float) -> float:
        return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]

    return {"mean": statistics.fmean(xs), "p50": pct(50), "p90": pct(90), "p99": pct(99),
            "max": xs[-1]}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        # label values are quoted and may hold braces (the route template
        # endpoint="/v1/models/{model}"): `{[^}]*}` dropped such a sample
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{(?:[^}"]|"(?:[^"\\]|\\.)*")*\})?) (\S+)$',
                     line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


async def server_state(client: httpx.AsyncClient, drain_timeout_s: float) -> dict:
    """Poll /metrics until nothing is in flight; report KV blocks and request outcomes."""
    deadline = time.monotonic() + drain_timeout_s
    while True:
        m = parse_metrics((await client.get("/metrics")).text)
        drained = m.get("kvcap_requests_in_flight", 0) == 0 and \
            m.get("kvcap_kv_blocks_free") == m.get("kvcap_kv_blocks_total")
        if drained or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    outcomes = {k.split('"')[1]: int(v) for k, v in m.items()
                if k.startswith("kvcap_requests_total{")}
    return {"drained": drained, "in_flight": int(m.get("kvcap_requests_in_flight", -1)),
            "kv_blocks_total": int(m.get("kvcap_kv_blocks_total", -1)),
            "kv_blocks_free": int(m.get("kvcap_kv_blocks_free", -1)),
            "requests_total": outcomes}


async def run_load(cfg: LoadConfig) -> dict:
    check_loopback(cfg.url)
    rng = random.Random(cfg.seed)
    n_drop = round(cfg.disconnect_fraction * cfg.num_requests)
    drops = set(rng.sample(range(cfg.num_requests), n_drop))
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=cfg.url, headers=headers, limits=limits,
                                 timeout=cfg.timeout_s, trust_env=False) as client:
        model = cfg.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        before = await server_state(client, 0)
        sem = asyncio.Semaphore(cfg.concurrency)
        results: list[Result] = []
        bar = tqdm(total=cfg.num_requests, desc="requests", disable=not cfg.progress)

        async def worker(i: int) -> None:
            try:
                path, body = _body(cfg, model, random.Random(cfg.seed * 1_000_003 + i))
                results.append(await one_request(client, path, body, i in drops))
            finally:
                sem.release()
                bar.update(1)

        tasks = []
        start = time.perf_counter()
        for i in range(cfg.num_requests):
            if cfg.duration_s is not None and time.perf_counter() - start > cfg.duration_s:
                break
            if math.isfinite(cfg.rate) and i:
                gap = rng.expovariate(cfg.rate) if cfg.arrival == "poisson" else 1 / cfg.rate
                await asyncio.sleep(gap)
            await sem.acquire()
            tasks.append(asyncio.create_task(worker(i)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        bar.close()
        after = await server_state(client, cfg.drain_timeout_s)
    return _report(cfg, results, elapsed, before, after)


def _report(cfg: LoadConfig, results: list[Result], elapsed: float, before: dict,
            after: dict) -> dict:
    done = [r for r in results if r.ok]
    errors = Counter(r.error for r in results if r.error and not r.disconnected)
    tokens = sum(r.tokens for r in done)
    server_delta = {k: v - before["requests_total"].get(k, 0)
                    for k, v in after["requests_total"].items()}
    return {
        "config": asdict(cfg) | {"rate": None if math.isinf(cfg.rate) else cfg.rate},
        "requests": {"planned": cfg.num_requests, "sent": len(results), "completed": len(done),
                     "disconnected": sum(r.disconnected for r in results),
                     "failed": sum(errors.values())},
        "errors": dict(errors),
        "finish_reasons": dict(Counter(r.finish_reason for r in done)),
        "ttft_s": _stats([r.ttft for r in results if r.ttft is not None]),
        "tpot_s": _stats([r.tpot for r in done if r.tpot is not None]),
        "latency_s": _stats([r.latency for r in done if r.latency is not None]),
        "throughput": {"duration_s": elapsed, "requests_per_s": len(done) / elapsed,
                       "output_tokens_per_s": tokens / elapsed, "output_tokens": tokens},
        "server": after | {"requests_ended_during_run": server_delta},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = LoadConfig()
    ap.add_argument("--url", default=d.url)
    ap.add_argument("--model", default=None)
    ap.add_argument("--endpoint", choices=["completions", "chat"], default=d.endpoint)
    ap.add_argument("--num-requests", type=positive_int, default=d.num_requests)
    ap.add_argument("--concurrency", type=positive_int, default=d.concurrency)
    ap.add_argument("--rate", type=positive_float, default=d.rate,
                    help="req/s (default: unbounded)")
    ap.add_argument("--arrival", choices=["poisson", "fixed"], default=d.arrival)
    ap.add_argument("--duration", type=positive_float, default=None, dest="duration_s")
    ap.add_argument("--max-tokens", type=positive_int, default=d.max_tokens)
    ap.add_argument("--prompt-words", type=positive_int, default=d.prompt_words)
    ap.add_argument("--disconnect-fraction", type=float, default=0.0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    if not 0.0 <= args.disconnect_fraction <= 1.0:
        ap.error(f"--disconnect-fraction must be between 0 and 1, got {args.disconnect_fraction}")
    if args.output is not None and (args.output.is_dir() or not args.output.parent.is_dir()):
        # (was found only once the whole load had run, and the report was lost)
        ap.error(f"--output {args.output}: not a file in an existing directory")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = LoadConfig(**{k: v for k, v in vars(args).items() if k != "output"})
    try:
        report = asyncio.run(run_load(cfg))
    except ValueError as e:
        logger.error("%s", e)
        return 2
    except httpx.ConnectError as e:
        logger.error("no server answers at %s (%s): start one with `kvcap serve` or pass --url",
                     cfg.url, e)
        return 2
    text = json.dumps(report, indent=2)
    if args.output:
        atomic_write_text(args.output, text + "\n")
        logger.info("wrote %s", args.output)
    sys.stdout.write(text + "\n")
    r = report["requests"]
    logger.info("%d completed, %d disconnected, %d failed; KV free %d/%d", r["completed"],
                r["disconnected"], r["failed"], report["server"]["kv_blocks_free"],
                report["server"]["kv_blocks_total"])
    return 0 if r["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
