"""Tiny fake checkpoints and calibration reports for the scale/overlay tests (no real model)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvcap.scales.binding import BaseCheckpoint


def tiny_config(num_layers: int = 3) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": num_layers,
            "intermediate_size": 32, "vocab_size": 32, "max_position_embeddings": 128}


def tiny_tensors(num_layers: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(32, 16, generator=g),
           "model.norm.weight": torch.ones(16)}
    for layer in range(num_layers):
        p = f"model.layers.{layer}"
        out[f"{p}.self_attn.q_proj.weight"] = torch.randn(16, 16, generator=g)
        out[f"{p}.self_attn.k_proj.weight"] = torch.randn(8, 16, generator=g)
        out[f"{p}.self_attn.v_proj.weight"] = torch.randn(8, 16, generator=g)
    return out


def make_checkpoint(root: Path, num_layers: int = 3, sharded: bool = False,
                    extra: dict[str, torch.Tensor] | None = None, seed: int = 0) -> Path:
    """An HF-style dir: config.json, tokenizer stand-in, one or two safetensors (+ index)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(tiny_config(num_layers)))
    (root / "tokenizer.json").write_text("{}")
    (root / "generation_config.json").write_text("{}")
    tensors = tiny_tensors(num_layers, seed)
    tensors.update(extra or {})
    if not sharded:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
        return root
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(root / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return root


def make_report(base_dir: Path, scales: list[float] | None = None) -> dict[str, Any]:
    """A minimal calibration report (the fields `write_overlay` reads) for `base_dir`."""
    base = BaseCheckpoint.inspect(base_dir)
    names = base.spec.scale_names()
    if scales is None:
        scales = [0.015625 * (i + 1) for i in range(len(names))]  # exact FP32 values
    return {"kind": "kvcap.calibration-report", "model": base.describe(),
            "policy": {"name": "max"}, "tokens": 123, "shard_names": ["prose"],
            "tensors": [{"name": n, "scale": s, "max_abs": s * 448.0}
                        for n, s in zip(names, scales, strict=True)]}


def hash_tree(root: Path) -> dict[str, tuple[str, int]]:
    """SHA-256 and mtime of every file under root (to prove it was never modified)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = (hashlib.sha256(p.read_bytes()).hexdigest(),
                                             p.stat().st_mtime_ns)
    return out


def rewrite_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))
