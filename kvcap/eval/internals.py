"""Per-layer attention outputs through forward hooks on `layers[i].self_attn.attn_out`.

`AttnOutCapture` records, for one request at a time, every row each layer's attention emits
([T, Hq*D] before o_proj); chunked prefill appends chunks in order, so the first T rows are the
prompt's. `LayerErrors` accumulates the agreement of an arm's rows with the reference's rows of
the same token ids (errors include what earlier layers propagate: both arms run end to end).
"""

from __future__ import annotations

from typing import Any

import torch

from kvcap.eval.metrics import ErrorAccumulator


def attention_modules(model: Any) -> list[torch.nn.Module]:
    """The `attn_out` hook points of a kvcap model (INTERFACES.md)."""
    try:
        return [layer.self_attn.attn_out for layer in model.layers]
    except AttributeError as exc:
        raise RuntimeError("model has no layers[i].self_attn.attn_out hook points") from exc


class AttnOutCapture:
    """Context manager: collects attention outputs per layer while active."""

    def __init__(self, model: Any):
        self.modules = attention_modules(model)
        self.rows: list[list[torch.Tensor]] = [[] for _ in self.modules]
        self._handles: list[Any] = []

    def _hook(self, idx: int):
        def fn(_mod: torch.nn.Module, _inp: Any, out: torch.Tensor) -> None:
            self.rows[idx].append(out.detach().float().cpu())

        return fn

    def __enter__(self) -> AttnOutCapture:
        self.rows = [[] for _ in self.modules]
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.modules)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def layer_outputs(self, num_tokens: int) -> list[torch.Tensor]:
        """Per layer: the first `num_tokens` rows captured, [num_tokens, Hq*D] float32."""
        out = []
        for i, chunks in enumerate(self.rows):
            rows = torch.cat(chunks, dim=0) if chunks else torch.empty(0)
            if rows.shape[0] < num_tokens:
                raise RuntimeError(
                    f"layer {i}: captured {rows.shape[0]} rows, expected {num_tokens}"
                )
            out.append(rows[:num_tokens])
        return out


class LayerErrors:
    """Cosine / relative L2 / RMSE per layer against the reference, over all records."""

    def __init__(self, num_layers: int):
        self.acc = [ErrorAccumulator() for _ in range(num_layers)]

    def add(self, ref: list[torch.Tensor], arm: list[torch.Tensor]) -> None:
        if len(ref) != len(self.acc) or len(arm) != len(self.acc):
            raise ValueError("layer count mismatch")
        for a, r, x in zip(self.acc, ref, arm, strict=True):
            a.add(r, x)

    def summary(self) -> dict[str, Any]:
        per = [a.result() for a in self.acc]
        cos = [p.cosine for p in per]
        return {
            "per_layer": [
                {"layer": i, "cosine": p.cosine, "rel_l2": p.rel_l2, "rmse": p.rmse}
                for i, p in enumerate(per)
            ],
            "mean_cosine": sum(cos) / len(cos) if cos else float("nan"),
            "min_cosine": min(cos) if cos else float("nan"),
            "max_rel_l2": max((p.rel_l2 for p in per), default=float("nan")),
            "mean_rel_l2": sum(p.rel_l2 for p in per) / len(per) if per else float("nan"),
        }
