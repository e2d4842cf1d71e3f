"""K/V activation statistics for calibration (SYSTEM.md §2).

`KVStatsObserver.observe(layer_idx, k, v)` runs inside every real forward, on the tensors the
cache write receives ([T, Hkv, D], any device and dtype). Per shard, layer and tensor (K, V) it
accumulates on the tensors' device: element count, finite count, nonzero count, exact max|x|,
rows (tokens) seen, and a histogram of log2|x| with 4096 bins over [-24, 16).

Histogram bins are defined by FP32 edges `E[i] = fp32(2^(lo + i*(hi-lo)/bins))`; a nonzero |x|
lands in bin i iff E[i] <= |x| < E[i+1] exactly, values below E[0] go to bin 0 and values
>= E[bins] to the last bin. Zeros are counted only in count - nonzero. So E[i+1] is a guaranteed
upper bound for every value in bin i < bins-1. Binning works on FP32 bit patterns (integer
order equals float order for |x|): a table indexed by the top bits gives the bin of the cell's
smallest value, and since a cell spans less than a bin, one comparison with the next edge
finishes it: about ten vectorized passes, no log2, no sort (~10 ns per value on one CPU core).

A non-finite value aborts with CalibrationError naming shard, layer and tensor. `stats()`
returns a `KVStats` (numpy, mergeable across shards, ranks and runs; see kvcap.scales.stats).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from kvcap.errors import CalibrationError
from kvcap.scales.stats import HIST_BINS, LOG2_HI, LOG2_LO, TENSORS, KVStats, ShardStats, bin_edges

logger = logging.getLogger(__name__)

_INF_BITS = 0x7F800000


def _cell_shift(bins: int, log2_lo: float, log2_hi: float) -> int:
    """Largest right shift of FP32 bit patterns whose cells span at most half a bin."""
    half_bin = (2.0 ** ((log2_hi - log2_lo) / bins) - 1.0) / 2
    shift = 23 + math.floor(math.log2(half_bin))
    if shift < 4:
        raise ValueError("histogram bins are too narrow")
    return min(shift, 23)


class _Acc:
    """Device-side accumulators of one shard: [L, 2] counters, [L, 2, bins] histogram."""

    def __init__(self, num_layers: int, bins: int, device: torch.device):
        self.count = [[0, 0] for _ in range(num_layers)]
        self.rows = [0] * num_layers
        self.nonzero = torch.zeros(num_layers, 2, dtype=torch.int64, device=device)
        self.max_bits = torch.zeros(num_layers, 2, dtype=torch.int32, device=device)
        self.hist = torch.zeros(num_layers, 2, bins, dtype=torch.int64, device=device)

    def to_numpy(self) -> ShardStats:
        count = np.array(self.count, dtype=np.int64)
        return ShardStats(
            count=count, finite=count.copy(), nonzero=self.nonzero.cpu().numpy(),
            max_abs=self.max_bits.cpu().view(torch.float32).double().numpy(),
            hist=self.hist.cpu().numpy(),
            rows=np.array(self.rows, dtype=np.int64))


class KVStatsObserver:
    """Collects calibration statistics; pass it as `LLM(..., kv_observer=obs)`."""

    def __init__(self, num_layers: int, rank: int = 0, bins: int = HIST_BINS,
                 log2_lo: float = LOG2_LO, log2_hi: float = LOG2_HI):
        if num_layers < 1 or bins < 2 or not log2_lo < log2_hi:
            raise ValueError("need num_layers >= 1, bins >= 2 and log2_lo < log2_hi")
        self.num_layers = num_layers
        self.rank = rank
        self.bins = bins
        self.log2_lo = log2_lo
        self.log2_hi = log2_hi
        self._edges_np = bin_edges(bins, log2_lo, log2_hi)
        self._shift = _cell_shift(bins, log2_lo, log2_hi)
        self._lut: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._shards: dict[str, _Acc] = {}
        self.shard = "default"

    def set_shard(self, name: str) -> None:
        """Attribute the following observations to shard `name` (a corpus)."""
        self.shard = name

    def _acc(self, device: torch.device) -> _Acc:
        acc = self._shards.get(self.shard)
        if acc is None:
            acc = self._shards[self.shard] = _Acc(self.num_layers, self.bins, device)
        elif acc.hist.device != device:
            raise CalibrationError(f"shard {self.shard!r} observed tensors on {device} after "
                                   f"{acc.hist.device}; use one device per observer")
        return acc

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per device: the bin of each cell of FP32 bit patterns (top bits), and E[1..bins]
        as bit patterns. A cell spans less than one bin, so one comparison fixes the bin."""
        t = self._lut.get(device)
        if t is None:
            edges = torch.from_numpy(self._edges_np)
            cells = torch.arange(1 << (31 - self._shift), dtype=torch.int64) << self._shift
            low = cells.to(torch.int32).view(torch.float32)
            table = (torch.searchsorted(edges, low, right=True) - 1).clamp_(0, self.bins - 1)
            t = self._lut[device] = (table.to(torch.int32).to(device),
                                     edges[1:].view(torch.int32).contiguous().to(device))
        return t

    @torch.no_grad()
    def observe(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Accumulate one layer's K and V ([T, Hkv, D]) of one forward."""
        if not 0 <= layer_idx < self.num_layers:
            raise CalibrationError(f"observer got layer {layer_idx}, expected 0.."
                                   f"{self.num_layers - 1}")
        if k.shape[0] != v.shape[0]:
            raise CalibrationError(f"layer {layer_idx}: K has {k.shape[0]} rows, V "
                                   f"{v.shape[0]}")
        acc = self._acc(k.device)
        acc.rows[layer_idx] += int(k.shape[0])
        for ti, x in enumerate((k, v)):
            self._observe_tensor(acc, layer_idx, ti, x)

    def _observe_tensor(self, acc: _Acc, layer: int, ti: int, x: torch.Tensor) -> None:
        n = x.numel()
        if n == 0:
            return
        a = x.detach().reshape(-1)
        if a.dtype != torch.float32:
            a = a.float()  # exact for fp16/bf16; fp64 values beyond FP32 become inf below
        # |x| as FP32 bit patterns: for non-negative floats, integer order == float order,
        # and inf/NaN patterns are >= 0x7F800000.
        bits = a.view(torch.int32) & 0x7FFFFFFF
        m = bits.max()
        if int(m) >= _INF_BITS:
            bad = int((~torch.isfinite(x)).sum()) or n
            raise CalibrationError(
                f"non-finite K/V activations: shard {self.shard!r} layer {layer} "
                f"{TENSORS[ti]} has {bad} non-finite of {n} values; calibration aborted")
        table, upper = self._tables(a.device)
        idx = table.index_select(0, bits >> self._shift)  # bin of the cell's smallest value
        idx += bits >= upper.index_select(0, idx)  # the cell may straddle the next edge
        h = torch.bincount(idx.clamp_(max=self.bins - 1), minlength=self.bins)
        nz = torch.count_nonzero(bits)
        h[0] -= n - nz  # zeros land in bin 0; they are not part of the histogram
        acc.hist[layer, ti] += h
        acc.nonzero[layer, ti] += nz
        acc.max_bits[layer, ti] = torch.maximum(acc.max_bits[layer, ti], m)
        acc.count[layer][ti] += n

    def reset(self) -> None:
        self._shards.clear()

    def stats(self) -> KVStats:
        """A numpy snapshot of everything observed so far, per shard."""
        shards = {name: acc.to_numpy() for name, acc in self._shards.items()}
        return KVStats(num_layers=self.num_layers, bins=self.bins, log2_lo=self.log2_lo,
                       log2_hi=self.log2_hi, ranks=[self.rank], shards=shards)
