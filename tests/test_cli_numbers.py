"""Numeric CLI arguments: a budget, size or length that is not positive is a one-line usage
error naming the argument (it was a ZeroDivisionError traceback or a table of zeros)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from kvcap.commands.common import (
    block_size,
    non_negative_float,
    port_number,
    positive_float,
    positive_int,
)

REFUSED = [(positive_float, t, "finite number > 0") for t in ("0", "-1", "nan", "inf", "x", "")]
REFUSED += [(positive_int, t, "integer >= 1") for t in ("0", "-3", "1.5", "x")]
REFUSED += [(port_number, t, "port number 0-65535") for t in ("-1", "65536", "70000", "http")]
REFUSED += [(non_negative_float, t, "finite number >= 0") for t in ("-1", "nan", "inf", "soon")]
REFUSED += [(block_size, t, "power of two") for t in ("0", "3", "24", "-16", "16.0")]


@pytest.mark.parametrize("parse, text, message", REFUSED)
def test_number_types_refuse(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse(text)


def test_numbers_in_range_pass_through():
    assert positive_float("0.25") == 0.25 and positive_int("16") == 16
    assert port_number("0") == 0 and port_number("65535") == 65535
    assert non_negative_float("0") == 0.0
    assert [block_size(t) for t in ("1", "16", "256")] == [1, 16, 256]


@pytest.mark.parametrize("args, name", [
    (["--memory-gib", "-1"], "--memory-gib"),
    (["--memory-gib", "1e300"], "--memory-gib"),  # (was an OverflowError traceback)
    (["--memory-gib", "8", "--block-size", "0"], "--block-size"),
    (["--memory-gib", "8", "--block-size", "3"], "--block-size"),
    (["--memory-gib", "8", "--context", "1024", "0"], "--context"),
])
def test_capacity_refuses_non_positive_numbers(args, name):
    res = subprocess.run([sys.executable, "-m", "kvcap.cli", "capacity", "--model", "default",
                          *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert f"argument {name}:" in res.stderr and "Traceback" not in res.stderr


def test_demo_refuses_zero_calibration_tokens():
    # 0 was read as "the default" through an `or`: a silent fallback
    res = subprocess.run([sys.executable, "-m", "kvcap.cli", "demo", "--calib-tokens", "0"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "argument --calib-tokens:" in res.stderr


def test_zero_max_model_len_is_a_config_error():
    from kvcap.config import EngineConfig
    from kvcap.errors import ConfigError

    with pytest.raises(ConfigError, match="max_model_len must be >= 1"):
        EngineConfig(max_model_len=0).validate()
    EngineConfig(max_model_len=None).validate()  # unset: the model's own limit


def test_serve_refuses_a_bad_port_before_loading_the_model():
    # it was an OverflowError traceback from socket.bind, after the model had loaded
    res = subprocess.run([sys.executable, "-m", "kvcap.cli", "serve", "--model", "default",
                          "--port", "70000"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "argument --port:" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("suite, args, name", [
    ("throughput", ["--repeats", "0"], "--repeats"),
    ("throughput", ["--out-tokens", "1"], "--out-tokens"),
    ("throughput", ["--context", "1024", "-5"], "--context"),
    ("throughput", ["--kv-gib", "-1"], "--kv-gib"),
    ("step_profile", ["--rows", "0"], "--rows"),
    ("serving", ["--concurrency", "0"], "--concurrency"),
    ("serving", ["--rate", "0"], "--rate"),
    ("verify_cost", ["--k", "0"], "--k"),
    ("gemm", ["--linears", "q_proj"], "--linears"),  # matched no linear: ran nothing
])
def test_bench_suites_refuse_bad_numbers(suite, args, name):
    # --repeats 0 was an IndexError after the model loaded, --out-tokens 1 a rate of 0
    res = subprocess.run([sys.executable, "-m", "kvcap.cli", "bench", suite, *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert f"argument {name}:" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("suite", ["verify_cost", "sampler"])
def test_bench_suite_usage_names_its_command(suite, capsys):
    # a suite's parser took its name from sys.argv[0]: "usage: kvcap [-h] ..." and "kvcap:
    # error: argument --k: ...", a command line that does not exist
    from kvcap.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", suite, "--no-such-flag"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith(f"usage: kvcap bench {suite} [-h]")
    assert f"kvcap bench {suite}: error: unrecognized arguments: --no-such-flag" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
@pytest.mark.parametrize("suite", ["throughput", "step_profile", "gemm", "verify_cost"])
def test_gpu_bench_suites_say_they_need_a_gpu(suite):
    # they were deep tracebacks from torch.cuda without one
    res = subprocess.run([sys.executable, "-m", "kvcap.cli", "bench", suite],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "measures on a CUDA GPU" in res.stderr and "Traceback" not in res.stderr


def test_serving_bench_without_a_server_is_one_line():
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = subprocess.run([sys.executable, "-m", "kvcap.cli", "bench", "serving", "--url",
                          f"http://127.0.0.1:{port}", "--num-requests", "1"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "no server answers at" in res.stderr and "Traceback" not in res.stderr


def test_serving_bench_refuses_a_fraction_outside_0_1():
    res = subprocess.run([sys.executable, "-m", "kvcap.cli", "bench", "serving",
                          "--disconnect-fraction", "2"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "--disconnect-fraction must be between 0 and 1" in res.stderr


@pytest.mark.parametrize("command, args, name", [
    ("compare", ["--contexts", "0"], "--contexts"),
    ("compare", ["--prompts", "-1"], "--prompts"),
    ("calibrate", ["--record-tokens", "0"], "--record-tokens"),
    ("calibrate", ["--max-tokens", "0"], "--max-tokens"),
    ("calibrate", ["--threads", "0"], "--threads"),
    ("generate", ["--max-tokens", "0", "hi"], "--max-tokens"),
    ("generate", ["--temperature", "-1", "hi"], "--temperature"),
    ("generate", ["--kv-cache-memory-gib", "-1", "hi"], "--kv-cache-memory-gib"),
    ("generate", ["--max-num-seqs", "0", "hi"], "--max-num-seqs"),
    ("serve", ["--max-queue", "-1"], "--max-queue"),
    ("serve", ["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    ("serve", ["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    ("generate", ["--block-size", "0", "hi"], "--block-size"),
    ("generate", ["--num-speculative-tokens", "-1", "hi"], "--num-speculative-tokens"),
    ("serve", ["--speculative-disable-by-batch-size", "0"], "--speculative-disable-by-batch-size"),
])
def test_commands_refuse_bad_numbers_before_loading(command, args, name):
    res = subprocess.run([sys.executable, "-m", "kvcap.cli", command, *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert f"argument {name}:" in res.stderr and "Traceback" not in res.stderr


def test_negative_kv_budget_is_a_config_error():
    from kvcap.config import EngineConfig
    from kvcap.errors import ConfigError

    for bad in (-1.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="kv_cache_memory_gib must be a finite number > 0"):
            EngineConfig(kv_cache_memory_gib=bad).validate()
    EngineConfig(kv_cache_memory_gib=0.5).validate()


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_engine_options_reach_the_llm(command, monkeypatch):
    import importlib

    mod = importlib.import_module(f"kvcap.commands.{command}")
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    args = p.parse_args([*(["--prompt", "hi"] if command == "generate" else []),
                         "--gpu-memory-utilization", "0.5", "--block-size", "32",
                         "--enforce-eager", "--no-prefix-caching", "--seed", "7",
                         "--qsa", "every4", "--chat-template", "{{ x }}"])
    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(**kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr("kvcap.llm.LLM", fake_llm)
    with pytest.raises(Stop):
        mod.run(args)
    assert {k: seen[k] for k in ("gpu_memory_utilization", "block_size", "enforce_eager",
                                 "enable_prefix_caching", "seed", "qsa", "chat_template")} == {
        "gpu_memory_utilization": 0.5, "block_size": 32, "enforce_eager": True,
        "enable_prefix_caching": False, "seed": 7, "qsa": "every4", "chat_template": "{{ x }}"}


def test_generate_sampling_options_reach_the_request(monkeypatch):
    from types import SimpleNamespace

    from kvcap.commands import generate

    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    args = p.parse_args(["--prompt", "hi", "--json", "--repetition-penalty", "1.2",
                         "--presence-penalty", "0.5", "--frequency-penalty", "-0.5",
                         "--min-p", "0.1", "--temperature", "0.7"])
    seen = []
    engine = SimpleNamespace(add_request=lambda rid, ids, params: seen.append(params),
                             has_unfinished=lambda: False, num_draft_tokens=0)
    fake = SimpleNamespace(engine=engine, tokenizer=SimpleNamespace(encode=lambda *a, **k: [1]))
    monkeypatch.setattr("kvcap.llm.LLM", lambda **kw: fake)
    assert generate.run(args) == 0
    sp = seen[0]
    assert (sp.json_object, sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty,
            sp.min_p, sp.temperature) == (True, 1.2, 0.5, -0.5, 0.1, 0.7)


def test_capacity_counts_a_sliding_windows_peak_blocks(tmp_path):
    """`kvcap capacity` on a model whose every layer slides (the Mistral-7B-v0.1 dummy shape,
    4,096 tokens): a 32K sequence holds its window's blocks, not 32K tokens' -- 20 GiB of FP16
    KV (163,840 tokens) holds 39 such sequences, where 5 would fit whole -- and it says so."""
    from pathlib import Path

    config = Path(__file__).resolve().parents[1] / "kvcap/bench/configs/mistral-7b-sw4k.json"
    res = subprocess.run([sys.executable, "-m", "kvcap.cli", "capacity", "--model",
                          f"dummy:{config}", "--memory-gib", "20", "--context", "32768"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    fp16 = next(line for line in res.stdout.splitlines() if line.startswith("│ fp16"))
    assert [c.strip() for c in fp16.split("│")[1:-1]] == ["fp16", "131072", "163,840", "39"]
    assert "every layer slides over 4,096 tokens" in res.stdout


def test_generate_warns_that_a_chat_template_needs_chat(monkeypatch, capsys):
    """--chat-template without --chat was read and then never used, without a word."""
    from kvcap.commands import generate

    p = argparse.ArgumentParser()
    generate.add_arguments(p)

    class Stop(Exception):
        pass

    def fake_llm(**kw):
        raise Stop

    monkeypatch.setattr("kvcap.llm.LLM", fake_llm)
    for extra, warned in (([], True), (["--chat"], False)):
        with pytest.raises(Stop):
            generate.run(p.parse_args(["--prompt", "hi", "--chat-template", "{{ x }}", *extra]))
        assert ("--chat-template applies with --chat only" in capsys.readouterr().err) == warned


@pytest.mark.parametrize("where", ["missing/load.json", "."])
def test_serving_bench_refuses_an_output_it_cannot_write_before_the_load(tmp_path, capsys,
                                                                         where):
    # the report was written only after the whole load had run: an --output in a directory
    # that does not exist (or a directory itself) failed there, and the report was lost
    from kvcap.bench.serving import main

    with pytest.raises(SystemExit) as e:  # (no server: the load is never reached)
        main(["--url", "http://127.0.0.1:9", "--num-requests", "1",
              "--output", str(tmp_path / where)])
    assert e.value.code == 2
    assert "--output" in capsys.readouterr().err
