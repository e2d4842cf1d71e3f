"""Copy checkpoint tensors into a LlamaModel (fusing QKV and gate/up), strictly.

Every parameter must be written exactly once with the right shape; unknown tensors are an
error, except K/V scale tensors, which are set aside for the startup gate (they are only
consumed after *all* weights are read, never per shard).

A tensor-parallel model (`model.shard` not full) takes its slice of each checkpoint tensor:
query/KV head rows of q/k/v_proj, MLP rows of gate/up_proj, the matching input columns of
o_proj/down_proj, vocabulary rows of embed_tokens/lm_head; the full checkpoint dimension is
checked before slicing, so a wrong-sized checkpoint is refused as strictly as without TP.

FP8 weights arrive as FP8Tensor pairs (kvcap.models.fp8_weights): a layer that keeps FP8
(FP8Linear) takes the bytes and its scales; a 16-bit parameter takes them dequantized.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch

from kvcap.config import ModelSpec
from kvcap.errors import ModelLoadError
from kvcap.models.fp8_linear import dummy_fp8, fp8_linears, init_dummy
from kvcap.models.fp8_weights import (
    DROPPED_SUFFIXES,
    FP8_DTYPES,
    WEIGHT_SCALE_SUFFIXES,
    FP8Tensor,
)
from kvcap.models.llama import LlamaModel

logger = logging.getLogger(__name__)

_SCALE_RE = re.compile(r"\.(k_scale|v_scale|output_scale|q_scale|prob_scale)$")
_QKV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.weight$")
_ROW = re.compile(r"^model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

# (dim, lo, hi, full size): the slice of a checkpoint tensor this rank loads
Source = tuple[int, int, int, int]


def is_scale_tensor_name(name: str) -> bool:
    try:
        from kvcap.scales.gate import is_kv_scale_name
    except ImportError:  # pragma: no cover - scales package always ships with kvcap
        return bool(_SCALE_RE.search(name))
    return is_kv_scale_name(name) or bool(_SCALE_RE.search(name))


def _target(model: LlamaModel, name: str
            ) -> tuple[torch.Tensor, slice | None, Source | None]:
    """The parameter a checkpoint tensor lands in, the row slice for fused ones, and the slice
    of the checkpoint tensor this (tensor-parallel) rank takes."""
    spec, shard, d = model.spec, model.shard, model.spec.head_dim
    layer = _LAYER.match(name)
    if layer and int(layer.group(1)) >= spec.num_layers:
        # (else model.layers[i] below is a bare IndexError: a shard that starts inside a layer
        # streams its q/k/v or gate/up tensors first)
        raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint: config.json says "
                             f"num_hidden_layers {spec.num_layers}")
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
        heads, total = ((shard.q_heads, spec.num_heads) if m.group(2) == "q"
                        else (shard.kv_heads, spec.num_kv_heads))
        return param, slice(start, start + size), (0, heads[0] * d, heads[1] * d, total * d)
    m = _GATE_UP.match(name)
    if m:
        mlp = model.layers[int(m.group(1))].mlp
        start = 0 if m.group(2) == "gate" else mlp.inter
        return (mlp.gate_up_proj.weight, slice(start, start + mlp.inter),
                (0, *shard.inter, spec.intermediate_size))
    params = dict(model.named_parameters(remove_duplicate=False))
    # HF nests the decoder under "model."; kvcap's module keeps it at the top level.
    local = name[len("model."):] if name.startswith("model.") else name
    if local not in params:
        raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint for a "
                             f"{spec.architecture} model (wrong architecture or config?)")
    src: Source | None = None
    if _ROW.match(name):
        cols = (shard.q_heads[0] * d, shard.q_heads[1] * d, spec.num_heads * d) \
            if "o_proj" in name else (*shard.inter, spec.intermediate_size)
        src = (1, *cols)
    elif name in _VOCAB:
        src = (0, *shard.vocab, spec.vocab_size)
    return params[local], None, src


def _take(name: str, tensor: torch.Tensor | FP8Tensor, src: Source | None, full: bool
          ) -> torch.Tensor | FP8Tensor:
    """This rank's slice of a checkpoint tensor (the tensor itself without TP)."""
    if src is None or full:
        return tensor
    dim, lo, hi, total = src
    if tensor.dim() <= dim or tensor.shape[dim] != total:
        raise ModelLoadError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                             f"expected {total} along dim {dim}")
    return tensor.narrow(dim, lo, hi - lo)


def load_weights(model: LlamaModel,
                 tensors: Iterable[tuple[str, torch.Tensor | FP8Tensor]]
                 ) -> dict[str, torch.Tensor]:
    """Fill `model` from (name, tensor) pairs. Returns the K/V-scale-like tensors found."""
    scales: dict[str, torch.Tensor] = {}
    written: dict[str, int] = {}  # param name -> rows written (fused params collect slices)
    ids = {id(p): n for n, p in model.named_parameters()}
    fp8_layers = fp8_linears(model)  # id(weight) -> FP8Linear
    # an FP8 layer's scales are written with its weight rows (FP8Linear.load_rows)
    scale_params = {ids[id(m.weight_scale)] for m in fp8_layers.values()}
    tied = model.spec.tie_word_embeddings
    head = None  # a tied model's lm_head.weight from the checkpoint: placed after the loop

    def load(name: str, tensor: torch.Tensor | FP8Tensor) -> None:
        if name.endswith(WEIGHT_SCALE_SUFFIXES + DROPPED_SUFFIXES) or (
                isinstance(tensor, torch.Tensor) and tensor.dtype in FP8_DTYPES):
            # (only a checkpoint without a quantization_config streams these in raw: the E4M3
            # bytes cast without their scales would be silently wrong weights)
            raise ModelLoadError(f"{name} is an FP8 weight or scale, but config.json declares "
                                 "no quantization_config: restore the checkpoint's own "
                                 "config.json (kvcap reads compressed-tensors, fp8 and "
                                 "fbgemm_fp8 FP8 weights)")
        param, rows, src = _target(model, name)
        if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point():
            # (cast to float it would load as garbage: quantized weights the config does not
            # declare, or a wrong file)
            raise ModelLoadError(f"{name} is {str(tensor.dtype).removeprefix('torch.')} in the "
                                 "checkpoint, not a floating-point weight: quantized weights "
                                 "without a quantization_config kvcap reads? use the "
                                 "unquantized checkpoint")
        tensor = _take(name, tensor, src, model.shard.is_full)
        layer = fp8_layers.get(id(param))
        if layer is not None:
            if not isinstance(tensor, FP8Tensor):
                raise ModelLoadError(f"{name} is {tensor.dtype}, not FP8, in the checkpoint, "
                                     "but its layer keeps FP8 weights; load with "
                                     "fp8_weights='dequantize'")
            layer.load_rows(name, rows, tensor)
        else:
            if isinstance(tensor, FP8Tensor):  # an FP8 tensor into a 16-bit parameter
                tensor = tensor.dequantize()
            dest = param if rows is None else param[rows]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(f"shape mismatch for {name}: checkpoint "
                                     f"{tuple(tensor.shape)} vs model {tuple(dest.shape)}")
            dest.copy_(tensor.to(param.dtype))
        key = ids[id(param)]
        written[key] = written.get(key, 0) + tensor.shape[0]

    seen: set[str] = set()  # checkpoint names: each must come once (rows are counted per
    # fused parameter, so a second gate_proj could stand in for a missing up_proj)
    with torch.no_grad():
        for name, tensor in tensors:
            if name in seen:
                raise ModelLoadError(f"tensor {name!r} appears twice in the checkpoint (a stale "
                                     "copy of the weights beside them? without a "
                                     "model.safetensors.index.json or a model.safetensors "
                                     "every *.safetensors file in the directory is read)")
            seen.add(name)
            if is_scale_tensor_name(name):
                scales[name] = tensor
                continue
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if tied and name == "lm_head.weight":
                head = tensor
                continue
            load(name, tensor)
        if head is not None:
            _place_tied_head(model, head, load, ids, written)
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items()
               if n not in scale_params and written.get(n, 0) != p.shape[0]]
    if missing:
        # as the checkpoint names them (kvcap fuses q/k/v and gate/up)
        names = [hf for n in missing for hf, _ in _hf_named(model, n, params[n])
                 if hf not in seen] or missing
        raise ModelLoadError(f"checkpoint is missing {len(names)} tensors, e.g. {names[:3]}")
    return scales


def _place_tied_head(model: LlamaModel, head: torch.Tensor | FP8Tensor, load,
                     ids: dict[int, str], written: dict[str, int]) -> None:
    """A tied config whose checkpoint also holds lm_head.weight, as transformers'
    PreTrainedModel.tie_weights reads it: the checkpoint's word beats the config's. Only the
    head present: the (shared) embedding takes it. Both present and equal (a .bin
    conversion): stay tied. Both present and different (a fine-tune that untied its head and
    kept the config): a head of its own, as transformers keeps it -- dropping it would decode
    through the embedding, silently wrong."""
    embed = model.embed_tokens.weight
    if "embed_tokens.weight" not in written:
        load("lm_head.weight", head)  # into the shared parameter
        return
    model.lm_head.weight = torch.nn.Parameter(torch.empty_like(embed))
    ids[id(model.lm_head.weight)] = "lm_head.weight"
    load("lm_head.weight", head)
    if torch.equal(model.lm_head.weight, embed):
        model.lm_head.weight = embed  # the copy goes
        return
    logger.warning("config.json sets tie_word_embeddings, but the checkpoint's lm_head.weight "
                   "differs from its embed_tokens.weight: using it as an untied LM head (as "
                   "transformers does); set tie_word_embeddings false to say so")


def init_dummy_weights(model: LlamaModel, seed: int = 0) -> None:
    """Random weights of the right shapes (performance work without a download)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    fp8_layers = fp8_linears(model).values()
    fp8_params = {id(p) for m in fp8_layers for p in m.parameters()}
    with torch.no_grad():
        for m in fp8_layers:
            init_dummy(m, gen)
        for name, p in model.named_parameters():
            if id(p) in fp8_params:
                continue
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def dummy_checkpoint(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int = 0,
                     keep_fp8: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor | FP8Tensor]]:
    """The weights `init_dummy_weights` gives the full model, as HF-named checkpoint tensors,
    one at a time: a tensor-parallel rank loads its slices of exactly the TP1 dummy model.
    `keep_fp8`: the model of an FP8 spec keeps FP8 weights, which come as FP8Tensor pairs
    (generated first, as init_dummy_weights does)."""
    with torch.device("meta"):
        full = LlamaModel(spec, None, spec.fp8_weights if keep_fp8 else None)
    gen = torch.Generator(device=device).manual_seed(seed)
    names = {id(p): n for n, p in full.named_parameters()}
    layers = fp8_linears(full)
    for layer in layers.values():
        w, scale = dummy_fp8(tuple(layer.weight.shape), layer.row_block, layer.k_group,
                             device, gen)
        fp8 = FP8Tensor(w.view(torch.float8_e4m3fn), scale, "dummy",
                        (layer.row_block, layer.k_group))
        yield from _hf_named(full, names[id(layer.weight)], fp8)
        if layer.bias is not None:  # init_dummy's zeros
            yield from _hf_named(full, names[id(layer.bias)],
                                 torch.zeros(layer.bias.shape, dtype=dtype, device=device))
    fp8_params = {id(p) for m in layers.values() for p in m.parameters()}
    for name, p in full.named_parameters():
        if id(p) in fp8_params:
            continue
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if "norm" in name:
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        yield from _hf_named(full, name, t)


def _hf_named(full: LlamaModel, name: str, t: torch.Tensor | FP8Tensor
              ) -> Iterator[tuple[str, torch.Tensor | FP8Tensor]]:
    """kvcap parameter `name` as the checkpoint tensors it is loaded from (q/k/v and gate/up
    fused in kvcap)."""
    hf = name if name == "lm_head.weight" else f"model.{name}"
    if ".qkv_proj." in hf:
        attn = full.layers[int(name.split(".")[1])].self_attn
        parts = t.split([attn.q_size, attn.kv_size, attn.kv_size])
        for proj, part in zip("qkv", parts, strict=True):
            yield hf.replace("qkv_proj", f"{proj}_proj"), part
    elif ".gate_up_proj." in hf:
        gate, up = t.split([t.shape[0] // 2] * 2)
        yield hf.replace("gate_up_proj", "gate_proj"), gate
        yield hf.replace("gate_up_proj", "up_proj"), up
    else:
        yield hf, t
