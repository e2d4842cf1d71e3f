"""Phi-3 / Phi-4 checkpoints (Phi3ForCausalLM): Llama's decoder layer with the attention's
q/k/v projections stored as one `self_attn.qkv_proj.weight` ([q; k; v] rows) and the MLP's
gate/up as one `mlp.gate_up_proj.weight` ([gate; up] rows). kvcap's layers fuse the same way,
but the weight loader (and its tensor-parallel slicing) speaks the Llama names, so the fused
tensors are split into them as the checkpoint streams in."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from kvcap.config import ModelSpec
from kvcap.errors import ModelLoadError

_FUSED = re.compile(r"^(model\.layers\.\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight$")


def split_fused(tensors: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's stream with each fused qkv_proj / gate_up_proj weight replaced by its
    q/k/v or gate/up rows under the Llama names."""
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    for name, tensor in tensors:
        m = _FUSED.match(name)
        if m is None:
            yield name, tensor
            continue
        layer, which = m.groups()
        if which == "self_attn.qkv_proj":
            parts = {"q": q, "k": kv, "v": kv}
            names = [f"{layer}.self_attn.{p}_proj.weight" for p in parts]
        else:
            parts = {"gate": spec.intermediate_size, "up": spec.intermediate_size}
            names = [f"{layer}.mlp.{p}_proj.weight" for p in parts]
        sizes = list(parts.values())
        if tensor.dim() != 2 or tensor.shape[0] != sum(sizes):
            raise ModelLoadError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                                 f"expected {sum(sizes)} rows ({' + '.join(map(str, sizes))})")
        yield from zip(names, tensor.split(sizes), strict=True)
