"""Torch reference of QSA selection: group scores, exact top-k with the tie rule, expansion.

Per query row at position `pos` of a sequence holding `seq_len` tokens:
  visible = min((pos + 1) // R, seq_len // R) complete groups (R = compress ratio);
  score each visible group (one score row per selection head: 1 for a trained indexer,
  one per KV head for the training-free one);
  keep the top k groups, higher score first and the lower group index on ties (exact);
  expand each kept group g to tokens R*g .. R*g+R-1, in ascending group order, then append
  the open tail group's tokens R*visible .. pos (0..R-1 of them); pad with -1.
The Triton kernels (kvcap/kernels/qsa_*.py) must return identical indices.
"""

from __future__ import annotations

import torch

SCORE_MODES = ("relu_sum", "dot_sum", "dot_max", "bound_sum", "bound_max")


def visible_groups(pos: torch.Tensor, seq_len: torch.Tensor | int, ratio: int) -> torch.Tensor:
    """Complete groups a row at `pos` may select: int64, same shape as `pos`."""
    seq = torch.as_tensor(seq_len, device=pos.device)
    return torch.minimum((pos.long() + 1) // ratio, seq.long() // ratio)


def score_groups(q: torch.Tensor, keys: torch.Tensor, mode: str, scale: float = 1.0,
                 keys_hi: torch.Tensor | None = None) -> torch.Tensor:
    """Group scores of n query rows.

    q: [n, Hs, J, dk] (any float; J query heads per selection head).
    keys: [Hs, G, dk] group keys (trained compressed keys, mean keys, or the min bound);
    keys_hi: [Hs, G, dk] max bound (modes bound_*).
    mode: relu_sum  sum_j ReLU(q_j . k) * scale          (trained indexer)
          dot_sum   sum_j q_j . k ;  dot_max  max_j q_j . k
          bound_sum sum_j sum_d max(q_jd lo_d, q_jd hi_d) ;  bound_max  max_j (...)
    The bound is computed as q . (lo+hi)/2 + |q| . (hi-lo)/2 (the kernels do the same).
    Returns FP32 [n, Hs, G].
    """
    if mode not in SCORE_MODES:
        raise ValueError(f"score mode {mode!r} is not one of {SCORE_MODES}")
    qf = q.float().permute(1, 0, 2, 3)  # [Hs, n, J, dk]
    hs, n, j, dk = qf.shape
    qf = qf.reshape(hs, n * j, dk)
    if mode.startswith("bound"):
        if keys_hi is None:
            raise ValueError("bound scores need keys_hi")
        lo, hi = keys.float(), keys_hi.float()
        centre, radius = (lo + hi) * 0.5, (hi - lo) * 0.5
        s = torch.matmul(qf, centre.transpose(1, 2)) + torch.matmul(qf.abs(),
                                                                     radius.transpose(1, 2))
    else:
        s = torch.matmul(qf, keys.float().transpose(1, 2))  # [Hs, n*J, G]
    s = s.reshape(hs, n, j, -1)
    if mode == "relu_sum":
        s = torch.relu(s).sum(2) * scale
    elif mode.endswith("_sum"):
        s = s.sum(2)
    else:
        s = s.amax(2)
    return s.permute(1, 0, 2).contiguous()


def topk_groups(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k of each row among its first `visible` groups.

    scores: FP32 [N, G] (finite); visible: int [N] (<= G). Returns int64 [N, k]: the chosen
    group indices in ascending order, -1 padded. Order of choice: higher score first, lower
    index on ties (a stable descending sort keeps equal scores in index order).
    """
    n, g = scores.shape
    idx = torch.arange(g, device=scores.device)
    vis = visible.long().to(scores.device)
    masked = scores.float().masked_fill(idx[None, :] >= vis[:, None], float("-inf"))
    kk = min(k, g)
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :kk]
    rank = torch.arange(kk, device=scores.device)
    keep = rank[None, :] < torch.clamp(vis, max=kk)[:, None]
    big = torch.iinfo(torch.int64).max
    chosen = torch.sort(torch.where(keep, order, big), dim=-1).values
    chosen = torch.where(chosen == big, -1, chosen)
    if kk < k:
        chosen = torch.cat([chosen, chosen.new_full((n, k - kk), -1)], dim=1)
    return chosen


def expand_groups(groups: torch.Tensor, visible: torch.Tensor, pos: torch.Tensor, ratio: int,
                  include_tail: bool = True) -> torch.Tensor:
    """Token indices of the selection: groups int64 [N, k] (ascending, -1 padded), visible and
    pos int [N] -> int32 [N, k*ratio + (ratio-1 if include_tail)], -1 padded."""
    n, k = groups.shape
    dev = groups.device
    j = torch.arange(ratio, device=dev)
    tok = groups[:, :, None] * ratio + j  # [N, k, R]
    tok = torch.where(groups[:, :, None] >= 0, tok, -1).reshape(n, k * ratio)
    nsel = (groups >= 0).sum(1) * ratio  # [N]
    width = k * ratio + (ratio - 1 if include_tail else 0)
    out = torch.full((n, width), -1, dtype=torch.int64, device=dev)
    out[:, : k * ratio] = tok
    if include_tail and ratio > 1:
        tail_start = visible.long().to(dev) * ratio
        t = tail_start[:, None] + torch.arange(ratio - 1, device=dev)  # [N, R-1]
        ok = t <= pos.long().to(dev)[:, None]
        col = nsel[:, None] + torch.arange(ratio - 1, device=dev)
        rows = torch.arange(n, device=dev)[:, None].expand_as(col)
        out[rows[ok], col[ok]] = t[ok]
    return out.to(torch.int32)


def select_tokens(scores: torch.Tensor, pos: torch.Tensor, seq_len: torch.Tensor | int,
                  ratio: int, k: int, include_tail: bool = True) -> torch.Tensor:
    """Full reference selection. scores FP32 [n, Hs, G]; pos int [n] (query positions);
    seq_len int or int [n]. Returns int32 [n, Hs, W] token indices, -1 padded."""
    n, hs, g = scores.shape
    vis = visible_groups(pos, seq_len, ratio)  # [n]
    if bool((vis > g).any()):
        raise ValueError(f"scores hold {g} groups but a row sees {int(vis.max())}")
    vis_h = vis.repeat_interleave(hs)
    groups = topk_groups(scores.reshape(n * hs, g), vis_h, k)
    toks = expand_groups(groups, vis_h, pos.long().repeat_interleave(hs), ratio, include_tail)
    return toks.reshape(n, hs, -1)


def selection_mask(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Boolean [n, Hs, seq_len] mask of the selected positions of int [n, Hs, W] tokens."""
    n, hs, _ = tokens.shape
    mask = torch.zeros((n, hs, seq_len + 1), dtype=torch.bool, device=tokens.device)
    idx = torch.where(tokens >= 0, tokens.long(), seq_len)
    mask.scatter_(2, idx, True)
    return mask[:, :, :seq_len]
