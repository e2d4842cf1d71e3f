"""`kvcap serve` as a process: a taken port is refused before the model loads; the E4M3 gate
refuses before the port is bound; SIGTERM finishes in-flight requests and exits 0."""

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
from server_helpers import free_port, port_is_open, wait_until

from kvcap.scales.overlay import MANIFEST_NAME


def serve_cmd(model, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvcap.cli", "serve", "--model", str(model), "--device", "cpu",
            "--port", str(port), "--served-model-name", "tiny", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


GATE_CASES = {  # case -> (extra serve arguments, text the one-line error must hold)
    "no_scales": ([], "Loaded 0/4 K/V scales. Missing:"),
    "missing_overlay": (["--kv-scales", "{tmp}/absent"], "does not exist"),
    "corrupt_overlay": (["--kv-scales", "{tmp}/corrupt"], MANIFEST_NAME),
}


def _gate_args(case: str, tmp_path) -> list[str]:
    (tmp_path / "corrupt").mkdir(exist_ok=True)
    (tmp_path / "corrupt" / MANIFEST_NAME).write_text("{ this is not json")
    return [a.format(tmp=tmp_path) for a in GATE_CASES[case][0]]


@pytest.mark.parametrize("case", list(GATE_CASES))
def test_gate_refuses_before_binding(tiny_dir, tmp_path, capsys, case, monkeypatch):
    """In process: `kvcap serve` returns 2 with the one-line message while the port is held by
    the test (had serve bound first, it would have failed differently, and never returned 2).
    The listen-address probe that runs before the model loads is switched off here: it would
    refuse the held port first."""
    from kvcap.cli import main

    monkeypatch.setattr("kvcap.commands.serve.check_listen_address", lambda host, port: None)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        argv = serve_cmd(tiny_dir, holder.getsockname()[1], "--kv-cache-dtype", "fp8_e4m3",
                         *_gate_args(case, tmp_path))[3:]
        assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and GATE_CASES[case][1] in err[-1], err[-1]
    assert not any("Uvicorn running" in line for line in err)


def test_gate_refusal_exit_status_of_the_process(tiny_dir, tmp_path):
    # a free port (a held one is refused before the gate runs): a server that started instead
    # of refusing would run into the timeout
    p = subprocess.run(serve_cmd(tiny_dir, free_port(), "--kv-cache-dtype", "fp8_e4m3",
                                 *_gate_args("corrupt_overlay", tmp_path)),
                       capture_output=True, text=True, timeout=300, env=_env())
    assert p.returncode == 2, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and MANIFEST_NAME in last and "Traceback" not in p.stderr
    assert "Uvicorn running" not in p.stderr


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


def test_a_taken_port_is_refused_before_the_model_loads(tmp_path):
    """The listen address is checked first: a model path that does not exist is not even
    looked at while the port is taken."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = subprocess.run([*serve_cmd(tmp_path / "absent", port), "--host", "127.0.0.1"],
                           capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "absent" not in r.stderr
