"""GPU clock and power readings for benchmark JSONs, through NVML as torch exposes it (None
where NVML or the GPU is missing, e.g. in CI). Why they are recorded: an H200 at its 700 W
power cap lowers the SM clock from 1,980 to 1.3-1.65 GHz, which slows E4M3 decode 9-11% and
SDPA 4-5% (docs/kernels.md, "Eighteenth change"), so two arms of a benchmark compare fairly
only at similar clocks."""

from __future__ import annotations

import statistics

import torch


def sm_clock_mhz(device: int = 0) -> int | None:
    """The GPU's SM clock now, in MHz."""
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # noqa: BLE001 - pynvml not installed, no GPU, no permission
        return None


def power_w(device: int = 0) -> float | None:
    """The GPU's power draw now, in watts."""
    try:
        return torch.cuda.power_draw(device) / 1000.0
    except Exception:  # noqa: BLE001 - pynvml not installed, no GPU, no permission
        return None


class Sampler:
    """Readings taken now and then during a timed phase (every `every`-th call of sample(),
    an NVML query costs tens of microseconds) and summarised as medians and extremes."""

    def __init__(self, every: int = 8, clock=sm_clock_mhz, power=power_w):
        self.every, self.clock, self.power = every, clock, power
        self.calls = 0
        self.mhz: list[int] = []
        self.watts: list[float] = []

    def sample(self) -> None:
        if self.calls % self.every == 0:
            mhz, watts = self.clock(), self.power()
            if mhz is not None:
                self.mhz.append(mhz)
            if watts is not None:
                self.watts.append(watts)
        self.calls += 1

    def summary(self) -> dict:
        """{'sm_mhz': median, 'sm_mhz_min', 'power_w': median, 'power_w_max'}, each None
        without readings."""
        def med(xs):
            return statistics.median(xs) if xs else None
        return {"sm_mhz": med(self.mhz), "sm_mhz_min": min(self.mhz, default=None),
                "power_w": med(self.watts), "power_w_max": max(self.watts, default=None)}
