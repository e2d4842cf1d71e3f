"""Engine-facing sampler: per-row temperature / top-k / top-p / min-p with per-request seeds.

Semantics are written once, in ``kvcap/sampling/reference.py``. On CUDA the fused Triton kernel
(``kvcap/kernels/sampling_topk_topp.py``) runs; elsewhere, or with
``KVCAP_DISABLE_FUSED_SAMPLER=1``, the sort-based torch reference runs. Both pick the same token
from the same (seed, step) up to float32 rounding at a boundary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvcap.config import env_flag
from kvcap.sampling.reference import reference_sample
from kvcap.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MODE_GREEDY = 0  # temperature 0: arg-max
MODE_FILTERED = 1  # top-k, top-p or min-p active
MODE_PLAIN = 2  # temperature only: Gumbel-max over the whole vocabulary


def _split_seed(seed: int) -> tuple[int, int]:
    """seed mod 2**64 as two int32 bit patterns (low, high)."""
    s = seed % (1 << 64)
    lo, hi = s & 0xFFFFFFFF, s >> 32
    return (lo - (1 << 32) if lo >= 1 << 31 else lo), (hi - (1 << 32) if hi >= 1 << 31 else hi)


_I32_MAX = (1 << 31) - 1


def _i32(x: int) -> int:
    x %= 1 << 32
    return x - (1 << 32) if x >= 1 << 31 else x


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step, on the logits' device.

    temperature: float32 [B] (0 = greedy). top_k: int32 [B] (0 = off; values >= V act as off).
    top_p: float32 [B] (1 = off). min_p: float32 [B] (0 = off).
    rng: int32 [B, 3] = (seed low 32 bits, seed high 32 bits, step) bit patterns.
    mode: int32 [B] (MODE_GREEDY / MODE_FILTERED / MODE_PLAIN).
    fparams float32 [B, 4] / iparams int32 [B, 5]: the same, packed for the fused kernel.
    Host-side summaries (no device sync needed): ``all_greedy``, ``max_top_k``, ``any_top_p``
    (a filtered row with top_p < 1).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    rng: torch.Tensor
    mode: torch.Tensor
    fparams: torch.Tensor
    iparams: torch.Tensor
    all_greedy: bool
    max_top_k: int
    any_top_p: bool = True

    @property
    def size(self) -> int:
        return int(self.temperature.shape[0])

    @staticmethod
    def from_params(
        params: list[SamplingParams],
        seeds: list[int],
        steps: list[int],
        device: torch.device | str,
    ) -> SamplingBatch:
        """Build a batch: one SamplingParams, seed and step (tokens generated so far) per row."""
        if not len(params) == len(seeds) == len(steps):
            raise ValueError(
                f"params/seeds/steps lengths differ: {len(params)}/{len(seeds)}/{len(steps)}"
            )
        temps, ks, ps, mps, rng, modes = [], [], [], [], [], []
        for sp, seed, step in zip(params, seeds, steps, strict=True):
            greedy = sp.greedy
            # k >= V keeps every token, so a k past int32 (the tensor's type) is clamped, not
            # overflowed: an overflow would fail the whole engine step, every request in it
            k = 0 if greedy or sp.top_k <= 0 else min(int(sp.top_k), _I32_MAX)
            p = 1.0 if greedy else float(sp.top_p)
            mp = 0.0 if greedy else float(sp.min_p)
            temps.append(0.0 if greedy else float(sp.temperature))
            ks.append(k)
            ps.append(p)
            mps.append(mp)
            rng.append((*_split_seed(int(seed)), _i32(int(step))))
            filtered = k > 0 or p < 1.0 or mp > 0.0
            modes.append(MODE_GREEDY if greedy else MODE_FILTERED if filtered else MODE_PLAIN)
        dev = torch.device(device)

        fp = torch.tensor([[a, b, c, 0.0] for a, b, c in zip(temps, ps, mps, strict=True)])
        ip = torch.tensor(
            [[k, md, *r] for k, md, r in zip(ks, modes, rng, strict=True)], dtype=torch.int32
        ).reshape(-1, 5)
        fp, ip = fp.reshape(-1, 4).to(dev, non_blocking=True), ip.to(dev, non_blocking=True)
        return SamplingBatch(
            temperature=fp[:, 0],
            top_k=ip[:, 0],
            top_p=fp[:, 1],
            min_p=fp[:, 2],
            rng=ip[:, 2:5],
            mode=ip[:, 1],
            fparams=fp,
            iparams=ip,
            all_greedy=all(m == MODE_GREEDY for m in modes),
            max_top_k=max(ks, default=0),
            any_top_p=any(p < 1.0 for p in ps),
        )


def fused_sampler_enabled(device: torch.device) -> bool:
    """True when the Triton kernel path runs on ``device`` (CUDA, triton importable, no env)."""
    if env_flag("KVCAP_DISABLE_FUSED_SAMPLER"):
        return False
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class Sampler:
    """Logits to token ids: ``Sampler(device).sample(logits [B, V] f32, batch) -> [B] int64``."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.fused = fused_sampler_enabled(self.device)
        logger.info(
            "sampler: %s path on %s",
            "fused Triton top-k/top-p" if self.fused else "torch sort-based reference",
            self.device,
        )

    def sample(self, logits: torch.Tensor, batch: SamplingBatch, resolve: bool = True
               ) -> torch.Tensor:
        """logits float32 [B, V] (other float dtypes are upcast) -> token ids int64 [B].

        With resolve=False nothing waits for the device: rows the fused kernel leaves to the
        host come back -1, and the caller passes their indices to `resolve` once it has the
        tokens on the host anyway (the engine's one sync per step).
        """
        if logits.dim() != 2 or logits.shape[0] != batch.size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match batch of {batch.size}")
        if batch.all_greedy:
            return self.sample_greedy(logits)
        if self.fused:
            from kvcap.kernels.sampling_topk_topp import fused_sample

            # Rows whose answer lies outside the kernel's candidates (a wide top-p nucleus,
            # large k, low min-p) need an exact pass over the whole row. In the kernel that is
            # one program per row: one pass for min-p, ~32 bisection passes for top-k, more
            # for top-p's float64 mass (H200, 16 x 248,320: 0.28 ms with min-p alone, 3.7 ms
            # with top-p alone; the full sort-based twin took 2.3-2.8 ms whatever the rows), so
            # rows needing top-p's bisection come back -1 and the twin samples them (the same
            # token from the same (seed, step)); the others stay in the kernel.
            tok = fused_sample(logits, batch.fparams, batch.iparams, batch.max_top_k,
                               fallback=not batch.any_top_p)
            if resolve:
                need = tok < 0
                if bool(need.any()):  # syncs, as the caller's .tolist() does anyway
                    rows = need.nonzero().squeeze(1)
                    tok[rows] = self._twin(logits, batch, rows)
            return tok
        return reference_sample(
            logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.rng
        )

    def resolve(self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> list[int]:
        """Tokens of the rows `sample(..., resolve=False)` returned as -1."""
        idx = torch.tensor(rows, dtype=torch.int64).to(logits.device)
        return self._twin(logits, batch, idx).tolist()

    @staticmethod
    def _twin(logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
        # (callers have synced: the data-sized twin is exact and much cheaper)
        return reference_sample(logits[rows], batch.temperature[rows], batch.top_k[rows],
                                batch.top_p[rows], batch.min_p[rows], batch.rng[rows],
                                compact=True)

    @staticmethod
    def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
        """Every row greedy (what ``sample`` does for an all-greedy batch, without building it):
        arg-max with NaN as -inf, lowest index on ties."""
        # neginf kept: nan_to_num's default turns -inf into -FLT_MAX, above the NaNs' -inf, so
        # a row with no finite logit took its first -inf token here but token 0 in a batch
        # with sampled rows (the reference / kernel), and the token depended on the batch
        return torch.argmax(torch.nan_to_num(logits.float(), nan=float("-inf"),
                                             neginf=float("-inf")), dim=1)


def logprob_dicts(logits: torch.Tensor, chosen: list[int], top_n: list[int]
                  ) -> list[dict[int, float]]:
    """Row r of logits [B, V] -> {token: log-probability} holding the top_n[r] most likely
    tokens (n = 0: none) and chosen[r]. One log_softmax, one top-k for every row and three
    device->host copies, whatever B."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(chosen, dtype=torch.int64).to(lsm.device, non_blocking=True)
    picked = lsm.gather(1, ids[:, None])[:, 0].tolist()
    most = max(0, min(max(top_n, default=0), lsm.shape[-1]))
    values, idx = torch.topk(lsm, most, dim=-1)
    values, idx = values.tolist(), idx.tolist()
    out = []
    for r, n in enumerate(top_n):
        d = dict(zip(idx[r][:n], values[r][:n], strict=True))
        d[chosen[r]] = picked[r]
        out.append(d)
    return out
