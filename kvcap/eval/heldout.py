"""Teacher-forced held-out scoring on evaluation-split records, plus per-layer internals.

For every record, each arm computes full-vocabulary logits at every position of the same token
ids (`LLM.prompt_logits`); against the reference arm we score KL(P_ref || P_arm), top-1
agreement and the teacher-forced NLL (perplexity), overall and per shard. With `internals`,
forward hooks capture each layer's attention output for the same record on every arm.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from tqdm.auto import tqdm

from kvcap.eval import metrics
from kvcap.eval.corpora import Shard
from kvcap.eval.internals import (
    AttnOutCapture,
    LayerErrors,
    LayerInputCapture,
    LayerInputInjection,
    hooked_forwards,
)

logger = logging.getLogger(__name__)

KL_BINS = torch.logspace(-10, 1, 45, dtype=torch.float64)  # histogram edges in nats


class _ArmTotals:
    def __init__(self) -> None:
        self.kl: list[float] = []
        self.top1 = 0
        self.positions = 0
        self.nll = 0.0
        self.nll_count = 0
        self.by_shard: dict[str, list[float]] = {}  # shard -> [kl_sum, top1, positions, nll, n]

    def add(
        self, shard: str, kl: torch.Tensor | None, top1: torch.Tensor | None, nll: torch.Tensor
    ) -> None:
        s = self.by_shard.setdefault(shard, [0.0, 0, 0, 0.0, 0])
        if kl is not None and top1 is not None:
            self.kl.extend(kl.tolist())
            self.top1 += int(top1.sum())
            self.positions += top1.numel()
            s[0] += float(kl.sum())
            s[1] += int(top1.sum())
            s[2] += top1.numel()
        self.nll += float(nll.sum())
        self.nll_count += nll.numel()
        s[3] += float(nll.sum())
        s[4] += nll.numel()


def _logits(llm: Any, ids: list[int], capture: bool, record_inputs: bool = False
            ) -> tuple[torch.Tensor, list | None, list | None]:
    """Logits [T, V]; with `capture`, per-layer attention outputs (and layer inputs)."""
    if not capture:
        return llm.prompt_logits([ids])[0], None, None
    inputs = None
    with hooked_forwards(llm), AttnOutCapture(llm.model) as cap:
        if record_inputs:
            with LayerInputCapture(llm.model) as rec:
                logits = llm.prompt_logits([ids])[0]
            # every row, the padding of a CUDA step's token bucket too: the arm's forward pads
            # its steps alike, and the injection replaces them row for row
            inputs = rec.inputs()
        else:
            logits = llm.prompt_logits([ids])[0]
    return logits, cap.layer_outputs(len(ids)), inputs


def _isolated(llm: Any, ids: list[int], ref_inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-layer attention outputs when every layer is fed the reference's layer inputs."""
    with (hooked_forwards(llm), AttnOutCapture(llm.model) as cap,
          LayerInputInjection(llm.model, ref_inputs)):
        llm.prompt_logits([ids])
    return cap.layer_outputs(len(ids))


def run_heldout(
    llms: dict[str, Any], reference: str, shards: list[Shard], internals: bool = True
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Returns (JSON-able summary, per-arm KL values per position for plotting)."""
    totals = {name: _ArmTotals() for name in llms}
    num_layers = llms[reference].spec.num_layers
    layer_err = {name: LayerErrors(num_layers) for name in llms if name != reference}
    isolated_err = {name: LayerErrors(num_layers) for name in llms if name != reference}
    work = [(s.name, r) for s in shards for r in s.records]
    for shard_name, ids in tqdm(work, desc="held-out (teacher-forced)"):
        ref_logits, ref_layers, ref_inputs = _logits(llms[reference], ids, internals, True)
        totals[reference].add(shard_name, None, None, metrics.next_token_nll(ref_logits, ids))
        for name, llm in llms.items():
            if name == reference:
                continue
            logits, layers, _ = _logits(llm, ids, internals)
            totals[name].add(
                shard_name,
                metrics.kl_per_position(ref_logits, logits),
                metrics.top1_agreement(ref_logits, logits),
                metrics.next_token_nll(logits, ids),
            )
            if internals and ref_layers is not None and layers is not None:
                layer_err[name].add(ref_layers, layers)
                if ref_inputs is not None:
                    isolated_err[name].add(ref_layers, _isolated(llm, ids, ref_inputs))
    ref_ppl = metrics.perplexity(totals[reference].nll, totals[reference].nll_count)
    summary: dict[str, Any] = {
        "records": len(work),
        "tokens": sum(len(r) for _, r in work),
        "shards": {s.name: {"records": len(s.records), "tokens": s.num_tokens} for s in shards},
        "kl_histogram_edges": KL_BINS.tolist(),
        "arms": {},
    }
    for name, t in totals.items():
        ppl = metrics.perplexity(t.nll, t.nll_count)
        # None where nothing was scored ("not run"); NaN only from non-finite logits (a broken
        # arm, which the goals count as missed)
        scored = t.nll_count > 0 and totals[reference].nll_count > 0
        arm: dict[str, Any] = {
            "perplexity": ppl,
            "nll_mean": t.nll / t.nll_count if t.nll_count else None,
            "ppl_delta_pct": (ppl / ref_ppl - 1) * 100 if scored else None,
        }
        if name != reference:
            kl = torch.tensor(t.kl, dtype=torch.float64)
            # histogram drops NaN silently: count a NaN position in the top (worst) bin
            binned = kl.nan_to_num(nan=KL_BINS[-1].item()).clamp(KL_BINS[0], KL_BINS[-1])
            arm.update(
                {
                    "positions": t.positions,
                    "top1_agreement": t.top1 / t.positions if t.positions else None,
                    "kl_mean": float(kl.mean()) if kl.numel() else None,
                    "kl_max": float(kl.max()) if kl.numel() else None,
                    "kl_quantiles": metrics.quantiles(t.kl, (0.5, 0.9, 0.99, 0.999)),
                    "kl_histogram": torch.histogram(binned, KL_BINS).hist.long().tolist(),
                }
            )
            if internals:
                arm["internals"] = layer_err[name].summary()
                arm["internals_isolated"] = isolated_err[name].summary()
        arm["per_shard"] = {
            sh: {
                "perplexity": metrics.perplexity(v[3], int(v[4])),
                **({"kl_mean": v[0] / v[2], "top1_agreement": v[1] / v[2]} if v[2] else {}),
            }
            for sh, v in t.by_shard.items()
        }
        summary["arms"][name] = arm
    return summary, {n: t.kl for n, t in totals.items() if n != reference}
