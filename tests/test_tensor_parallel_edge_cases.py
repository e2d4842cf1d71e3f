"""Tensor-parallel edge cases on CPU (gloo, 2 ranks, tiny random models): shapes that do not
divide by the TP size, GQA with fewer KV heads than ranks, tied embeddings, and faults on one
worker only (a gate refusal, a crash in the group rendezvous or mid-run).

Faults are injected into the worker processes only: a `sitecustomize.py` on the PYTHONPATH the
workers inherit patches kvcap there (this process has started already and never reads it).
Every test runs with KVCAP_TP_TIMEOUT_S=60, so a regression fails instead of hanging CI."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvcap import LLM, SamplingParams
from kvcap.distributed.protocol import TensorParallelError
from kvcap.errors import ScaleGateError

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 301, "hidden_size": 64,
        "intermediate_size": 97, "num_hidden_layers": 2, "num_attention_heads": 6,
        "num_key_value_heads": 3, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "rope_theta": 10000.0}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SEQS = [[1, 5, 9, 33, 2, 7, 100, 250], [7, 100, 250, 3, 0]]


@pytest.fixture(autouse=True)
def bounded(monkeypatch):
    """One CPU thread per rank, and data collectives that give up after 60 s."""
    monkeypatch.setenv("KVCAP_TP_TIMEOUT_S", "60")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _model(tmp_path, **overrides) -> str:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**TINY, **overrides}))
    return f"dummy:{d}"


def _worker_pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive


_INJECT = """
import os
import kvcap.llm
from kvcap.distributed import comm
from kvcap.engine import model_runner

FAULT = os.environ.get("KVCAP_TEST_FAULT", "")
if FAULT == "init":  # the worker dies in the process-group rendezvous, after posting ready
    def init(self, store):
        raise RuntimeError("injected rendezvous failure")
    comm.Communicator.init = init
elif FAULT == "ctrl":  # killed in the control group's rendezvous, after the data group formed
    import signal
    def new_group(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    comm.dist.new_group = new_group
elif FAULT == "wedge-ctrl":  # alive but stuck before the control group's rendezvous
    import time
    def new_group(*args, **kwargs):
        time.sleep(3600)
    comm.dist.new_group = new_group
elif FAULT == "wedge-stats":  # alive but stuck computing its K/V statistics
    import time
    from kvcap.scales import observer
    def stats(self):
        time.sleep(3600)
    observer.KVStatsObserver.stats = stats
elif FAULT.startswith("drop:"):  # this worker's view of the scales lacks one
    run_gate = kvcap.llm.LLM._run_gate
    def dropping(self, found, kv_scales):
        return run_gate(self, found, {k: v for k, v in kv_scales.items() if k != FAULT[5:]})
    kvcap.llm.LLM._run_gate = dropping
elif FAULT == "step":  # the worker raises in its 3rd step
    run_plan, calls = model_runner.ModelRunner.run_plan, []
    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return run_plan(self, *args, **kwargs)
    model_runner.ModelRunner.run_plan = failing
"""


@pytest.fixture
def inject(tmp_path, monkeypatch):
    """inject(fault): the worker processes started from now on apply `fault` (see _INJECT)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_INJECT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))

    def set_fault(fault: str) -> None:
        monkeypatch.setenv("KVCAP_TEST_FAULT", fault)

    return set_fault


# --- numerics: TP2 against TP1 in FP32 on shapes that do not divide evenly -------------------
@pytest.mark.parametrize("overrides", [
    # vocabulary 301 and MLP 97 split 151/150 and 49/48, LM head tied to the embedding shard
    {"tie_word_embeddings": True},
    # one KV head for two ranks: replicated, each rank takes 2 of its 4 query heads
    {"num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 257},
    # Qwen2's q/k/v biases sliced with their heads, tied head, odd vocabulary
    {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True},
], ids=["tied-odd-vocab", "kv-replicated", "qwen2-bias"])
def test_tp2_fp32_equals_tp1_on_uneven_shapes(tmp_path, overrides):
    model = _model(tmp_path, **overrides)
    vocab = {**TINY, **overrides}["vocab_size"]
    seqs = [[t % vocab for t in s] for s in SEQS]
    out = {}
    for tp in (1, 2):
        with LLM(model=model, device="cpu", dtype="float32", num_blocks=16,
                 tensor_parallel_size=tp) as llm:
            pids = [p.pid for p in llm.tp.procs] if tp > 1 else []
            out[tp] = (llm.prompt_logits(seqs),
                       [o.token_ids for o in llm.generate(seqs, GREEDY, use_tqdm=False)])
        assert _worker_pids_alive(pids) == []
    for a, b in zip(out[1][0], out[2][0], strict=True):
        assert a.shape == b.shape and (a - b).abs().max().item() < 1e-4
    assert out[2][1] == out[1][1]


# --- faults on one worker only ------------------------------------------------------------------
def _scales() -> dict[str, float]:
    return {f"model.layers.{layer}.self_attn.{t}_scale": 0.02 for layer in range(2) for t in "kv"}


def test_gate_refused_by_one_worker_only_stops_every_rank(tmp_path, inject):
    inject("drop:model.layers.1.self_attn.v_scale")
    with pytest.raises(ScaleGateError, match=r"^Loaded 3/4 K/V scales\. Missing: model\.layers\.1"
                                             r"\.self_attn\.v_scale \(refused on tensor-parallel "
                                             r"rank 1 of 2\)$"):
        LLM(model=_model(tmp_path), device="cpu", num_blocks=16, kv_cache_dtype="fp8_e4m3",
            kv_scales=_scales(), tensor_parallel_size=2)


_RENDEZVOUS_DRIVER = """
import os, sys, time, torch
torch.set_num_threads(1)
from kvcap import LLM, SamplingParams
os.environ["KVCAP_TEST_FAULT"] = sys.argv[2]
start = time.monotonic()
try:
    LLM(model=sys.argv[1], device="cpu", num_blocks=16, tensor_parallel_size=2)
except Exception as e:
    print("FIRST", round(time.monotonic() - start, 1), type(e).__name__, e, flush=True)
os.environ["KVCAP_TEST_FAULT"] = ""  # a healthy retry in the same process
start = time.monotonic()
try:
    with LLM(model=sys.argv[1], device="cpu", num_blocks=16, tensor_parallel_size=2) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    print("SECOND ok", round(time.monotonic() - start, 1), flush=True)
except Exception as e:
    print("SECOND", round(time.monotonic() - start, 1), type(e).__name__, e, flush=True)
"""


def _run_rendezvous_driver(tmp_path, fault: str, timeout_s: str, wait: float) -> dict[str, str]:
    """_RENDEZVOUS_DRIVER in a subprocess with `fault` for its workers and
    KVCAP_TP_TIMEOUT_S=`timeout_s`: its FIRST and SECOND lines by their first word."""
    env = {**os.environ, "KVCAP_TP_TIMEOUT_S": timeout_s, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _RENDEZVOUS_DRIVER, _model(tmp_path), fault],
                          capture_output=True, text=True, timeout=wait, env=env)
    lines = {x.split()[0]: x for x in proc.stdout.splitlines() if x.startswith(("FIRST",
                                                                                 "SECOND"))}
    assert set(lines) == {"FIRST", "SECOND"}, proc.stderr[-3000:]
    return lines


@pytest.mark.parametrize(("fault", "reason"), [
    ("init", r"exit code 1\): RuntimeError: injected rendezvous failure"),
    ("ctrl", r"killed by SIGKILL\)"),
])
def test_worker_dying_in_the_rendezvous_fails_startup_at_once(tmp_path, inject, fault, reason):
    """A worker that posted 'ready' and then died joining the process group (raising before
    the data group, or killed in the control group's rendezvous) fails start-up with its own
    error within seconds: rank 0's rendezvous used to wait out its group's timeout, the data
    timeout (120 s here) or the control group's year. The process can then start another TP
    LLM (a failed init_process_group had left torch's group counter at 1: the next one stalled
    too). Run in a subprocess: the old failure poisoned torch.distributed's global state for
    every later TP test in the same process."""
    inject("")  # the driver script sets the fault for its own workers
    lines = _run_rendezvous_driver(tmp_path, fault, "120", wait=240)
    first, second = lines["FIRST"].split(maxsplit=3), lines["SECOND"].split(maxsplit=3)
    assert float(first[1]) < 30.0, lines  # not the data timeout
    assert first[2] == "TensorParallelError", lines
    assert re.fullmatch(r"tensor-parallel rank 1 \(pid \d+\) exited \(" + reason
                        + " while joining the process group", first[3]), lines
    assert second[1] == "ok", lines


def test_a_worker_wedged_before_the_control_group_fails_startup_in_bounded_time(tmp_path,
                                                                               inject):
    """A worker alive but stuck before the control group's rendezvous (no exit for the
    watchdog to see) held rank 0 in that rendezvous on the group's 365-day timeout. Rank 0's
    rendezvous reads now give up after KVCAP_TP_TIMEOUT_S (10 s here), the worker is killed,
    and the process can start another TP LLM."""
    inject("")  # the driver script sets the fault for its own workers
    lines = _run_rendezvous_driver(tmp_path, "wedge-ctrl", "10", wait=120)
    first = lines["FIRST"].split(maxsplit=3)
    assert float(first[1]) < 30.0, lines
    assert first[2:] == ["TensorParallelError", "a tensor-parallel rank did not join the "
                         "process group in 10 s (KVCAP_TP_TIMEOUT_S): a worker is wedged or "
                         "stopped"], lines
    assert lines["SECOND"].split()[1] == "ok", lines


def test_worker_raising_mid_run_stops_the_group_with_its_error(tmp_path, inject):
    inject("step")
    llm = LLM(model=_model(tmp_path), device="cpu", num_blocks=64, tensor_parallel_size=2)
    try:
        pids = [p.pid for p in llm.tp.procs]
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 \(pid \d+\) exited "
                                                      r"\(exit code 1\): RuntimeError: injected "
                                                      r"step failure"):
            llm.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=40, ignore_eos=True),
                         use_tqdm=False)
        assert time.monotonic() - start < 20.0
        with pytest.raises(TensorParallelError, match="injected step failure"):  # stays down
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert _worker_pids_alive(pids) == []
    finally:
        llm.shutdown()


@contextlib.contextmanager
def _killed_if_stuck(pids: list[int], after: float = 30.0):
    """A regression of the bounded waits below would wait forever: after `after` seconds the
    workers are killed, which turns it into another failure; and none outlives the block."""
    rescue = threading.Timer(after, lambda: [os.kill(p, signal.SIGKILL)
                                             for p in _worker_pids_alive(pids)])
    rescue.start()
    try:
        yield
    finally:
        rescue.cancel()
        for pid in _worker_pids_alive(pids):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("call", ["generate", "shutdown"])
def test_a_stopped_worker_fails_rank0s_message_in_bounded_time(tmp_path, call):
    """A worker that is alive but takes no message (stopped here; wedged alike) is no exit the
    watchdog could see, and a gloo send waits for its receiver: rank 0's step broadcast, and
    even shutdown()'s message, waited on the control group's 365-day timeout (Ctrl-C cannot
    interrupt it). Rank 0's messages now give up after the send timeout (KVCAP_TP_TIMEOUT_S;
    shortened here), the group is stopped and the worker killed."""
    from datetime import timedelta

    llm = LLM(model=_model(tmp_path), device="cpu", num_blocks=16, tensor_parallel_size=2)
    pids = [p.pid for p in llm.tp.procs]
    llm.tp.comm.send_timeout = timedelta(seconds=2)
    os.kill(pids[0], signal.SIGSTOP)
    try:
        with _killed_if_stuck(pids):
            start = time.monotonic()
            if call == "generate":
                with pytest.raises(TensorParallelError, match=r"did not take rank 0's message "
                                                              r"in 2 s \(KVCAP_TP_TIMEOUT_S\)"):
                    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
                with pytest.raises(TensorParallelError, match="wedged or stopped"):  # stays down
                    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
            llm.shutdown()
            assert time.monotonic() - start < 20.0
            assert _worker_pids_alive(pids) == []
    finally:
        llm.shutdown()


def test_a_worker_wedged_in_collect_kv_stats_fails_rank0_in_bounded_time(tmp_path, inject):
    """A worker alive but stuck computing its statistics after rank 0's ("stats",) message:
    rank 0's gather of the replies waited on the control group's 365-day timeout. It now
    gives up after the send timeout (KVCAP_TP_TIMEOUT_S; shortened here) and the group
    stops."""
    from datetime import timedelta

    from kvcap.scales.observer import KVStatsObserver

    inject("wedge-stats")
    llm = LLM(model=_model(tmp_path), device="cpu", num_blocks=16, tensor_parallel_size=2)
    pids = [p.pid for p in llm.tp.procs]
    try:
        with _killed_if_stuck(pids):
            llm.set_kv_observer(KVStatsObserver(TINY["num_hidden_layers"]))
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
            llm.tp.comm.send_timeout = timedelta(seconds=2)
            start = time.monotonic()
            with pytest.raises(TensorParallelError, match=r"^a tensor-parallel rank did not "
                                                          r"send rank 0 its reply in 2 s "
                                                          r"\(KVCAP_TP_TIMEOUT_S\): a worker "
                                                          r"is wedged or stopped$"):
                llm.collect_kv_stats()
            assert time.monotonic() - start < 20.0
            with pytest.raises(TensorParallelError, match="wedged or stopped"):  # stays down
                llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
            assert _worker_pids_alive(pids) == []
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("allreduce", ["nccl", "symm"])
def test_watched_store_carries_an_nccl_group(monkeypatch, allreduce):
    """Rank 0's rendezvous store (WatchedStore over a TCPStore) stays under its NCCL data group
    for the group's whole life: a one-rank group forms on it, all-reduces (NCCL, or the
    symmetric-memory path, whose set-up goes through the store too) and tears down."""
    from datetime import timedelta

    import torch.distributed as dist

    from kvcap.distributed.comm import Communicator, WatchedStore

    monkeypatch.setenv("KVCAP_ALLREDUCE", allreduce)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    comm = Communicator(0, 1, torch.device("cuda", 0))
    comm.init(WatchedStore(store, lambda: False))
    try:
        comm.setup_allreduce(torch.bfloat16)
        x = torch.arange(4096, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(comm.all_reduce(x.clone()), x)
        ids = torch.tensor([3, 1, 2], dtype=torch.int64, device="cuda")
        assert comm.broadcast_ids(ids, 3).tolist() == [3, 1, 2]
        assert comm.broadcast_object({"step": 1}) == {"step": 1}  # the gloo control group
    finally:
        comm.destroy()
    assert not dist.is_initialized()
