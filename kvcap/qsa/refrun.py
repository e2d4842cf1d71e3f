"""Run the reference-shape QSA model over a paged pool and compare FP16 vs calibrated E4M3.

`compare_kv_arms` runs the same token ids through an FP16-KV arm and an E4M3-KV arm (scales
calibrated from the FP16 arm's own K/V: scale = ceil_fp32(max_abs / 448)), both with QSA on
the model's QSA layers, and reports per QSA layer: selection overlap (rows that actually had
more than k groups to choose from), gated attention-output agreement on those rows, on the
rows whose selections are identical in both arms (the E4M3 error alone) and on the decode
rows, plus the final logits' agreement. Prefill is chunked; decode steps follow (the same
random ids fed to both arms).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvcap.attention.base import AttentionBackend
from kvcap.attention.metadata import AttentionMetadata
from kvcap.kv_cache.pool import KVCachePool
from kvcap.kv_cache.spec import KVCacheSpec
from kvcap.models.llama import ForwardContext
from kvcap.qsa.backend import QSABackend
from kvcap.qsa.config import QSAConfig
from kvcap.qsa.indexer import QSASideCaches
from kvcap.qsa.model import QSAReferenceModel, RefShape
from kvcap.qsa.quality import output_agreement, selection_overlap

logger = logging.getLogger(__name__)


@dataclass
class ArmResult:
    logits: list[torch.Tensor] = field(default_factory=list)  # FP32 [vocab] per step
    attn: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # QSA layers' outputs
    tokens: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    positions: list[torch.Tensor] = field(default_factory=list)
    max_abs: dict[int, list[float]] = field(default_factory=dict)  # layer -> [K, V]


def make_qsa_backend(inner: AttentionBackend, shape: RefShape, cfg: QSAConfig,
                     num_blocks: int, block_size: int, device: torch.device) -> QSABackend:
    side = QSASideCaches(shape.qsa_layers, num_blocks, block_size, cfg.compress_ratio, 1,
                         shape.index_dim, torch.float16, device)
    return QSABackend(inner, cfg, side, device)


def run_arm(model: QSAReferenceModel, inner: AttentionBackend, kv_dtype: str, ids: list[int],
            decode_ids: list[int], cfg: QSAConfig, chunk: int, device: torch.device,
            scales: tuple[list[float], list[float]] | None = None,
            block_size: int = 16) -> ArmResult:
    """One arm: chunked prefill of `ids`, then one decode step per id of `decode_ids`."""
    s = model.shape
    total = len(ids) + len(decode_ids)
    nblk = -(-total // block_size)
    pool = KVCachePool(KVCacheSpec(s.num_layers, s.num_kv_heads, s.head_dim, block_size,
                                   kv_dtype), nblk, device)
    if scales is not None:
        pool.set_scales(scales[0], scales[1], "refrun calibration")
    backend = make_qsa_backend(inner, s, cfg, nblk, block_size, device)
    backend.record = {}
    res = ArmResult()
    hooks = []
    for i in s.qsa_layers:
        def hook(_m, _inp, out, i=i):
            res.attn.setdefault(i, []).append(out.detach().float().cpu())
        hooks.append(model.layers[i].self_attn.attn_out.register_forward_hook(hook))

    def observe(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        cur = res.max_abs.setdefault(layer, [0.0, 0.0])
        cur[0] = max(cur[0], float(k.abs().max()))
        cur[1] = max(cur[1], float(v.abs().max()))

    table = list(range(nblk))
    steps = [(p, min(chunk, len(ids) - p)) for p in range(0, len(ids), chunk)]
    steps += [(len(ids) + j, 1) for j in range(len(decode_ids))]
    seq = list(ids) + list(decode_ids)
    try:
        with torch.inference_mode():
            for start, n in steps:
                meta = AttentionMetadata.build([n], [start + n], [table], block_size, device)
                pos = torch.arange(start, start + n, device=device)
                x = torch.tensor(seq[start:start + n], device=device)
                hidden = model(x, pos, ForwardContext(backend, pool, meta, observe))
                res.logits.append(model.compute_logits(hidden[-1:])[0].cpu())
                res.positions.append(pos.cpu())
    finally:
        for h in hooks:
            h.remove()
    res.tokens = {k: [t.cpu() for t in v] for k, v in backend.record.items()}
    return res


def compare_kv_arms(shape: RefShape, cfg: QSAConfig, prompt_len: int, decode_steps: int,
                    chunk: int, device: torch.device, inner_fn, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> dict:
    """FP16-KV vs calibrated E4M3-KV arms of the random reference-shape model (QSA on).
    `inner_fn()` builds the dense inner backend. Returns a JSON-able report."""
    from kvcap.scales.report import scale_for

    model = QSAReferenceModel(shape, seed=seed).to(device=device, dtype=dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, shape.vocab_size, (prompt_len + decode_steps,), generator=g)
    ids, decode_ids = ids[:prompt_len].tolist(), ids[prompt_len:].tolist()
    fp16 = run_arm(model, inner_fn(), "fp16", ids, decode_ids, cfg, chunk, device)
    ks = [scale_for(fp16.max_abs[i][0]) for i in range(shape.num_layers)]
    vs = [scale_for(fp16.max_abs[i][1]) for i in range(shape.num_layers)]
    e4m3 = run_arm(model, inner_fn(), "fp8_e4m3", ids, decode_ids, cfg, chunk, device,
                   scales=(ks, vs))
    pos = torch.cat(fp16.positions)
    sparse = (pos + 1) // cfg.compress_ratio > cfg.topk_groups
    report: dict = {"prompt_len": prompt_len, "decode_steps": decode_steps,
                    "topk_groups": cfg.topk_groups, "sparse_rows": int(sparse.sum()),
                    "layers": {}}
    for i in shape.qsa_layers:
        ta, tb = torch.cat(fp16.tokens[i]), torch.cat(e4m3.tokens[i])
        oa, ob = torch.cat(fp16.attn[i]), torch.cat(e4m3.attn[i])
        same = (ta == tb).flatten(1).all(1) & sparse
        report["layers"][str(i)] = {
            "selection": selection_overlap(ta[sparse], tb[sparse]),
            "output": output_agreement(oa[sparse], ob[sparse]),
            "output_same_selection": output_agreement(oa[same], ob[same]),
            "output_decode": output_agreement(oa[-decode_steps:], ob[-decode_steps:]),
            "decode_rows_same_selection": int(same[-decode_steps:].sum()),
        }
    la, lb = torch.stack(fp16.logits), torch.stack(e4m3.logits)
    report["logits"] = output_agreement(la, lb)
    report["k_scales"], report["v_scales"] = ks, vs
    return report


def main(argv: list[str] | None = None) -> int:
    """python -m kvcap.qsa.refrun [--prompt 384] [--decode 8] [--chunk 128] [--topk 16]
    [--device cpu] [--out FILE]: FP16 vs E4M3 arms of the reference-shape random model."""
    import argparse
    import json

    from kvcap.commands.common import positive_int
    from kvcap.scales.fsutil import atomic_write_text

    # (sizes below 1 were tracebacks, or --decode 0 scored every row as a decode row)
    ap = argparse.ArgumentParser(description="QSA FP16 vs calibrated E4M3 (reference shape)")
    ap.add_argument("--prompt", type=positive_int, default=384)
    ap.add_argument("--decode", type=positive_int, default=8)
    ap.add_argument("--chunk", type=positive_int, default=128)
    ap.add_argument("--topk", type=positive_int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    # Only rows with more than --topk complete groups choose (the report scores those): a
    # budget covering the whole run left none, and both arms ran before the empty selection
    # overlap raised a bare RuntimeError.
    ratio = QSAConfig().compress_ratio
    if (args.prompt + args.decode) // ratio <= args.topk:
        ap.error(f"--topk {args.topk} groups of {ratio} cover all {args.prompt + args.decode} "
                 f"tokens of --prompt + --decode: no row would choose; use --topk below "
                 f"{(args.prompt + args.decode) // ratio} or a longer --prompt")
    dev = torch.device(args.device)
    if dev.type == "cuda":
        from kvcap.attention.triton_backend import TritonBackend as Inner

        cfg = QSAConfig(indexer="trained", topk_groups=args.topk, path="triton")
        dtype = torch.float16
    else:
        from kvcap.attention.torch_ref import TorchReferenceBackend as Inner

        cfg = QSAConfig(indexer="trained", topk_groups=args.topk, path="torch")
        dtype = torch.float32
    rep = compare_kv_arms(RefShape(), cfg, args.prompt, args.decode, args.chunk, dev, Inner,
                          dtype=dtype)
    text = json.dumps(rep, indent=1)
    if args.out:
        atomic_write_text(Path(args.out), text)
    print(json.dumps(rep["layers"], indent=1))
    print(json.dumps(rep["logits"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
