"""QSA quality tooling: selection overlap between arms, output agreement, and the recall of
the exact (dense) attention mass captured by a selection.

  selection_overlap(a, b)   mean row Jaccard, recall of a's set in b, exact-row ratio
  output_agreement(a, b)    mean / min row cosine and relative L2 of b against a
  MassRecallProbe           a QSABackend.probe: per layer, the dense softmax mass (from the
                            layer's own q and cached K) that falls on the selected tokens
  ShadowSelect              a backend that attends densely but runs candidate QSA selections
                            on the side, so several indexer designs see identical q/k
"""

from __future__ import annotations

from collections import defaultdict

import torch

from kvcap.attention.base import AttentionBackend
from kvcap.attention.metadata import AttentionMetadata
from kvcap.attention.torch_ref import gather_kv_reference
from kvcap.kv_cache.pool import LayerKVCache
from kvcap.qsa.backend import QSABackend
from kvcap.qsa.selection import selection_mask


def _sets(tokens: torch.Tensor, size: int) -> torch.Tensor:
    """int [N, Hs, W] -> bool [N*Hs, size] membership."""
    n, hs, _ = tokens.shape
    return selection_mask(tokens, size).reshape(n * hs, size)


def selection_overlap(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Compare selections a (reference arm, e.g. FP16) and b, int [N, Hs, W] (-1 padded):
    mean row Jaccard |a&b|/|a|b|, mean recall |a&b|/|a|, fraction of identical rows."""
    size = int(max(a.max(), b.max(), 0)) + 1
    sa, sb = _sets(a, size), _sets(b, size)
    inter = (sa & sb).sum(1).double()
    union = (sa | sb).sum(1).double()
    na = sa.sum(1).double()
    keep = union > 0
    return {
        "rows": int(keep.sum()),
        "jaccard": float((inter[keep] / union[keep]).mean()),
        "recall": float((inter[keep] / na[keep].clamp(min=1)).mean()),
        "exact_rows": float((sa == sb).all(1)[keep].double().mean()),
    }


def output_agreement(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """a, b [N, F] (any float): per-row cosine (mean, min) and relative L2 ||b-a|| / ||a||."""
    af, bf = a.double().flatten(1), b.double().flatten(1)
    cos = torch.nn.functional.cosine_similarity(af, bf, dim=1)
    return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
            "rel_l2": float((bf - af).norm() / af.norm().clamp(min=1e-30))}


def mass_recall(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
                tokens: torch.Tensor, softmax_scale: float, min_visible: int = 0,
                ratio: int = 4, every: int = 1) -> tuple[float, int]:
    """(sum over rows x query heads of the dense attention mass on the selected tokens,
    number of rows x heads counted). Only rows with more than `min_visible` complete groups
    (others are dense by construction) and, with `every` > 1, only positions p with
    p % every == every - 1 (a subsample) are counted."""
    total, count = 0.0, 0
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        n = end - start
        if n == 0:
            continue
        pos = torch.arange(seq_len - n, seq_len, device=q.device)
        rows = (((pos + 1) // ratio) > min_visible) & (pos % every == every - 1)
        if not bool(rows.any()):
            continue
        kf, _ = gather_kv_reference(cache, meta.block_tables[i], seq_len)
        hq, hkv = q.shape[1], kf.shape[0]
        qf = q[start:end][rows].float().transpose(0, 1)  # [Hq, r, D]
        kk = kf.repeat_interleave(hq // hkv, dim=0)
        s = torch.matmul(qf, kk.transpose(1, 2)) * softmax_scale  # [Hq, r, S]
        causal = torch.arange(seq_len, device=q.device)[None, :] <= pos[rows][:, None]
        probs = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        m = selection_mask(tokens[start:end][rows], seq_len).transpose(0, 1)  # [Hs, r, S]
        if m.shape[0] != 1:
            m = m.repeat_interleave(hq // hkv, dim=0)
        total += float((probs * m).sum())
        count += probs.shape[0] * probs.shape[1]
    return total, count


class MassRecallProbe:
    """Accumulates per-layer dense attention-mass recall; `probe` for QSABackend.probe."""

    def __init__(self, topk_groups: int, ratio: int = 4, every: int = 1):
        self.k, self.ratio, self.every = topk_groups, ratio, every
        self.sums: dict[object, list[float]] = defaultdict(lambda: [0.0, 0])

    def __call__(self, layer, q, cache, meta, tokens, softmax_scale, key=None) -> None:
        s, n = mass_recall(q, cache, meta, tokens, softmax_scale, self.k, self.ratio,
                           self.every)
        acc = self.sums[layer if key is None else (key, layer)]
        acc[0] += s
        acc[1] += n

    def report(self) -> dict[str, float]:
        """Mean recall per layer key (rows that had more than k complete groups)."""
        return {str(k): v[0] / v[1] for k, v in sorted(self.sums.items(), key=str) if v[1]}


class ShadowSelect(AttentionBackend):
    """Dense attention through `inner`; on each layer also runs every candidate QSABackend's
    selection (own side caches) and reports it to `probe(name, layer, q, cache, meta,
    tokens, softmax_scale)`. Candidate selections never change the model's numbers."""

    name = "qsa-shadow"

    def __init__(self, inner: AttentionBackend, candidates: dict[str, QSABackend], probe):
        self.inner, self.candidates, self.probe = inner, candidates, probe

    def forward(self, q, k, v, cache, meta, softmax_scale, out):
        self.inner.forward(q, k, v, cache, meta, softmax_scale, out)
        for name, cand in self.candidates.items():
            if cache.layer_idx in cand.layers:
                tokens = cand.select(q, k, cache, meta)
                self.probe(name, cache.layer_idx, q, cache, meta, tokens, softmax_scale)
        return out
