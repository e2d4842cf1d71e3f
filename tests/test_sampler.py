"""Sampler tests: reference semantics, torch path statistics, fused kernel == reference.

CPU runs the Triton kernel under ``TRITON_INTERPRET=1`` (set below before triton is imported)
on small vocabularies; GPU tests are marked ``gpu`` and skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # run the Triton kernel on the CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcap.sampling.reference import (  # noqa: E402
    gumbel_noise,
    keep_mask,
    reference_sample,
    scaled_logits,
    uniform_from_hash,
)
from kvcap.sampling.sampler import Sampler, SamplingBatch, logprob_dicts  # noqa: E402
from kvcap.sampling_params import SamplingParams  # noqa: E402

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

CUDA = torch.cuda.is_available()
KERNEL_DEVICE = "cuda" if CUDA else "cpu"
needs_kernel = pytest.mark.skipif(
    not HAVE_TRITON or (not CUDA and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton (CUDA or TRITON_INTERPRET=1)",
)


def make_params(b: int, gen: torch.Generator, v: int) -> dict[str, torch.Tensor]:
    """Random mixed per-row parameters for b rows of a vocabulary of v."""
    temperature = torch.rand(b, generator=gen) * 1.5 + 0.1
    top_k = torch.randint(-1, v + 3, (b,), generator=gen, dtype=torch.int32)
    top_k = torch.where(torch.rand(b, generator=gen) < 0.5, top_k.clamp(max=40), top_k)
    top_p = torch.where(torch.rand(b, generator=gen) < 0.7, torch.rand(b, generator=gen), 1.0)
    top_p = top_p.clamp(min=0.05)
    min_p = torch.where(torch.rand(b, generator=gen) < 0.3, torch.rand(b, generator=gen) * 0.3, 0.0)
    rng = torch.randint(-(2**31), 2**31, (b, 3), generator=gen, dtype=torch.int32)
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, rng=rng)


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.719 is the 1e-4 tail."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


# ----------------------------------------------------------------------------- reference rules


def test_topk_keeps_all_ties_at_kth_value() -> None:
    z = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    keep = keep_mask(z, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert keep.tolist() == [[True, False, True, True, True, False]]


def test_topp_includes_boundary_token() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    z = probs.log()
    keep = keep_mask(z, torch.tensor([0]), torch.tensor([0.7]), torch.tensor([0.0]))
    assert keep.tolist() == [[True, True, False, False]]  # 0.5 < 0.7 <= 0.8
    keep = keep_mask(z, torch.tensor([0]), torch.tensor([0.81]), torch.tensor([0.0]))
    assert keep.tolist() == [[True, True, True, False]]
    # top-p acts on the distribution renormalised after top-k: 0.5/0.8 = 0.625 < 0.7
    keep = keep_mask(z, torch.tensor([2]), torch.tensor([0.7]), torch.tensor([0.0]))
    assert keep.tolist() == [[True, True, False, False]]


def test_minp_and_off_values() -> None:
    z = torch.tensor([[0.0, -1.0, -3.0, float("-inf")]])
    keep = keep_mask(z, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.2]))
    assert keep.tolist() == [[True, True, False, False]]  # exp(-1) >= 0.2 > exp(-3)
    keep = keep_mask(z, torch.tensor([4]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert keep.all()  # k >= V is off


def test_scaled_logits_cleans_specials() -> None:
    x = torch.tensor([[float("nan"), float("inf"), -0.0, 2.0]])
    z = scaled_logits(x, torch.tensor([0.5]))
    assert z[0, 0] == float("-inf") and torch.isfinite(z[0, 1]) and z[0, 3] == 4.0
    assert not torch.signbit(z[0, 2])


# ----------------------------------------------------------------------------- sampler API


def test_batch_from_params_and_greedy() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=5, top_p=0.9)]
    batch = SamplingBatch.from_params(params, seeds=[1, 2**70], steps=[0, 3], device="cpu")
    assert batch.mode.tolist() == [0, 1] and batch.max_top_k == 5
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    out = Sampler("cpu").sample(logits, batch)
    assert out.dtype == torch.int64 and out[0].item() == 1  # lowest index on ties
    greedy = SamplingBatch.from_params(params[:1] * 2, [0, 0], [0, 0], "cpu")
    assert Sampler("cpu").sample(logits, greedy).tolist() == [1, 3]


def test_greedy_rows_without_a_finite_logit_ignore_the_batch() -> None:
    # the all-greedy shortcut once read -inf as -FLT_MAX (above the NaNs' -inf) and took the
    # first -inf token, where the same row in a batch with a sampled row took token 0
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[nan, -inf, -inf], [nan, nan, -inf], [1.0, inf, inf], [0.0, 2.0, 2.0]])
    greedy = Sampler.sample_greedy(x)
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams()]
    batch = SamplingBatch.from_params(params, [0] * 5, [0] * 5, "cpu")
    mixed = Sampler("cpu").sample(torch.cat([x, torch.zeros(1, 3)]), batch)
    assert greedy.tolist() == mixed[:4].tolist() == [0, 0, 1, 1]


def test_top_k_past_int32_keeps_every_token() -> None:
    # top_k is an int32 tensor: a larger k once overflowed inside the engine step
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(3)) * 3
    for k in (2**31, 2**63):
        huge = SamplingBatch.from_params([SamplingParams(temperature=1.0, top_k=k)] * 2,
                                         [7, 8], [0, 4], "cpu")
        off = SamplingBatch.from_params([SamplingParams(temperature=1.0, top_k=0)] * 2,
                                        [7, 8], [0, 4], "cpu")
        assert huge.top_k.tolist() == [2**31 - 1] * 2
        assert torch.equal(Sampler("cpu").sample(logits, huge), Sampler("cpu").sample(logits, off))


def test_seeded_reproducible_independent_of_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    v = 500
    logits = torch.randn(6, v, generator=gen) * 3
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=0.9) for k in (0, 10, 50, 0, 3, 0)]
    seeds, steps = [11, 12, 13, 14, 15, 16], [0, 5, 9, 1, 2, 3]
    full = Sampler("cpu").sample(logits, SamplingBatch.from_params(params, seeds, steps, "cpu"))
    for i in range(6):
        one = SamplingBatch.from_params([params[i]], [seeds[i]], [steps[i]], "cpu")
        assert Sampler("cpu").sample(logits[i : i + 1], one).item() == full[i].item()
    other = SamplingBatch.from_params(params, seeds, [s + 1 for s in steps], "cpu")
    assert not torch.equal(Sampler("cpu").sample(logits, other), full)


def test_torch_path_frequencies_match_distribution() -> None:
    """1e5 seeded draws (one per row) against the renormalised kept distribution."""
    gen = torch.Generator().manual_seed(1)
    v, n = 40, 100_000
    row = torch.randn(v, generator=gen) * 2
    t, k, p, mp = 0.8, 25, 0.9, 0.01
    z = scaled_logits(row[None], torch.tensor([t]))
    keep = keep_mask(z, torch.tensor([k]), torch.tensor([p]), torch.tensor([mp]))[0]
    probs = torch.where(keep, torch.softmax(z[0].double(), 0), 0.0)
    probs /= probs.sum()
    rng = torch.stack(
        [
            torch.full((n,), 77, dtype=torch.int32),
            torch.zeros(n, dtype=torch.int32),
            torch.arange(n, dtype=torch.int32),
        ],
        dim=1,
    )  # one request, steps 0..n-1
    tok = reference_sample(
        row.expand(n, v),
        torch.full((n,), t),
        torch.full((n,), k, dtype=torch.int32),
        torch.full((n,), p),
        torch.full((n,), mp),
        rng,
    )
    counts = torch.bincount(tok, minlength=v).double()
    assert counts[~keep].sum() == 0
    expected = probs[keep] * n
    chi2 = (((counts[keep] - expected) ** 2) / expected).sum().item()
    assert chi2 < chi2_critical(int(keep.sum()) - 1)


def test_compact_twin_equals_the_full_one() -> None:
    """reference_sample(compact=True) (partial sort, noise for kept tokens only; the CPU
    default) keeps the same tokens and samples the same ones as the full computation."""
    g = torch.Generator().manual_seed(12)
    for trial in range(60):
        b, v = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(2, 900, (1,),
                                                                              generator=g))
        x = torch.randn(b, v, generator=g) * float(1 + 6 * torch.rand(1, generator=g))
        if trial % 3 == 0:
            x = torch.round(x)  # many ties, also at the k-th value
        if trial % 5 == 0:
            x[:, ::4] = float("-inf")
        t = torch.rand(b, generator=g) * 1.5
        t[0] = 0.0 if trial % 4 == 0 else t[0]
        k = (torch.randint(1, max(2, min(v, 40)), (b,), generator=g, dtype=torch.int32)
             if trial % 2 else torch.randint(0, v + 3, (b,), generator=g, dtype=torch.int32))
        p = torch.where(torch.rand(b, generator=g) < 0.3, torch.ones(b), torch.rand(b, generator=g))
        mp = torch.where(torch.rand(b, generator=g) < 0.5, torch.zeros(b),
                         torch.rand(b, generator=g) * 0.3)
        rng = torch.randint(-(2**31), 2**31, (b, 3), generator=g, dtype=torch.int32)
        z = scaled_logits(x, t)
        assert torch.equal(keep_mask(z, k, p, mp, compact=True), keep_mask(z, k, p, mp)), trial
        assert torch.equal(reference_sample(x, t, k, p, mp, rng, compact=True),
                           reference_sample(x, t, k, p, mp, rng, compact=False)), trial


def test_uniforms_stay_inside_zero_one() -> None:
    """The extreme hashes give finite noise: the top one used to round to u = 1.0 (noise
    +inf: that token won regardless of its probability; NaN on a masked -inf logit)."""
    h = torch.tensor([0, 0x1FF, 0xFFFFFE00, 0xFFFFFFFF, -1, -(2**31)], dtype=torch.int64)
    u = uniform_from_hash(h)
    assert bool(((u > 0) & (u < 1)).all()), u
    assert torch.isfinite(-torch.log(-torch.log(u))).all()
    assert u[3] == u[4] == 1 - 2.0**-24 and u[0] == 2.0**-24


def test_uniforms_look_uniform() -> None:
    rng = torch.tensor([[5, 0, 0]], dtype=torch.int32)
    g = gumbel_noise(rng, torch.arange(200_000))
    u = torch.exp(-torch.exp(-g.double()))
    counts = torch.histc(u, bins=100, min=0, max=1)
    chi2 = (((counts - 2000.0) ** 2) / 2000.0).sum().item()
    assert chi2 < chi2_critical(99)


def test_logprob_dicts() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    ref = torch.log_softmax(logits, -1)
    top2 = logprob_dicts(logits, [1, 2], [2, 2])  # chosen among the top 2: two entries
    ids = [list(d) for d in top2]
    assert ids == [[1, 2], [2, 0]] or ids == [[1, 2], [2, 1]]  # most likely first
    for r, d in enumerate(top2):
        assert all(abs(v - float(ref[r, t])) < 1e-6 for t, v in d.items())
    assert logprob_dicts(logits, [0, 1], [0, 1]) == [
        {0: pytest.approx(float(ref[0, 0]))},  # n = 0: the chosen token alone
        {2: pytest.approx(float(ref[1, 2])), 1: pytest.approx(float(ref[1, 1]))}]


# ----------------------------------------------------------------------------- fused kernel


def packed(prm: dict[str, torch.Tensor], dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fparams, iparams on dev; mode from the parameters (greedy / filtered / plain)."""
    from kvcap.kernels.sampling_topk_topp import pack_params

    greedy = prm["temperature"] == 0
    filtered = (prm["top_k"] > 0) | (prm["top_p"] < 1) | (prm["min_p"] > 0)
    mode = torch.where(greedy, 0, torch.where(filtered, 1, 2)).to(torch.int32)
    args = [prm[k].to(dev) for k in ("temperature", "top_k", "top_p", "min_p", "rng")]
    return pack_params(*args, mode.to(dev))


def run_both(
    x: torch.Tensor,
    prm: dict[str, torch.Tensor],
    block: int | None,
    max_top_k: int,
    cand: int | None = None,
    cap2: int = 256,
    one_launch: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel (tokens, keep mask, path) and reference (tokens, keep mask) on the same inputs."""
    from kvcap.kernels.sampling_topk_topp import fused_sample

    dev = KERNEL_DEVICE
    b = x.shape[0]
    greedy = prm["temperature"] == 0
    fp, ip = packed(prm, dev)
    tok, thr, path = fused_sample(
        x.to(dev), fp, ip, max_top_k=max_top_k, return_aux=True, block=block, cand=cand,
        cap2=cap2, one_launch=one_launch,
    )  # fmt: skip
    ref = reference_sample(x, *(prm[k] for k in ("temperature", "top_k", "top_p", "min_p", "rng")))
    z = scaled_logits(x, prm["temperature"])
    ref_keep = keep_mask(z, prm["top_k"], prm["top_p"], prm["min_p"])
    m = z.max(1, keepdim=True).values
    e = torch.exp(z - torch.where(torch.isfinite(m), m, 0.0))
    keep = (z >= thr.cpu().unsqueeze(1)) & (e >= prm["min_p"].unsqueeze(1))
    rows = (~greedy).unsqueeze(1)  # masks are only defined for sampled rows
    assert b == tok.shape[0]
    return tok.cpu(), keep & rows, path.cpu(), ref, ref_keep & rows


@needs_kernel
def test_kernel_random_mixed_params() -> None:
    gen = torch.Generator().manual_seed(2)
    b, v = 6, 160
    x = torch.randn(b, v, generator=gen) * 3
    prm = make_params(b, gen, v)
    prm["temperature"][0] = 0.0
    prm["top_k"][1:3] = torch.tensor([10, 3], dtype=torch.int32)
    tok, keep, _, ref, ref_keep = run_both(x, prm, block=64, max_top_k=10, cand=8)
    assert torch.equal(keep, ref_keep)
    assert torch.equal(tok, ref)
    # batch composition: row 1 alone draws the same token
    one = {k: t[1:2] for k, t in prm.items()}
    assert run_both(x[1:2], one, block=64, max_top_k=10, cand=8)[0].item() == tok[1].item()


@needs_kernel
def test_kernel_many_chunks_stay_on_candidate_path() -> None:
    """Ten chunks hold more complete candidates than stage 2 sorts: its bound must rise and
    top-k rows still take the candidate path (a regression seen on the H200)."""
    gen = torch.Generator().manual_seed(7)
    b, v = 2, 640
    x = torch.randn(b, v, generator=gen) * 2
    prm = make_params(b, gen, v)
    prm["temperature"][:] = 1.0
    prm["top_k"][:] = torch.tensor([5, 7], dtype=torch.int32)
    prm["top_p"][:] = torch.tensor([0.95, 1.0])
    prm["min_p"][:] = 0.0
    tok, keep, path, ref, ref_keep = run_both(x, prm, block=64, max_top_k=7, cand=8, cap2=32)
    assert torch.equal(keep, ref_keep)
    assert torch.equal(tok, ref)
    assert path.tolist() == [0, 0]


def _ties_case() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits from 5 levels with rows whose answer lies outside the candidate lists (big
    nuclei, a k above the lists) next to rows that stay on the candidate path."""
    gen = torch.Generator().manual_seed(3)
    b, v = 5, 256
    x = torch.randint(0, 5, (b, v), generator=gen).float() * 0.5
    prm = make_params(b, gen, v)
    prm["temperature"][:] = 1.0
    prm["top_k"][:] = torch.tensor([3, 0, 120, 0, 7], dtype=torch.int32)
    prm["top_p"][:] = torch.tensor([1.0, 0.9, 0.8, 0.97, 0.6])
    prm["min_p"][:] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5])
    return x, prm


@pytest.fixture(scope="module")
def ties_run() -> tuple[torch.Tensor, ...]:
    """run_both on the ties case with the in-kernel fallback, for both tests that need it
    (one interpreted launch fewer)."""
    x, prm = _ties_case()
    return run_both(x, prm, block=64, max_top_k=0, cand=8)


@needs_kernel
def test_kernel_many_ties_and_fallback(ties_run) -> None:
    """Logits from 5 levels: ties at the k-th value and at the top-p boundary; big nuclei and
    a k above the candidate lists force the bisection fallback."""
    tok, keep, path, ref, ref_keep = ties_run
    assert torch.equal(keep, ref_keep)
    assert torch.equal(tok, ref)
    assert path.tolist()[1:4] == [1, 1, 1]  # the bisection path is exercised


def _extreme_case() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    b, v = 6, 96
    x = torch.randn(b, v, generator=gen)
    x[0] = 1.0  # all equal
    x[1, 17] = 3e38  # one huge
    x[2, ::3] = float("-inf")  # -inf entries
    x[3] = float("-inf")
    x[3, 40] = 0.5  # a single finite token
    x[4, 5] = float("nan")
    x[5] = float("-inf")  # nothing finite: token 0
    prm = make_params(b, gen, v)
    prm["temperature"][:] = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.9, 1.0])
    prm["top_k"][:] = torch.tensor([5, 3, 200, 0, 96, 4], dtype=torch.int32)  # k >= V is off
    prm["top_p"][:] = torch.tensor([0.5, 1.0, 0.95, 1.0, 1.0, 0.9])
    prm["min_p"][:] = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.3, 0.0])
    return x, prm


@needs_kernel
@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_kernel_extreme_values() -> None:
    x, prm = _extreme_case()
    tok, keep, _, ref, ref_keep = run_both(x, prm, block=32, max_top_k=5, cand=8)
    assert torch.equal(keep, ref_keep)
    assert torch.equal(tok, ref)
    assert tok[1].item() == 17 and tok[3].item() == 40 and tok[5].item() == 0


@needs_kernel
def test_kernel_draws_equal_reference() -> None:
    """16 seeded draws of one request through the kernel equal the reference draws."""
    gen = torch.Generator().manual_seed(5)
    n, v = 16, 16
    x = (torch.randn(v, generator=gen) * 1.5).expand(n, v).contiguous()
    prm = dict(
        temperature=torch.full((n,), 0.9),
        top_k=torch.full((n,), 12, dtype=torch.int32),
        top_p=torch.full((n,), 0.9),
        min_p=torch.full((n,), 0.02),
        rng=torch.stack([torch.full((n,), 9), torch.zeros(n), torch.arange(n)], 1).int(),
    )
    tok, _, _, ref, _ = run_both(x, prm, block=64, max_top_k=12, cand=16)
    assert torch.equal(tok, ref)
    assert len(set(tok.tolist())) >= 3


def _mixed_case() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Greedy, plain (temperature only) and filtered rows over 4 chunks of 32: ties at the
    k-th value, a wide nucleus over 5 levels (the fallback), a ten-way tie at the maximum."""
    gen = torch.Generator().manual_seed(8)
    b, v = 6, 128
    x = torch.randn(b, v, generator=gen) * 3
    x[2:4] = torch.randint(0, 5, (2, v), generator=gen).float() * 0.5
    x[5, 10:20] = x[5].max() + 1
    prm = make_params(b, gen, v)
    prm["temperature"][:] = torch.tensor([0.0, 0.7, 1.0, 1.0, 1.3, 1.0])
    prm["top_k"][:] = torch.tensor([0, 0, 3, 0, 6, 2], dtype=torch.int32)
    prm["top_p"][:] = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.8, 1.0])
    prm["min_p"][:] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.0])
    return x, prm


@needs_kernel
@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("fallback", [True, False])
def test_one_launch_equals_two_launches(fallback: bool) -> None:
    """The one-launch kernel gives the two-launch path's tokens, thresholds and paths on
    mixed rows, ties and extreme values (several chunks per row), and a second call the same
    (the per-row arrival counters are back to zero)."""
    import kvcap.kernels.sampling_topk_topp as k

    for case, max_top_k in ((_mixed_case, 6), (_extreme_case, 5)):
        x, prm = case()
        fp, ip = packed(prm, KERNEL_DEVICE)
        x = x.to(KERNEL_DEVICE)
        kw = dict(max_top_k=max_top_k, return_aux=True, block=32, cand=8, fallback=fallback)
        two = k.fused_sample(x, fp, ip, one_launch=False, **kw)
        for _ in range(2 if case is _mixed_case else 1):  # a second call: counters reset
            one = k.fused_sample(x, fp, ip, one_launch=True, **kw)
            for a, b in zip(one, two, strict=True):
                assert torch.equal(a.cpu(), b.cpu())
        if case is _mixed_case:
            assert two[2].tolist() == [0, 0, 0, 1, 0, 0]  # row 3 takes the fallback
            assert (two[0][3].item() == -1) == (not fallback)
        if fallback:  # and the tokens are the reference's
            names = ("temperature", "top_k", "top_p", "min_p", "rng")
            assert torch.equal(one[0].cpu(), reference_sample(x.cpu(), *(prm[n] for n in names)))
    assert all(int(w[3].abs().sum()) == 0 for w in k._WORKSPACE.values())  # counters reset


def test_one_launch_default_rule() -> None:
    """fused_sample's default: one launch up to ONE_LAUNCH_MAX_BATCH rows, then two."""
    import kvcap.kernels.sampling_topk_topp as k

    assert k.one_launch_default(1) and k.one_launch_default(k.ONE_LAUNCH_MAX_BATCH)
    assert not k.one_launch_default(k.ONE_LAUNCH_MAX_BATCH + 1)
    plan = k._plan(torch.device("cpu"), 4, 1000, 5, 64, None, 8, 256)
    assert plan.one_launch == k.one_launch_default(4) and plan.grid1 == (4, plan.p)


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("one_launch", [False, True])
@pytest.mark.parametrize("b", [1, 16, 64])
def test_gpu_large_vocab_matches_reference(b: int, one_launch: bool) -> None:
    """V = 248,320: top-k 20 + top-p 0.95 rows, top-p-only rows (fallback) and mixed rows,
    through the two-launch and the one-launch kernels (twice: the arrival counters reset)."""
    gen = torch.Generator().manual_seed(10 + b)
    v = 248_320
    x = torch.randn(b, v, generator=gen) * 2.5
    x[:, :50] += torch.randn(b, 50, generator=gen) * 4  # a peaked head, like LLM logits
    prm = make_params(b, gen, v)
    prm["top_k"][: (b + 1) // 2] = 20
    prm["top_p"][: (b + 1) // 2] = 0.95
    prm["temperature"][: (b + 1) // 2] = 1.0
    for _ in range(2):
        tok, keep, _, ref, ref_keep = run_both(
            x, prm, block=None, max_top_k=int(prm["top_k"].max()), one_launch=one_launch
        )
        assert torch.equal(keep, ref_keep)
        assert torch.equal(tok, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_kernel_frequencies_match_distribution() -> None:
    """1e5 kernel draws (one request, steps 0..n-1) against the kept distribution."""
    from kvcap.kernels.sampling_topk_topp import fused_sample, pack_params

    gen = torch.Generator().manual_seed(6)
    v, n = 64, 100_000
    row = torch.randn(v, generator=gen) * 2
    t, k, p, mp = 0.8, 30, 0.9, 0.005
    z = scaled_logits(row[None], torch.tensor([t]))
    keep = keep_mask(z, torch.tensor([k]), torch.tensor([p]), torch.tensor([mp]))[0]
    probs = torch.where(keep, torch.softmax(z[0].double(), 0), 0.0)
    probs /= probs.sum()
    dev = "cuda"
    rng = torch.stack([torch.full((n,), 5), torch.zeros(n), torch.arange(n)], dim=1).int().to(dev)
    full = lambda val, dt=torch.float32: torch.full((n,), val, dtype=dt, device=dev)  # noqa: E731
    fp, ip = pack_params(
        full(t), full(k, torch.int32), full(p), full(mp), rng, full(1, torch.int32)
    )
    tok = fused_sample(row.to(dev).expand(n, v).contiguous(), fp, ip, max_top_k=k).cpu()
    counts = torch.bincount(tok, minlength=v).double()
    assert counts[~keep].sum() == 0
    expected = probs[keep] * n
    chi2 = (((counts[keep] - expected) ** 2) / expected).sum().item()
    assert chi2 < chi2_critical(int(keep.sum()) - 1)


@needs_kernel
def test_sampler_routes_fallback_rows_to_the_twin(monkeypatch, ties_run) -> None:
    """Without the in-kernel bisection, rows outside the candidates come back -1 and the
    Sampler samples just those rows with the sort-based twin: the tokens equal the twin's
    (and the in-kernel fallback's) for every row."""
    import kvcap.kernels.sampling_topk_topp as k
    from kvcap.sampling.sampler import MODE_FILTERED, Sampler, SamplingBatch

    x, prm = _ties_case()
    b = x.shape[0]
    in_kernel, _, path, ref, _ = ties_run
    assert path.tolist()[1:4] == [1, 1, 1] and torch.equal(in_kernel, ref)
    dev = KERNEL_DEVICE
    mode = torch.full((b,), MODE_FILTERED, dtype=torch.int32)
    fp, ip = k.pack_params(
        *(prm[n].to(dev) for n in ("temperature", "top_k", "top_p", "min_p", "rng")), mode.to(dev)
    )
    marked = k.fused_sample(x.to(dev), fp, ip, block=64, cand=8, fallback=False).cpu()
    assert (marked[1:4] == -1).all() and torch.equal(marked[[0, 4]], ref[[0, 4]])

    real = k.fused_sample
    monkeypatch.setattr(k, "fused_sample", lambda *a, **kw: real(*a, block=64, cand=8, **kw))
    batch = SamplingBatch(
        temperature=prm["temperature"].to(dev),
        top_k=prm["top_k"].to(dev),
        top_p=prm["top_p"].to(dev),
        min_p=prm["min_p"].to(dev),
        rng=prm["rng"].to(dev),
        mode=mode.to(dev),
        fparams=fp,
        iparams=ip,
        all_greedy=False,
        max_top_k=0,
    )
    sampler = Sampler(dev)
    sampler.fused = True  # the kernel path on any device (the interpreter on CPU)
    assert torch.equal(sampler.sample(x.to(dev), batch).cpu(), ref)
    # Without top-p rows the Sampler keeps the kernel's own fallback (cheap for min-p / top-k).
    no_p = dataclasses.replace(batch, any_top_p=False)
    real_twin = Sampler._twin
    monkeypatch.setattr(Sampler, "_twin", staticmethod(lambda *a: (_ for _ in ()).throw(
        AssertionError("the twin ran although no row needs top-p"))))
    assert torch.equal(sampler.sample(x.to(dev), no_p).cpu(), ref)
    monkeypatch.setattr(Sampler, "_twin", real_twin)
