"""Copy checkpoint tensors into a LlamaModel (fusing QKV and gate/up), strictly.

Every parameter must be written exactly once with the right shape; unknown tensors are an
error, except K/V scale tensors, which are set aside for the startup gate (they are only
consumed after *all* weights are read, never per shard).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from kvcap.errors import ModelLoadError
from kvcap.models.llama import LlamaModel

_SCALE_RE = re.compile(r"\.(k_scale|v_scale|output_scale|q_scale|prob_scale)$")
_QKV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.weight$")


def is_scale_tensor_name(name: str) -> bool:
    try:
        from kvcap.scales.gate import is_kv_scale_name
    except ImportError:  # pragma: no cover - scales package always ships with kvcap
        return bool(_SCALE_RE.search(name))
    return is_kv_scale_name(name) or bool(_SCALE_RE.search(name))


def _target(model: LlamaModel, name: str) -> tuple[torch.Tensor, slice | None]:
    """The parameter a checkpoint tensor lands in, and the row slice for fused ones."""
    spec = model.spec
    m = _QKV.match(name)
    if m:
        attn = model.layers[int(m.group(1))].self_attn
        q, kv = attn.q_size, attn.kv_size
        start = {"q": 0, "k": q, "v": q + kv}[m.group(2)]
        size = q if m.group(2) == "q" else kv
        param = attn.qkv_proj.weight if m.group(3) == "weight" else attn.qkv_proj.bias
        if param is None:
            raise ModelLoadError(f"{name}: checkpoint has a bias the {spec.architecture} "
                                 "architecture does not use")
        return param, slice(start, start + size)
    m = _GATE_UP.match(name)
    if m:
        mlp = model.layers[int(m.group(1))].mlp
        start = 0 if m.group(2) == "gate" else mlp.inter
        return mlp.gate_up_proj.weight, slice(start, start + mlp.inter)
    params = dict(model.named_parameters(remove_duplicate=False))
    # HF nests the decoder under "model."; kvcap's module keeps it at the top level.
    local = name[len("model."):] if name.startswith("model.") else name
    if local not in params:
        raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint for a "
                             f"{spec.architecture} model (wrong architecture or config?)")
    return params[local], None


def load_weights(model: LlamaModel, tensors: Iterable[tuple[str, torch.Tensor]]
                 ) -> dict[str, torch.Tensor]:
    """Fill `model` from (name, tensor) pairs. Returns the K/V-scale-like tensors found."""
    scales: dict[str, torch.Tensor] = {}
    written: dict[str, int] = {}  # param name -> rows written (fused params collect slices)
    ids = {id(p): n for n, p in model.named_parameters()}
    tied = model.spec.tie_word_embeddings
    with torch.no_grad():
        for name, tensor in tensors:
            if is_scale_tensor_name(name):
                scales[name] = tensor
                continue
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if tied and name == "lm_head.weight":
                continue
            param, rows = _target(model, name)
            dest = param if rows is None else param[rows]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(f"shape mismatch for {name}: checkpoint "
                                     f"{tuple(tensor.shape)} vs model {tuple(dest.shape)}")
            dest.copy_(tensor.to(param.dtype))
            key = ids[id(param)]
            written[key] = written.get(key, 0) + tensor.shape[0]
    missing = [n for n, p in model.named_parameters() if written.get(n, 0) != p.shape[0]]
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    return scales


def init_dummy_weights(model: LlamaModel, seed: int = 0) -> None:
    """Random weights of the right shapes (performance work without a download)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
