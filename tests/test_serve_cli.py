"""`kvcap serve` as a process: the E4M3 gate refuses before the port is bound; SIGTERM finishes
in-flight requests and exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from server_helpers import free_port, make_tiny_model, port_is_open, wait_until

from kvcap.scales.overlay import MANIFEST_NAME


@pytest.fixture(scope="module")
def tiny_dir(default_model_dir, tmp_path_factory):
    return make_tiny_model(default_model_dir, tmp_path_factory.mktemp("tiny") / "model")


def serve_cmd(model, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvcap.cli", "serve", "--model", str(model), "--device", "cpu",
            "--port", str(port), "--served-model-name", "tiny", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("case", ["no_scales", "missing_overlay", "corrupt_overlay"])
def test_gate_refuses_before_binding(tiny_dir, tmp_path, case):
    extra = ["--kv-cache-dtype", "fp8_e4m3"]
    if case == "missing_overlay":
        extra += ["--kv-scales", str(tmp_path / "absent")]
    elif case == "corrupt_overlay":
        (tmp_path / MANIFEST_NAME).write_text("{ this is not json")
        extra += ["--kv-scales", str(tmp_path)]
    with socket.socket() as holder:  # hold the port: binding first would fail differently
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        p = subprocess.run(serve_cmd(tiny_dir, port, *extra), capture_output=True, text=True,
                           timeout=180, env=_env())
    assert p.returncode == 2, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in p.stderr
    assert "Uvicorn running" not in p.stderr and "address already in use" not in p.stderr
    expected = {"no_scales": "Loaded 0/4 K/V scales. Missing:",
                "missing_overlay": "does not exist", "corrupt_overlay": MANIFEST_NAME}[case]
    assert expected in last


def test_sigterm_finishes_in_flight_and_exits_zero(tiny_dir, tmp_path):
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(serve_cmd(tiny_dir, port, "--kv-cache-memory-gib", "0.001"),
                            stdout=log, stderr=subprocess.STDOUT, env=_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or port_is_open(port), 120, "server port")
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        events: list[dict] = []
        first = threading.Event()

        def client() -> None:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 40, "stream": True,
                    "ignore_eos": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append({"done": True} if line == "data: [DONE]"
                                      else json.loads(line[6:]))
                        first.set()

        t = threading.Thread(target=client)
        t.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert events[-1] == {"done": True}
    assert events[-2]["choices"][0]["finish_reason"] == "length" and text
    assert not port_is_open(port)
    assert "Shutting down" in (tmp_path / "serve.log").read_text()
