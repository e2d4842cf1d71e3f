"""Per-layer attention outputs through forward hooks on `layers[i].self_attn.attn_out`.

`AttnOutCapture` records, for one request at a time, every row each layer's attention emits
([T, Hq*D] before o_proj); chunked prefill appends chunks in order, so the first T rows are the
prompt's. `LayerErrors` accumulates the agreement of an arm's rows with the reference's rows.

Two views: *end to end* (both arms run the same token ids; layer i's error includes what the
quantized layers before it propagated) and *isolated* (`LayerInputCapture` records every decoder
layer's inputs in the reference run and `LayerInputInjection` feeds exactly those to the arm's
layers, so layer i differs from the reference only by its own K/V quantization). A decoder
layer's input is the pair (x, residual): the stream x + residual is summed inside the layer's
first norm (kvcap's fused add), so both are recorded and injected; replacing x alone would mix
the reference's last MLP output into the arm's own residual stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvcap.eval.metrics import ErrorAccumulator


def attention_modules(model: Any) -> list[torch.nn.Module]:
    """The `attn_out` hook points of a kvcap model (INTERFACES.md)."""
    try:
        return [layer.self_attn.attn_out for layer in model.layers]
    except AttributeError as exc:
        raise RuntimeError("model has no layers[i].self_attn.attn_out hook points") from exc


@contextmanager
def hooked_forwards(llm: Any) -> Iterator[None]:
    """While active, `llm`'s forwards call every decoder layer and `attn_out` as modules, so
    the hooks here fire. A CUDA runner's piecewise graphs replay the layers' pieces instead
    (no hook fires: nothing captured, nothing injected): they are set aside. Its eager steps
    still pad to the same token buckets, so they compute the graphs' sums (the same logits)."""
    runner = getattr(llm, "runner", None)
    pieces = getattr(runner, "piecewise", None)
    if pieces is not None:
        runner.piecewise = None
    try:
        yield
    finally:
        if pieces is not None:
            runner.piecewise = pieces


class AttnOutCapture:
    """Context manager: collects attention outputs per layer while active (every layer, or
    only those in `layers`)."""

    def __init__(self, model: Any, layers: Any = None):
        self.modules = attention_modules(model)
        self.hooked = list(range(len(self.modules)) if layers is None else layers)
        self.rows: list[list[torch.Tensor]] = [[] for _ in self.modules]
        self._handles: list[Any] = []

    def _hook(self, idx: int):
        def fn(_mod: torch.nn.Module, _inp: Any, out: torch.Tensor) -> None:
            self.rows[idx].append(out.detach().float().cpu())

        return fn

    def __enter__(self) -> AttnOutCapture:
        self.rows = [[] for _ in self.modules]
        self._handles = [self.modules[i].register_forward_hook(self._hook(i))
                         for i in self.hooked]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def layer_output(self, idx: int, num_tokens: int) -> torch.Tensor:
        """Layer `idx`: the first `num_tokens` rows captured, [num_tokens, Hq*D] float32."""
        chunks = self.rows[idx]
        rows = torch.cat(chunks, dim=0) if chunks else torch.empty(0)
        if rows.shape[0] < num_tokens:
            raise RuntimeError(f"layer {idx}: captured {rows.shape[0]} rows, expected {num_tokens}")
        return rows[:num_tokens]

    def layer_outputs(self, num_tokens: int) -> list[torch.Tensor]:
        """Every layer's `layer_output` (all layers must be hooked)."""
        return [self.layer_output(i, num_tokens) for i in range(len(self.rows))]


class LayerInputCapture:
    """Context manager: records each decoder layer's inputs (x, residual), each [T, hidden]
    (residual None at the first layer, which receives the embeddings alone)."""

    def __init__(self, model: Any):
        self.layers = list(model.layers)
        self.rows: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self._handles: list[Any] = []

    def _hook(self, idx: int):
        def fn(_mod: torch.nn.Module, args: tuple) -> None:
            x, residual = args[0], args[1]  # a decoder layer's (x, residual, cos, sin, ctx)
            self.rows[idx].append((x.detach().clone(),
                                   None if residual is None else residual.detach().clone()))
        return fn

    def __enter__(self) -> LayerInputCapture:
        self.rows = [[] for _ in self.layers]
        self._handles = [m.register_forward_pre_hook(self._hook(i))
                         for i, m in enumerate(self.layers)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def inputs(self, num_tokens: int | None = None) -> list[tuple]:
        """Per layer (x, residual) over all chunks, the first `num_tokens` rows of each."""
        out = []
        for chunks in self.rows:
            x = torch.cat([c[0] for c in chunks], dim=0)[:num_tokens]
            has_residual = [c[1] is not None for c in chunks]
            if any(has_residual) and not all(has_residual):
                raise RuntimeError("a layer received a residual in some chunks only")
            res = (torch.cat([c[1] for c in chunks], dim=0)[:num_tokens]
                   if all(has_residual) and chunks else None)
            out.append((x, res))
        return out


class LayerInputInjection:
    """Context manager: replaces each decoder layer's inputs (x, residual) with the recorded
    reference rows, chunk by chunk in order (chunked prefill gives the same row order in every
    arm). `layers`: inject only at these layer indices (default: every layer)."""

    def __init__(self, model: Any, inputs: list[tuple], layers: Any = None):
        self.layers = list(model.layers)
        if len(inputs) != len(self.layers):
            raise ValueError(f"{len(inputs)} recorded inputs for {len(self.layers)} layers")
        self.inputs = inputs
        self.injected = list(range(len(self.layers)) if layers is None else layers)
        self.offset = [0] * len(self.layers)
        self._handles: list[Any] = []

    def _hook(self, idx: int):
        def fn(_mod: torch.nn.Module, args: tuple) -> tuple:
            x, residual = args[0], args[1]
            ref_x, ref_res = self.inputs[idx]
            start = self.offset[idx]
            rx = ref_x[start:start + x.shape[0]]
            if rx.shape != x.shape or (ref_res is None) != (residual is None):
                raise RuntimeError(f"layer {idx}: recorded input rows {tuple(rx.shape)} do not "
                                   f"match this forward's {tuple(x.shape)}")
            self.offset[idx] = start + x.shape[0]
            if ref_res is not None:
                residual = ref_res[start:start + x.shape[0]].to(device=x.device, dtype=x.dtype)
            return (rx.to(device=x.device, dtype=x.dtype), residual, *args[2:])
        return fn

    def __enter__(self) -> LayerInputInjection:
        self.offset = [0] * len(self.layers)
        self._handles = [self.layers[i].register_forward_pre_hook(self._hook(i))
                         for i in self.injected]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


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
        if not any(a.count for a in self.acc):  # no records: not measured (None = "not run")
            return {"per_layer": [], **dict.fromkeys(
                ("mean_cosine", "min_cosine", "max_rel_l2", "mean_rel_l2"))}
        per = [a.result() for a in self.acc]
        # torch's min/max propagate NaN (a layer gone NaN); Python's depend on the order
        cos = torch.tensor([p.cosine for p in per], dtype=torch.float64)
        rel = torch.tensor([p.rel_l2 for p in per], dtype=torch.float64)
        return {
            "per_layer": [
                {"layer": i, "cosine": p.cosine, "rel_l2": p.rel_l2, "rmse": p.rmse}
                for i, p in enumerate(per)
            ],
            "mean_cosine": float(cos.mean()),
            "min_cosine": float(cos.min()),
            "max_rel_l2": float(rel.max()),
            "mean_rel_l2": float(rel.mean()),
        }
