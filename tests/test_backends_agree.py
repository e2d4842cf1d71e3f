"""In FP32 the Triton attention backend and the torch reference give the same greedy tokens on
the embedded model (on CPU through the Triton interpreter: minutes, hence `slow`)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def quicksort(arr):",
           "The history of computing spans centuries. " * 20]


def test_triton_backend_matches_torch_reference_fp32():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("run with TRITON_INTERPRET=1 (set before triton is imported)")
    from kvcap import LLM, SamplingParams

    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(model="default", dtype="float32", attention_backend=backend, device="cpu",
                  num_blocks=128, max_num_seqs=4)
        ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
        tokens[backend] = [o.token_ids for o in outs]
    assert tokens["triton"] == tokens["torch"]
