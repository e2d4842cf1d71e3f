"""Scoring math against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from kvcap.eval import metrics


def _logits(*probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_kl_hand_computed():
    ref = _logits([0.5, 0.5], [0.9, 0.1])
    arm = _logits([0.25, 0.75], [0.9, 0.1])
    kl = metrics.kl_per_position(ref.float(), arm.float())
    expect0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # 0.1438410
    assert kl[0].item() == pytest.approx(expect0, rel=1e-6)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-7)
    # KL is invariant to a constant shift of the logits (softmax), not symmetric.
    assert metrics.kl_per_position(ref + 3.0, arm)[0].item() == pytest.approx(expect0, rel=1e-9)
    back = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert metrics.kl_per_position(arm, ref)[0].item() == pytest.approx(back, rel=1e-9)


def test_kl_shape_mismatch():
    with pytest.raises(ValueError):
        metrics.kl_per_position(torch.zeros(2, 3), torch.zeros(2, 4))


def test_top1():
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.2, 0.1]])
    arm = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.3, 0.0]])
    assert metrics.top1_agreement(ref, arm).tolist() == [True, False, True]


def test_nll_and_perplexity():
    logits = torch.zeros(3, 4)  # uniform over 4 tokens
    nll = metrics.next_token_nll(logits, [0, 1, 2])
    assert nll.tolist() == pytest.approx([math.log(4)] * 2)
    assert metrics.perplexity(float(nll.sum()), nll.numel()) == pytest.approx(4.0)
    peaked = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])  # p(1) = 0.75 at t=0
    assert metrics.next_token_nll(peaked, [0, 1]).item() == pytest.approx(-math.log(0.75))
    assert math.isnan(metrics.perplexity(0.0, 0))
    with pytest.raises(ValueError):
        metrics.next_token_nll(logits, [0, 1])


def test_tensor_error():
    e = metrics.tensor_error(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))
    assert (e.cosine, e.rel_l2, e.rmse) == pytest.approx((0.0, math.sqrt(2), 1.0))
    e = metrics.tensor_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0]))
    assert (e.cosine, e.rel_l2, e.rmse) == pytest.approx((1.0, 0.0, 0.0))
    e = metrics.tensor_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 5.0]))
    assert e.rel_l2 == pytest.approx(1 / 5)
    assert e.rmse == pytest.approx(math.sqrt(0.5))
    assert e.cosine == pytest.approx(29 / (5 * math.sqrt(34)))


def test_error_accumulator_equals_concatenation():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(10, 6, generator=g)
    arm = ref + 0.1 * torch.randn(10, 6, generator=g)
    acc = metrics.ErrorAccumulator()
    acc.add(ref[:4], arm[:4])
    acc.add(ref[4:], arm[4:])
    whole = metrics.tensor_error(ref, arm)
    got = acc.result()
    assert got.cosine == pytest.approx(whole.cosine, rel=1e-12)
    assert got.rel_l2 == pytest.approx(whole.rel_l2, rel=1e-12)
    assert got.rmse == pytest.approx(whole.rmse, rel=1e-12)


def test_first_divergence():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 2], [1, 2, 3]) == 2
    assert metrics.first_divergence([5], [6]) == 0
    assert metrics.first_divergence([], []) is None


def test_ngram_jaccard():
    assert metrics.ngram_jaccard([1, 2, 3], [2, 3, 4]) == pytest.approx(2 / 4)
    assert metrics.ngram_jaccard([1, 2, 3], [2, 3, 4], n=2) == pytest.approx(1 / 3)
    assert metrics.ngram_jaccard([1, 1, 1], [1]) == 1.0
    assert metrics.ngram_jaccard([], []) == 1.0
    assert metrics.ngram_jaccard([1], []) == 0.0


def test_paired_outcomes():
    out = metrics.paired_outcomes([True, True, False, False], [True, False, True, False])
    assert out == {"regressions": [1], "improvements": [2]}
    with pytest.raises(ValueError):
        metrics.paired_outcomes([True], [])


def test_quantiles():
    q = metrics.quantiles([1.0, 2.0, 3.0, 4.0, 5.0], (0.5, 1.0))
    assert q == {"p50": 3.0, "p100": 5.0}
    assert metrics.quantiles([]) == {}
