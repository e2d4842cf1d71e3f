"""Scoring math for the A/B harness (pure functions; tested against hand-computed values).

All distribution metrics work on raw logits over the full vocabulary and are computed in FP64
so that tiny KL values (1e-6 nats) are not lost to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def kl_per_position(ref_logits: torch.Tensor, arm_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || P_arm) in nats at each position. logits: [T, V] -> [T] float64 (>= 0)."""
    if ref_logits.shape != arm_logits.shape:
        raise ValueError(
            f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(arm_logits.shape)}"
        )
    lp = torch.log_softmax(ref_logits.double(), dim=-1)
    lq = torch.log_softmax(arm_logits.double(), dim=-1)
    # 0 * log(0 / q) = 0: a token the reference masks (-inf) adds nothing, even where the arm
    # masks it too (-inf - -inf would be NaN). NaN logits still give NaN: a broken arm shows.
    terms = torch.where(lp == -math.inf, 0.0, lp.exp() * (lp - lq))
    return terms.sum(-1).clamp_min(0.0)


def top1_agreement(ref_logits: torch.Tensor, arm_logits: torch.Tensor) -> torch.Tensor:
    """Per position: 1.0 where both argmaxes agree. [T, V] -> [T] bool. A row with a NaN
    never agrees (argmax treats NaN as the maximum, so two NaN rows would "agree")."""
    nan_row = ref_logits.isnan().any(-1) | arm_logits.isnan().any(-1)
    return (ref_logits.argmax(-1) == arm_logits.argmax(-1)) & ~nan_row


def next_token_nll(logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """Teacher-forced negative log-likelihood of token t+1 given logits at t.
    logits [T, V], token_ids length T -> [T-1] float64."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    if logits.shape[0] != ids.numel():
        raise ValueError(f"{logits.shape[0]} logit rows for {ids.numel()} tokens")
    lp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return -lp.gather(-1, ids[1:, None]).squeeze(-1)


def perplexity(nll_sum: float, count: int) -> float:
    """exp(mean NLL); nan for no tokens, inf past float range (a mean NLL over ~709.8 nats,
    a broken arm's: math.exp raised OverflowError there, after every arm had been scored)."""
    if not count:
        return float("nan")
    try:
        return math.exp(nll_sum / count)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class TensorError:
    """Agreement of an arm's tensor with the reference tensor of the same inputs."""

    cosine: float
    rel_l2: float
    rmse: float


def tensor_error(ref: torch.Tensor, arm: torch.Tensor) -> TensorError:
    """Cosine similarity of the flattened tensors, ||arm - ref|| / ||ref||, and RMSE."""
    if ref.shape != arm.shape:
        raise ValueError(f"shapes differ: {tuple(ref.shape)} vs {tuple(arm.shape)}")
    r, a = ref.double().flatten(), arm.double().flatten()
    nr, na = r.norm().item(), a.norm().item()
    diff = (a - r).norm().item()
    # a zero norm: 1 when both are zero, else 0; a NaN norm keeps NaN (not a made-up 0)
    cos = float((r @ a).item() / (nr * na)) if nr * na != 0 else float(nr == na)
    rel = diff / nr if nr > 0 else (0.0 if diff == 0 else math.inf)
    return TensorError(cos, rel, diff / math.sqrt(max(r.numel(), 1)))


class ErrorAccumulator:
    """Accumulates sums so that cosine / rel-L2 / RMSE over many records equal those of the
    concatenated tensors (not a mean of per-record ratios)."""

    def __init__(self) -> None:
        self.dot = self.ref_sq = self.arm_sq = self.diff_sq = 0.0
        self.count = 0

    def add(self, ref: torch.Tensor, arm: torch.Tensor) -> None:
        if ref.shape != arm.shape:
            raise ValueError(f"shapes differ: {tuple(ref.shape)} vs {tuple(arm.shape)}")
        r, a = ref.double().flatten(), arm.double().flatten()
        self.dot += float(r @ a)
        self.ref_sq += float(r @ r)
        self.arm_sq += float(a @ a)
        self.diff_sq += float(((a - r) ** 2).sum())
        self.count += r.numel()

    def result(self) -> TensorError:
        if not self.count:  # nothing added: no agreement measured (not a perfect one)
            return TensorError(math.nan, math.nan, math.nan)
        nr, na = math.sqrt(self.ref_sq), math.sqrt(self.arm_sq)
        cos = self.dot / (nr * na) if nr * na != 0 else float(nr == na)  # see tensor_error
        rel = math.sqrt(self.diff_sq) / nr if nr > 0 else (0.0 if self.diff_sq == 0 else math.inf)
        return TensorError(cos, rel, math.sqrt(self.diff_sq / max(self.count, 1)))


def first_divergence(ref: Sequence[int], arm: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter end);
    None when the sequences are identical."""
    for i, (x, y) in enumerate(zip(ref, arm, strict=False)):
        if x != y:
            return i
    return None if len(ref) == len(arm) else min(len(ref), len(arm))


def ngram_jaccard(ref: Sequence[int], arm: Sequence[int], n: int = 1) -> float:
    """|A & B| / |A | B| over the sets of token n-grams (1.0 when both are empty)."""
    a = {tuple(ref[i : i + n]) for i in range(len(ref) - n + 1)}
    b = {tuple(arm[i : i + n]) for i in range(len(arm) - n + 1)}
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def paired_outcomes(ref_ok: Sequence[bool], arm_ok: Sequence[bool]) -> dict[str, list[int]]:
    """Indices where the reference is right and the arm wrong (regressions), and the reverse."""
    if len(ref_ok) != len(arm_ok):
        raise ValueError("paired outcome lists differ in length")
    pairs = list(zip(ref_ok, arm_ok, strict=True))
    return {
        "regressions": [i for i, (r, a) in enumerate(pairs) if r and not a],
        "improvements": [i for i, (r, a) in enumerate(pairs) if a and not r],
    }


def quantiles(
    values: Sequence[float], qs: Sequence[float] = (0.5, 0.9, 0.99, 1.0)
) -> dict[str, float]:
    """Named quantiles (linear interpolation) of a list; empty dict for no values."""
    if not values:
        return {}
    t = torch.tensor(list(values), dtype=torch.float64)
    return {f"p{q * 100:g}": float(torch.quantile(t, q)) for q in qs}
