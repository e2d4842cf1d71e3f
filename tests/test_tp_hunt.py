"""Tensor-parallel regressions found by a correctness hunt (CPU, gloo, tiny random models).

- Token buckets: on CUDA with the Triton backend an eager step pads its rows to a bucket whose
  cap follows the rank's own parameter count; uneven shards put ranks on both sides of a cap,
  so a long prefill ran unpadded on rank 0 and padded on rank 1, and the row-parallel
  all-reduce mismatched (gloo aborted rank 0's whole process; NCCL would hang or mix rows).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from kvcap.config import ModelSpec
from kvcap.distributed.comm import Communicator
from kvcap.distributed.layers import ModelParallel
from kvcap.distributed.partition import plan_shard
from kvcap.engine import piecewise_graph
from kvcap.models.registry import build_model

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 301, "hidden_size": 64,
        "intermediate_size": 97, "num_hidden_layers": 2, "num_attention_heads": 6,
        "num_key_value_heads": 3, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "rope_theta": 10000.0}

# A reference size that puts the tiny model's two TP2 shards (53,824 and 45,632 parameters)
# on both sides of the 1024-row cap, as uneven shards of a large model can on a GPU.
_REFERENCE_PARAMS = 100_000

# Run in rank 0 and in every worker (a sitecustomize on the inherited PYTHONPATH): the CUDA +
# Triton bucket rule (ModelRunner.set_token_buckets) on the CPU.
_BUCKETS_EVERYWHERE = f"""
from kvcap.engine import model_runner, piecewise_graph

piecewise_graph.PIECEWISE_REFERENCE_PARAMS = {_REFERENCE_PARAMS}

def set_token_buckets(self, max_num_batched_tokens):
    params = sum(p.numel() for p in self.model.parameters())
    self.token_buckets = piecewise_graph.token_buckets(
        max_num_batched_tokens, piecewise_graph.piecewise_max_tokens(params))

model_runner.ModelRunner.set_token_buckets = set_token_buckets
"""

_BUCKETS_DRIVER = """
import json, sys, torch
torch.set_num_threads(1)
from kvcap import LLM, SamplingParams
prompt = [(7 * i + 3) % 301 for i in range(600)]  # past rank 0's cap, within rank 1's
out = {}
for tp in (1, 2):
    with LLM(model=sys.argv[1], device="cpu", dtype="float32", num_blocks=64, max_model_len=1024,
             max_num_batched_tokens=1024, tensor_parallel_size=tp) as llm:
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        out[tp] = llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids
        if tp > 1:
            out["buckets"] = llm.runner.token_buckets
print("RESULT", json.dumps(out))
"""


def test_every_rank_pads_a_step_to_the_same_token_bucket(tmp_path):
    spec = ModelSpec.from_hf_config(TINY)
    cpu = torch.device("cpu")
    caps = []
    for rank in range(2):  # the premise: the shards' own caps differ
        shard = build_model(spec, cpu, torch.float32,
                            ModelParallel(plan_shard(spec, 2, rank), Communicator(rank, 2, cpu)))
        params = sum(p.numel() for p in shard.parameters())
        caps.append(int(piecewise_graph.PIECEWISE_MAX_TOKENS * _REFERENCE_PARAMS / params))
    assert caps[0] < 1024 <= caps[1]

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BUCKETS_EVERYWHERE)
    env = {**os.environ, "KVCAP_TP_TIMEOUT_S": "60", "PYTHONPATH": os.pathsep.join(
        [str(site)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    run = subprocess.run([sys.executable, "-c", _BUCKETS_DRIVER, f"dummy:{tmp_path}"], env=env,
                         capture_output=True, text=True, timeout=180)
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    out = json.loads(lines[0].removeprefix("RESULT "))
    assert out["buckets"][-1] == 512  # rank 0's (largest shard, lowest cap)
    assert out["2"] == out["1"]
