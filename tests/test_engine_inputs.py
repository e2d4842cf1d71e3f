"""The runner's incremental host inputs equal the plain per-step construction: eager metadata
(AttentionMetadata.build) and the CUDA-graph static buffers (checked on CPU, without capture)."""

from __future__ import annotations

import random

import torch

from kvcap.attention.metadata import AttentionMetadata
from kvcap.engine.cuda_graph import DecodeGraphs
from kvcap.engine.input_batch import BlockTableRows, EagerInputs
from kvcap.engine.model_runner import StepPlan

BS = 4


def _plan(seqs) -> StepPlan:
    """seqs: (block ids list, start, num_tokens) per sequence."""
    plan = StepPlan()
    for table, start, n in seqs:
        plan.ids.extend(range(100 + start, 100 + start + n))
        plan.positions.extend(range(start, start + n))
        plan.query_lens.append(n)
        plan.seq_lens.append(start + n)
        plan.tables.append(table)
    return plan


def _grow(rng, tables, lens):
    """Advance each sequence by 1..5 tokens, appending blocks in place (as the engine does);
    sometimes replace a list (preemption) or start a new sequence."""
    for i in range(len(tables)):
        r = rng.random()
        if r < 0.1:
            lens[i] = rng.randint(1, 12)
            tables[i] = rng.sample(range(1, 500), -(-lens[i] // BS))
            continue
        lens[i] += rng.randint(1, 5)
        while len(tables[i]) * BS < lens[i]:
            tables[i].append(rng.randint(1, 499))
    if rng.random() < 0.3 and len(tables) > 1:
        k = rng.randrange(len(tables))
        del tables[k], lens[k]
    if rng.random() < 0.3:
        lens.append(rng.randint(1, 20))
        tables.append(rng.sample(range(1, 500), -(-lens[-1] // BS)))


def test_eager_inputs_match_metadata_build():
    rng = random.Random(0)
    inputs = EagerInputs(torch.device("cpu"), BS)
    inputs.rows = BlockTableRows(pad=-1, num_rows=4, width=2)  # exercise recycling and growth
    tables, lens = [[1]], [3]
    for _ in range(60):
        _grow(rng, tables, lens)
        seqs = []
        for t, n in zip(tables, lens, strict=True):
            q = rng.choice([1, 1, 1, min(n, 3), n])
            seqs.append((t, n - q, q))
        plan = _plan(seqs)
        ids, pos, meta = inputs.build(plan)
        ref = AttentionMetadata.build(plan.query_lens, plan.seq_lens, plan.tables, BS,
                                      torch.device("cpu"))
        assert ids.tolist() == plan.ids and pos.tolist() == plan.positions
        for f in ("query_start_loc", "seq_lens", "context_lens", "slot_mapping"):
            a, b = getattr(meta, f), getattr(ref, f)
            assert a.dtype == b.dtype and torch.equal(a, b), f
        # the same tables, padded with -1 to a multiple of 16 columns (one Triton variant)
        a, b = meta.block_tables, ref.block_tables
        w = b.shape[1]
        assert a.dtype == b.dtype and a.shape[1] % 16 == 0 and w <= a.shape[1] < w + 16
        assert torch.equal(a[:, :w], b) and bool((a[:, w:] == -1).all())
        for f in ("query_start_loc_cpu", "seq_lens_cpu", "max_query_len", "max_seq_len",
                  "block_size"):
            assert getattr(meta, f) == getattr(ref, f), f


class _Pool:
    null_block = 0

    class spec:  # noqa: N801
        block_size = BS


def _reference_graph_inputs(g, input_ids, positions, tables):
    """What DecodeGraphs.prepare wrote before it became incremental."""
    b = len(input_ids)
    bucket = next(s for s in g.buckets if s >= b)
    width = max(len(t) for t in tables)
    null, pad = 0, bucket - b
    slots = [t[p // BS] * BS + p % BS for t, p in zip(tables, positions, strict=True)]
    table = [t + [null] * (width - len(t)) for t in tables] + [[null] * width] * pad
    return (bucket, input_ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad,
            [p + 1 for p in positions] + [1] * pad, table, width)


def test_graph_inputs_match_plain_construction():
    rng = random.Random(1)
    g = DecodeGraphs(None, None, _Pool(), torch.device("cpu"), max_num_seqs=24,
                     max_model_len=512)
    tables, lens = [[1, 2]], [6]
    for _ in range(60):
        _grow(rng, tables, lens)
        tables, lens = tables[:24], lens[:24]
        positions = [n - 1 for n in lens]
        ids = [rng.randrange(1000) for _ in lens]
        bucket, ctx_class = g.prepare(ids, positions, tables)
        rb, rids, rpos, rslots, rseq, rtable, width = _reference_graph_inputs(
            g, ids, positions, tables)
        assert bucket == rb and ctx_class == g.context_class(max(lens))
        assert g.input_ids[:bucket].tolist() == rids
        assert g.positions[:bucket].tolist() == rpos
        assert g.slot_mapping[:bucket].tolist() == rslots
        assert g.seq_lens[:bucket].tolist() == rseq
        assert g.block_tables[:bucket, :width].tolist() == rtable
        assert (g.block_tables[:bucket, width:] == 0).all()
