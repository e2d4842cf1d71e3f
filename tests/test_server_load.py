"""Load on the real `kvcap serve` process with the embedded model (CPU): 500 streamed requests
at concurrency 32, then again with a third of the clients disconnecting mid-stream. Zero
failures, every request accounted for on both sides, every KV block free afterwards.

Concurrency and request count can be raised for bigger machines with KVCAP_LOAD_CONCURRENCY /
KVCAP_LOAD_REQUESTS (e.g. 64 on an H200)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from server_helpers import free_port, port_is_open, wait_until

from kvcap.bench.serving import LoadConfig, run_load

pytestmark = pytest.mark.slow

N = int(os.environ.get("KVCAP_LOAD_REQUESTS", "500"))
CONCURRENCY = int(os.environ.get("KVCAP_LOAD_CONCURRENCY", "32"))


@pytest.fixture(scope="module")
def server_url(default_model_dir, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    device = "cuda" if os.environ.get("KVCAP_LOAD_DEVICE") == "cuda" else "cpu"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvcap.cli", "serve", "--model", "default", "--device",
             device, "--port", str(port), "--max-num-seqs", str(max(64, CONCURRENCY))],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: proc.poll() is not None or port_is_open(port), 300, "server")
            assert proc.poll() is None, log_path.read_text()
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            rc = proc.wait(120)
    assert rc == 0, log_path.read_text()[-3000:]


def _load(url: str, fraction: float) -> dict:
    cfg = LoadConfig(url=url, num_requests=N, concurrency=CONCURRENCY, max_tokens=8,
                     disconnect_fraction=fraction, progress=False, seed=1)
    return asyncio.run(run_load(cfg))


def _check(report: dict, expect_disconnected: int) -> None:
    req, server = report["requests"], report["server"]
    assert report["errors"] == {} and req["failed"] == 0, report["errors"]
    assert req["sent"] == N
    assert req["disconnected"] == expect_disconnected
    assert req["completed"] + req["disconnected"] == N  # every request accounted for
    assert report["finish_reasons"] == {"length": N - expect_disconnected}  # ignore_eos
    ended = server["requests_ended_during_run"]
    assert sum(ended.values()) == N and ended["error"] == 0, ended
    assert ended["length"] + ended["abort"] == N
    assert server["drained"] and server["in_flight"] == 0
    assert server["kv_blocks_free"] == server["kv_blocks_total"] > 0  # no leaked block


def test_load_no_failures_no_leak(server_url):
    report = _load(server_url, 0.0)
    _check(report, 0)
    assert report["server"]["requests_ended_during_run"]["abort"] == 0


def test_load_with_a_third_disconnecting(server_url):
    report = _load(server_url, 1 / 3)
    _check(report, round(N / 3))
    # Clients leave right after their first text chunk, 7 tokens before the end: the server
    # must have aborted (not finished) most of them.
    assert report["server"]["requests_ended_during_run"]["abort"] >= round(N / 3) // 2
