"""kvcap: an LLM inference engine with a calibrated FP8 E4M3 KV cache on every NVIDIA GPU."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import kvcap` (and `kvcap --help`) stays fast and torch-free.
    if name == "LLM":
        from kvcap.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvcap.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
