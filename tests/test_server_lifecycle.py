"""Server lifecycle over a real uvicorn on loopback: clients that leave at awkward moments,
bursts past the admission bound, engine-step failures, shutdown with streams open. Every KV
block must be back in the pool afterwards and /metrics must account for every request.

Every blocking call has its own timeout, and a watchdog ends the run should one still hang."""

from __future__ import annotations

import faulthandler
import json
import socket
import threading

import httpx
import pytest
from server_helpers import (
    StepDelay,
    ThreadedServer,
    metrics,
    wait_drained,
    wait_until,
)

from kvcap import LLM
from kvcap.server.app import create_app

KEY = "k"
MAX_PENDING = 6  # max_num_seqs 4 + 2 queued
CMPL = "/v1/completions"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ABORT = 'kvcap_requests_total{outcome="abort"}'
LENGTH = 'kvcap_requests_total{outcome="length"}'


@pytest.fixture(autouse=True)
def _watchdog():
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _llm(tiny_dir):
    return LLM(model=str(tiny_dir), device="cpu", num_blocks=64, max_num_seqs=4)


@pytest.fixture(scope="module")
def srv(tiny_dir):
    llm = _llm(tiny_dir)
    delay = StepDelay(llm.engine)
    app = create_app(llm, served_model_name="tiny", api_key=KEY, max_pending=MAX_PENDING,
                     poll_s=0.1)
    with ThreadedServer(app) as server:
        server.llm, server.delay = llm, delay
        yield server


@pytest.fixture
def slow(srv):
    srv.delay.delay = 0.05
    yield srv
    srv.delay.delay = 0.0
    wait_drained(srv.url, timeout=20)


def _raw_request(port: int, body: dict, path: str = CMPL) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


LONG = {"model": "tiny", "prompt": "hello there", "max_tokens": 200, "ignore_eos": True,
        "stream": True}  # 200 steps x 50 ms: 10 s unless aborted


def test_disconnect_right_after_sending(slow):
    before = metrics(slow.url)
    _raw_request(slow.port, LONG).close()
    m = wait_drained(slow.url, timeout=5)
    assert m[LENGTH] == before[LENGTH]  # never ran to its end


def test_disconnect_before_the_first_chunk(slow):
    before = metrics(slow.url)
    slow.delay.delay = 0.5  # the prefill is slow: the headers come long before any text
    sock = _raw_request(slow.port, LONG)
    head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"data:" not in head
    sock.close()
    slow.delay.delay = 0.05
    m = wait_drained(slow.url, timeout=5)
    assert m[ABORT] == before[ABORT] + 1 and m[LENGTH] == before[LENGTH]


def test_burst_past_the_admission_bound(slow):
    before = metrics(slow.url)
    results: list[int | str] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            with httpx.Client(base_url=slow.url, headers=HEADERS, timeout=20) as c:
                r = c.post(CMPL, json={"model": "tiny", "prompt": "hi", "max_tokens": 8,
                                       "ignore_eos": True})
                out = r.status_code if r.status_code != 200 else \
                    r.json()["choices"][0]["finish_reason"]
        except Exception as e:  # noqa: BLE001 -- reported in the assertion below
            out = repr(e)
        with lock:
            results.append(out)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 16 and set(results) <= {"length", 429}, results
    ok = results.count("length")
    assert ok >= MAX_PENDING and results.count(429) == 16 - ok
    m = wait_drained(slow.url, timeout=10)
    assert m[LENGTH] == before[LENGTH] + ok
    key = 'kvcap_http_requests_total{endpoint="/v1/completions",status="429"}'
    assert m[key] == before.get(key, 0) + 16 - ok


def test_step_error_fails_the_running_requests_only(slow):
    """4 running + 2 queued: one failing step fails the 4, the 2 queued then run to the end."""
    before = metrics(slow.url)
    runner = slow.llm.runner
    real, armed = runner.launch, threading.Event()

    def failing_once(*a, **kw):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected failure")
        return real(*a, **kw)

    runner.launch = failing_once
    results: list[str] = []
    lock = threading.Lock()

    def one() -> None:
        text = ""
        with httpx.Client(base_url=slow.url, headers=HEADERS, timeout=20) as c, \
                c.stream("POST", CMPL, json={**LONG, "max_tokens": 30}) as r:
            for line in r.iter_lines():
                text += line
        with lock:
            results.append("failed" if "injected failure" in text else
                           "length" if '"finish_reason":"length"' in text else text)

    threads = [threading.Thread(target=one) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: (m := metrics(slow.url))["kvcap_requests_running"] == 4
                   and m["kvcap_queue_length"] == 2, 10, "4 running and 2 queued")
        armed.set()
        for t in threads:
            t.join(30)
    finally:
        runner.launch = real
    assert sorted(results) == ["failed"] * 4 + ["length"] * 2, results
    m = wait_drained(slow.url, timeout=10)
    err = 'kvcap_requests_total{outcome="error"}'
    assert m[err] == before[err] + 4 and m[LENGTH] == before[LENGTH] + 2
    assert m["kvcap_engine_step_errors_total"] == before["kvcap_engine_step_errors_total"] + 1
    assert httpx.get(f"{slow.url}/health", timeout=5).status_code == 200


def test_disconnect_while_sending_the_body(slow):
    """A client that hangs up mid-body submitted nothing; it is no server error (it was a 500,
    logged twice with tracebacks): 499, as a non-streamed request whose client left."""
    before = metrics(slow.url)
    sock = socket.create_connection(("127.0.0.1", slow.port), timeout=10)
    sock.sendall(f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"mo".encode())
    wait_until(lambda: metrics(slow.url)["kvcap_requests_in_flight"] == 0, 5, "idle")
    sock.close()
    key = 'kvcap_http_requests_total{endpoint="/v1/completions",status="%d"}'
    wait_until(lambda: metrics(slow.url).get(key % 499, 0) == before.get(key % 499, 0) + 1, 5,
               "the hang-up to be counted")
    m = wait_drained(slow.url, timeout=5)
    assert m.get(key % 500, 0) == before.get(key % 500, 0)
    assert sum(v for k, v in m.items() if k.startswith("kvcap_requests_total")) == \
        sum(v for k, v in before.items() if k.startswith("kvcap_requests_total"))


def _read_stream(url: str, body: dict, lines: list[str], opened: threading.Event) -> None:
    try:
        with httpx.Client(base_url=url, headers=HEADERS, timeout=20) as c, \
                c.stream("POST", CMPL, json=body) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if line.startswith("data: {"):
                    opened.set()
    except httpx.HTTPError as e:  # the server cut the stream at the end of its grace
        lines.append(repr(e))
    opened.set()


def test_shutdown_with_streams_open(tiny_dir):
    """uvicorn's graceful shutdown: a stream that ends within the grace ends normally; one
    that does not is cut, its request aborted; the engine loop stops, every block is free."""
    llm = _llm(tiny_dir)
    StepDelay(llm.engine).delay = 0.05
    app = create_app(llm, served_model_name="tiny", api_key=KEY, shutdown_grace_s=1.0,
                     poll_s=0.1)
    server = ThreadedServer(app)
    server.server.config.timeout_graceful_shutdown = 2
    short, long_ = [], []
    events = [threading.Event(), threading.Event()]
    with server:
        readers = [threading.Thread(target=_read_stream, args=(server.url, body, out, ev))
                   for body, out, ev in ((dict(LONG, max_tokens=15), short, events[0]),
                                         (LONG, long_, events[1]))]
        for t in readers:
            t.start()
        for ev in events:
            assert ev.wait(10)
        server.server.should_exit = True
        for t in readers:
            t.join(15)
        server.thread.join(15)
    assert not server.thread.is_alive() and not any(t.is_alive() for t in readers)
    assert short[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(short)
    assert "[DONE]" not in "".join(long_)  # 200 tokens x 50 ms: past the 2 s grace
    aeng = app.state.async_engine
    assert aeng.in_flight == 0 and not aeng._thread.is_alive() and not aeng.healthy
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
