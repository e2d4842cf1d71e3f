"""QSA decode-attention benchmark (GPU): QSA vs dense at long contexts, FP16 and E4M3.

    python -m kvcap.bench.qsa [--out docs/benchmarks/qsa-DATE-GPU.json] [--batches 1,4,8,16]
        [--contexts 16384,32768,65536,131072] [--skip-checks] [--quality]

Shape: the reference (24 query heads, 4 KV heads = GQA-6, head_dim 256; trained indexer
4 heads x 128; top-512 groups of 4 = 2,051 tokens per row). One decode step of one layer:
  dense_<kv>  paged_decode over the whole context;
  qsa_<kv>    the QSABackend triton path minus the main K/V store (which dense omits too):
              side-cache update (ring + compressed row), scoring over every visible group
              (the indexer's own reads), exact top-k, sparse attention + merge;
and the QSA components alone (update / score / top-k / attention, E4M3 native). Timing: the
median of CUDA-graph replays of R calls over R rotations (distinct blocks, R x bytes >= 4 x
L2), as kvcap.bench.kernels. Checks first (GPU Triton vs torch path, identical selections).
`--quality` adds the FP16 vs calibrated E4M3 arms of the reference-shape random model at an
8K prompt with the full 2,048-token budget (kvcap.qsa.refrun, triton path); `--e2e` adds
end-to-end decode tok/s with dummy gqa6-d256 weights (E4M3), dense vs training-free QSA.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import sys
from pathlib import Path

import torch

from kvcap.bench.provenance import result_path
from kvcap.commands.common import positive_int_list
from kvcap.scales.fsutil import atomic_write_text

BLOCK_SIZE = 16
HQ, HKV, D, HI, DI = 24, 4, 256, 4, 128
TOPK = 512
KVS = [("fp16", "auto"), ("e4m3", "native"), ("e4m3", "software")]


class QSACell:
    """R rotations of B decode rows at context `ctx`: paged FP16 and E4M3 pools, side caches."""

    def __init__(self, b: int, ctx: int, l2_bytes: int, device: str = "cuda",
                 topk: int = TOPK):
        from kvcap.attention.torch_ref import TorchReferenceBackend
        from kvcap.kv_cache.pool import LayerKVCache
        from kvcap.numerics import e4m3
        from kvcap.qsa.backend import IndexInputs, QSABackend
        from kvcap.qsa.config import QSAConfig
        from kvcap.qsa.indexer import QSASideCaches, RowInfo
        from kvcap.qsa.model import Indexer, RefShape
        from kvcap.qsa.synthetic import step_meta

        dev = torch.device(device)
        self.b, self.ctx, self.topk = b, ctx, topk
        self.r = max(1, min(16, math.ceil(4 * l2_bytes / (b * ctx * HKV * D * 2))))
        nblk = math.ceil(ctx / BLOCK_SIZE)
        total = self.r * b * nblk
        g = torch.Generator(device=dev).manual_seed(b * 7 + ctx)
        shape = (total + 1, HKV, BLOCK_SIZE, D)
        self.ks, self.vs = torch.tensor(0.02, device=dev), torch.tensor(0.01, device=dev)
        self.k16 = torch.empty(shape, dtype=torch.float16, device=dev)
        self.v16 = torch.empty_like(self.k16)
        self.k8 = torch.empty(shape, dtype=torch.uint8, device=dev)
        self.v8 = torch.empty_like(self.k8)
        for lo in range(0, total + 1, 4096):
            for d16, d8, sc, amp in ((self.k16, self.k8, self.ks, 2.0),
                                     (self.v16, self.v8, self.vs, 1.0)):
                x = torch.randn(d16[lo:lo + 4096].shape, generator=g, device=dev) * amp
                d16[lo:lo + 4096] = x.half()
                d8[lo:lo + 4096] = e4m3.encode(x, sc)
        perm = torch.randperm(total, device=dev).view(self.r, b, nblk).to(torch.int32)
        cfg = QSAConfig(layer_rule="explicit", layers=(0,), indexer="trained", topk_groups=topk,
                        path="triton")
        side = QSASideCaches((0,), total, BLOCK_SIZE, 4, 1, DI, torch.float16, dev)
        sl = side.layer(0)
        sl.comp.copy_(torch.randn(sl.comp.shape, generator=g, device=dev).half())
        self.be = QSABackend(TorchReferenceBackend(), cfg, side, dev)
        self.indexer = Indexer(RefShape()).to(dev)
        self.metas = [step_meta([1] * b, [ctx] * b, perm[i].tolist(), BLOCK_SIZE, dev)
                      for i in range(self.r)]
        self.rows = [RowInfo.build(m, b) for m in self.metas]
        self.q = [torch.randn(b, HQ, D, generator=g, device=dev).half() for _ in range(self.r)]
        self.k_new = torch.randn(b, HKV, D, generator=g, device=dev).half()
        self.index = [IndexInputs(torch.randn(b, HI, DI, generator=g, device=dev).half(),
                                  torch.randn(b, DI, generator=g, device=dev).half(),
                                  self.indexer.compress) for _ in range(self.r)]
        self.out = [torch.empty(b, HQ, D, dtype=torch.float16, device=dev)
                    for _ in range(self.r)]
        self.caches = {
            "fp16": LayerKVCache(0, self.k16, self.v16, "fp16", None, None),
            "e4m3": LayerKVCache(0, self.k8, self.v8, "fp8_e4m3", self.ks, self.vs),
        }
        self.tokens = [self.be.select(self.q[i], self.k_new, self.caches["e4m3"],
                                      self.metas[i], self.index[i], self.rows[i])
                       for i in range(self.r)]

    def fns(self, arm: str, chunk: int | None = None) -> list:
        from kvcap.kernels.decode import paged_decode
        from kvcap.kernels.qsa_score import qsa_score
        from kvcap.kernels.qsa_topk import qsa_topk
        from kvcap.qsa.indexer import update_side_cache

        sc = D ** -0.5
        kind, kv, mode = arm.split("_")
        cache = self.caches[kv]
        dev = self.q[0].device
        self.be.fp8_mode = mode
        out = []
        side = self.be.side.layer(0)
        for i in range(self.r):
            m, rows, ix = self.metas[i], self.rows[i], self.index[i]
            if kind == "dense":
                out.append(functools.partial(
                    paged_decode, self.q[i], cache.k_cache, cache.v_cache, self.out[i],
                    m.block_tables, m.seq_lens, m.query_start_loc, sc, self.ctx,
                    cache.k_scale, cache.v_scale, fp8_mode=mode))
            elif kind == "qsa":
                def step(i=i, m=m, rows=rows, ix=ix):
                    tok = self.be.select(self.q[i], self.k_new, cache, m, ix, rows)
                    self.be.attend(self.q[i], cache, m, tok, sc, self.out[i], rows)
                out.append(step)
            elif kind == "update":
                out.append(functools.partial(update_side_cache, side, ix.k[:, None, :],
                                             m.slot_mapping, rows, ix.compress))
            elif kind == "score":
                vis = torch.full((self.b,), self.ctx // 4, dtype=torch.int32, device=dev)
                out.append(functools.partial(qsa_score, ix.q[:, None], side.comp, None,
                                             m.block_tables, rows.seq, vis, self.ctx // 4,
                                             "relu_sum", DI ** -0.5))
            elif kind == "topk":
                vis = torch.full((self.b,), self.ctx // 4, dtype=torch.int32, device=dev)
                scores = torch.randn(self.b, 1, self.ctx // 4, device=dev)
                pos = torch.full((self.b,), self.ctx - 1, dtype=torch.int32, device=dev)
                out.append(functools.partial(qsa_topk, scores, vis, pos, self.topk, 4,
                                             chunk=chunk))
            else:  # attention only
                out.append(functools.partial(self.be.attend, self.q[i], cache, m,
                                             self.tokens[i], sc, self.out[i], rows))
        return out


def run_checks() -> list[str]:
    """GPU Triton path vs torch path on integer data: identical selections, close outputs."""
    from kvcap.qsa.config import QSAConfig
    from kvcap.qsa.synthetic import make_backend, make_cache, make_steps, run_steps

    lines = []
    g = torch.Generator().manual_seed(0)
    for indexer, kv in (("trained", "fp8_e4m3"), ("training_free", "fp8_e4m3"),
                        ("trained", "fp16")):
        steps = make_steps([[3000, 700, 40], [1, 37, 1]], [3001, 737, 41], HQ, HKV, D, 16,
                           300, torch.float16, g, "cuda", index_heads=HI if indexer ==
                           "trained" else 0, index_dim=DI, pad_rows=2)
        res = []
        for path in ("torch", "triton"):
            cfg = QSAConfig(layer_rule="explicit", layers=(0,), topk_groups=64,
                            indexer=indexer, path=path)
            kh, kd = (1, DI) if indexer == "trained" else (HKV, D)
            be = make_backend(cfg, 300, 16, kh, kd, "cuda")
            res.append(run_steps(be, make_cache(300, HKV, 16, D, kv, "cuda"), steps, D ** -0.5))
        for s, ((o_t, t_t), (o_k, t_k)) in enumerate(zip(*res, strict=True)):
            same = torch.equal(t_t, t_k)
            err = float((o_k.float() - o_t.float()).norm() / o_t.float().norm())
            ok = same and err < 2e-2
            lines.append(f"check {indexer:13s} {kv:8s} step {s}: selections identical={same} "
                         f"rel_err={err:.2e} {'ok' if ok else 'FAIL'}")
            if not ok:
                raise SystemExit("\n".join(lines))
    return lines


def main(argv: list[str] | None = None) -> int:
    from kvcap.bench.kernels import _graph_time

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None,
                    help="a .json file, or a directory for qsa.json (-2, -3, ... when that "
                         "exists: an earlier run is never overwritten); default $OUT or .")
    ap.add_argument("--batches", type=positive_int_list, default="1,4,8,16")
    ap.add_argument("--contexts", type=positive_int_list, default="16384,32768,65536,131072")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--e2e", action="store_true",
                    help="also end-to-end decode, dummy gqa6-d256 weights, E4M3, dense vs QSA")
    ap.add_argument("--e2e-contexts", type=positive_int_list, default="16384,65536")
    ap.add_argument("--e2e-concurrency", type=positive_int_list, default="1,8")
    ap.add_argument("--topk-chunks", type=lambda t: positive_int_list(t) if t else [],
                    default="1024,4096,8192",
                    help="extra top-k-only timings with these stage-1 chunk sizes "
                         "(the default chunk is max(4k, 2048))")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from kvcap.bench.kernels import run_info

    info = run_info()
    l2 = info["l2_bytes"]
    info["shape"] = {"hq": HQ, "hkv": HKV, "head_dim": D, "index_heads": HI, "index_dim": DI,
                     "topk_groups": TOPK, "block_size": BLOCK_SIZE}
    out = result_path(Path(args.out or os.environ.get("OUT", ".")), "qsa")
    doc: dict = {"info": info, "checks": [], "cells": [], "quality": None, "e2e": None}

    def save() -> None:
        atomic_write_text(out, json.dumps(doc, indent=1))

    if not args.skip_checks:
        doc["checks"] = run_checks()
        print("\n".join(doc["checks"]), flush=True)
    save()
    arms = [f"{k}_{kv}_{m}" for k in ("dense", "qsa") for kv, m in KVS]
    parts = ["update_e4m3_native", "score_e4m3_native", "topk_e4m3_native",
             "attn_e4m3_native"]
    for b in args.batches:
        for ctx in args.contexts:
            if b * ctx * HKV * D * 4 > 40 * 2**30:
                doc["cells"].append({"batch": b, "context": ctx, "skipped": "FP16 KV > 40 GiB"})
                continue
            cell = QSACell(b, ctx, l2)
            row: dict = {"batch": b, "context": ctx, "rotations": cell.r}
            for arm in arms + parts:
                row[arm] = {"us": 1e3 * _graph_time(cell.fns(arm))}
            for c in args.topk_chunks:
                row[f"topk_chunk{c}"] = {"us": 1e3 * _graph_time(cell.fns("topk_e4m3_native",
                                                                          chunk=c))}
            for kv, m in KVS:
                d_us, q_us = row[f"dense_{kv}_{m}"]["us"], row[f"qsa_{kv}_{m}"]["us"]
                row[f"speedup_{kv}_{m}"] = d_us / q_us
            doc["cells"].append(row)
            print(f"B={b:<3d} ctx={ctx:<7d} " + " ".join(
                f"{a}={row[a]['us']:.1f}us" for a in arms + parts) + " | " + " ".join(
                f"x{row[f'speedup_{kv}_{m}']:.2f}({kv}-{m})" for kv, m in KVS), flush=True)
            save()
            del cell
            torch.cuda.empty_cache()
    if args.e2e:
        doc["e2e"] = run_e2e(args.e2e_contexts, args.e2e_concurrency, lambda: save())
    if args.quality:
        doc["quality"] = run_quality()
        print(json.dumps(doc["quality"]["layers"], indent=1))
    save()
    print(f"wrote {out}")
    return 0


def run_e2e(contexts: list[int], concurrency: list[int], checkpoint, out_tokens: int = 64,
            kv_gib: float = 48.0) -> list[dict]:
    """Decode tok/s of the dummy gqa6-d256 model (E4M3, calibrated scales) dense vs QSA
    (training-free minmax on every 4th layer, top-512). The pool is a fixed `kv_gib` so the
    QSA arm's side caches fit beside it (the planner does not count them yet)."""
    import gc

    from kvcap import LLM
    from kvcap.bench.throughput import SHAPES, calibrated_scales, run_cell
    from kvcap.qsa.config import QSAConfig
    from kvcap.qsa.enable import enable_qsa

    model = SHAPES["gqa6-d256"]
    scales = calibrated_scales(model, "float16")
    rows: list[dict] = []
    for arm in ("dense", "qsa"):
        llm = LLM(model=model, dtype="float16", kv_cache_dtype="fp8_e4m3", kv_scales=scales,
                  max_num_seqs=max(concurrency), max_model_len=max(contexts) + out_tokens,
                  max_num_batched_tokens=8192, kv_cache_memory_gib=kv_gib)
        if arm == "qsa":
            enable_qsa(llm, QSAConfig(summary="minmax", topk_groups=TOPK))
        for ctx in contexts:
            for c in concurrency:
                cell = {"arm": arm, "context": ctx, "concurrency": c}
                need = c * -(-(ctx + out_tokens) // llm.config.block_size)
                if need > llm.pool.num_blocks:
                    cell["skip"] = f"needs {need} blocks, pool has {llm.pool.num_blocks}"
                else:
                    cell.update(run_cell(llm, c, ctx + out_tokens, out_tokens, 1))
                rows.append(cell)
                print(json.dumps(cell), flush=True)
                checkpoint()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def run_quality() -> dict:
    from kvcap.attention.triton_backend import TritonBackend
    from kvcap.qsa.config import QSAConfig
    from kvcap.qsa.model import RefShape
    from kvcap.qsa.refrun import compare_kv_arms

    cfg = QSAConfig(indexer="trained", topk_groups=TOPK, path="triton")
    shape = RefShape(hidden_size=1024, num_heads=HQ, num_kv_heads=HKV, vocab_size=4096)
    rep = compare_kv_arms(shape, cfg, 8192, 32, 2048, torch.device("cuda"), TritonBackend,
                          dtype=torch.float16)
    return rep


if __name__ == "__main__":
    sys.exit(main())
