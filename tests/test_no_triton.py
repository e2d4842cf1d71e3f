"""The main job runs on CPU machines without triton (`pip install -e .` installs none): the
engine, model and sampler must not import it there."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules["triton"] = None  # any 'import triton' now raises ImportError
from kvcap.bench import step_overhead
from kvcap.sampling_params import SamplingParams
llm = step_overhead.build_llm(step_overhead.tiny_config_path(), "cpu", 2, 64, 16, "auto", False)
out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=4,
                                               ignore_eos=True), use_tqdm=False)
assert len(out[0].token_ids) == 4
print("ok")
"""


def test_cpu_generation_without_triton():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
