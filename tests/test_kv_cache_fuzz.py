"""Randomized invariants of the paged KV cache under the scheduler (pure Python, no model).

A fake model writes each scheduled token through the chunk's block table into `kv[block][slot]`
and samples from the context it reads back -- only the last `window` positions when every layer
slides -- so a wrong block table, a stale or overwritten prefix-cache block, a block released
while still inside the window or a bad recompute after preemption changes the tokens, which are
compared with a reference computed without any cache. Every step also checks the block
manager's ref counts against the requests' block lists (so a leak or a negative count shows at
once), the token budget and max_num_seqs, that nothing is ever written into a shared or
prefix-cached block nor read from a released one, and that the scheduler never stalls. The
workload mixes shared prefixes, chunked prefill, preemption (small pools), aborts at any point
(waiting, mid-prefill, preempted, while a step is in flight), prompt-lookup-style drafts and the
engine's look-ahead (`schedule_ahead`).
"""

from __future__ import annotations

import random

import pytest
from scheduler_fakes import EOS, VOCAB, Cfg, reference_output, req

from kvcap.engine.block_manager import BlockManager
from kvcap.engine.request import Request, RequestStatus
from kvcap.engine.scheduler import Scheduler, SchedulerOutput


def rule_for(window: int | None):
    """Next token from the position and the tokens a query sees (all, or the last `window`)."""
    def rule(ctx: list[int]) -> int:
        acc = len(ctx)
        for t in ctx if window is None else ctx[-window:]:
            acc = (acc * 31 + t + 7) % 1_000_003
        return acc % VOCAB
    return rule


class WindowedFakeModel:
    def __init__(self, bm: BlockManager, window: int | None):
        self.bm, self.bs, self.window = bm, bm.block_size, window
        self.rule = rule_for(window)
        self.kv: list[list[int | None]] = [[None] * self.bs for _ in range(bm.num_total_blocks)]

    def _block(self, r: Request, pos: int, write: bool) -> int:
        i = pos // self.bs
        assert r.num_released_blocks <= i < len(r.block_ids), (
            f"{r.request_id}: position {pos} outside the held blocks")
        b = r.block_ids[i]
        assert self.bm._ref[b] >= 1, f"{r.request_id}: block {b} is not held"
        if write:  # only the request's own, not yet hashed block may be written
            assert self.bm._ref[b] == 1, f"{r.request_id}: write into shared block {b}"
            assert self.bm._block_hash[b] is None, f"{r.request_id}: write into cached block {b}"
        return b

    def _sample(self, r: Request, tokens: list[int], end: int) -> int:
        lo = 0 if self.window is None else max(0, end - self.window)
        ctx = [self.kv[self._block(r, p, False)][p % self.bs] for p in range(lo, end)]
        assert ctx == tokens[lo:end], f"{r.request_id}: cache content differs from the tokens"
        return self.rule(tokens[:end])

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, int], dict[str, list[int]]]:
        sampled: dict[str, int] = {}
        accepted: dict[str, list[int]] = {}
        for c in out.chunks:
            r = c.request
            if r.is_finished:  # stopped or aborted after this step was planned: discarded
                continue
            tokens = r.all_token_ids + c.draft
            for pos in range(c.start, c.start + c.num_tokens):
                self.kv[self._block(r, pos, True)][pos % self.bs] = tokens[pos]
            if c.draft:  # every row samples; keep drafts while they equal the model's tokens
                rows = [self._sample(r, tokens, c.start + k + 1) for k in range(c.num_tokens)]
                kept = 0
                while kept < len(c.draft) and c.draft[kept] == rows[kept]:
                    kept += 1
                accepted[r.request_id] = c.draft[:kept]
                sampled[r.request_id] = rows[kept]
            elif c.samples:
                sampled[r.request_id] = self._sample(r, tokens, c.start + c.num_tokens)
        return sampled, accepted


class FakeProposer:
    """Drafts that are right (the reference's continuation) or wrong, at random."""

    def __init__(self, rng: random.Random, rule):
        self.rng, self.rule = rng, rule

    def propose(self, r: Request, limit: int) -> list[int]:
        toks, draft = r.all_token_ids, []
        for _ in range(self.rng.randrange(0, limit + 1)):
            t = self.rule(toks) if self.rng.random() < 0.7 else self.rng.randrange(VOCAB)
            draft.append(t)
            toks = toks + [t]
        return draft

    def forget(self, request_id: str) -> None:
        pass


def check_step(s: Scheduler, bm: BlockManager, out: SchedulerOutput) -> None:
    bm.check_invariants(s.running)
    assert out.num_batched_tokens <= s.max_num_batched_tokens
    assert len(s.running) <= s.max_num_seqs
    assert all(not r.block_ids and r.num_released_blocks == 0 for r in s.waiting)
    ids = [c.request.request_id for c in out.chunks]
    assert len(ids) == len(set(ids))
    for c in out.chunks:
        r = c.request
        if r.is_finished:  # (an ahead chunk whose request stopped on the in-flight token)
            continue
        assert r.status == RequestStatus.RUNNING and c.start == r.num_computed_tokens
        assert c.num_tokens >= 1
        assert c.samples == (c.start + c.num_tokens - len(c.draft) == r.num_tokens)


def simulate(seed: int, num_blocks: int, block_size: int, window: int | None, max_seqs: int,
             budget: int, drafts: bool, ahead: bool, prefix_caching: bool) -> None:
    rng = random.Random(seed)
    max_len = 64
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching,
                      window=window)
    cfg = Cfg(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
              block_size=block_size)
    model = WindowedFakeModel(bm, window)
    s = Scheduler(cfg, bm, eos_token_ids={EOS},
                  proposer=FakeProposer(rng, model.rule) if drafts else None)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 40))] for _ in range(3)]
    added: dict[str, Request] = {}
    done: dict[str, int] = {}
    gone: set[str] = set()  # aborted or never fitting: no reference output
    pending: SchedulerOutput | None = None  # scheduled ahead, "in flight"

    def finish(rs: list[Request]) -> None:
        for r in rs:
            done[r.request_id] = done.get(r.request_id, 0) + 1

    for step in range(5_000):
        if step >= 60 and not s.has_unfinished() and pending is None:
            break
        if step < 60 and rng.random() < 0.4:
            if added and rng.random() < 0.2:  # an earlier request's prompt, maybe + outputs
                prev = rng.choice(list(added.values()))
                prompt = prev.all_token_ids if rng.random() < 0.5 else prev.prompt_token_ids
            else:
                prompt = rng.choice(prefixes)[: rng.randrange(1, 40)] if rng.random() < 0.6 else []
                prompt = prompt + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 12))]
            prompt = list(prompt) or [1]
            r = req(f"r{len(added)}", prompt[:max_len - 1], max_tokens=rng.randrange(1, 20),
                    ignore_eos=rng.random() < 0.7)
            added[r.request_id] = r
            s.add_request(r)
        if added and rng.random() < 0.05:  # abort anything: waiting, prefilling, preempted
            rid = rng.choice(list(added))
            if s.abort_request(rid):
                gone.add(rid)
                finish([added[rid]])
                assert not added[rid].block_ids
                bm.check_invariants(s.running)
        if pending is not None:
            out, pending = pending, None
        else:
            out = s.schedule()
            assert out.chunks or out.finished_early or out.preempted or not s.has_unfinished(), (
                f"scheduler stalled: {len(s.waiting)} waiting, {len(s.running)} running, "
                f"{bm.num_free_blocks}/{bm.num_total_blocks} blocks free")
            gone.update(r.request_id for r in out.finished_early)
            finish(out.finished_early)
        check_step(s, bm, out)
        sampled, accepted = model.execute(out)
        if ahead and out.chunks and not any(c.draft for c in out.chunks):
            pending = s.schedule_ahead(out)  # planned before this step's tokens are applied
        finish(s.update_from_output(out, sampled, accepted))
        bm.check_invariants(s.running)
    else:
        raise AssertionError("simulation did not finish")
    assert done == {rid: 1 for rid in added}, "every request finishes exactly once"
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == num_blocks, "blocks leaked"
    bm.check_invariants([])
    for rid, r in added.items():
        assert r.is_finished and not r.block_ids and r.num_released_blocks == 0
        if rid not in gone:
            want = reference_output(r.prompt_token_ids, r.sampling_params, max_len, model.rule)
            assert r.output_token_ids == want, rid


@pytest.mark.parametrize("seed", range(150))
def test_scheduler_fuzz_keeps_the_cache_consistent(seed: int) -> None:
    """(hypothesis is not a dependency: a seeded draw of the configuration instead)"""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    simulate(seed, num_blocks=rng.choice([12, 16, 24, 48, 96]) // block_size, block_size=block_size,
             window=rng.choice([None, None, 1, 3, 5, 8]), max_seqs=rng.choice([1, 2, 5]),
             budget=rng.choice([1, 2, 4, 8, 16]), drafts=rng.random() < 0.5,
             ahead=rng.random() < 0.5, prefix_caching=rng.random() < 0.7)


def test_window_prefix_hit_as_long_as_the_pool_does_not_stall() -> None:
    """Window 4, a pool of 4 blocks of 4: "a" (16 tokens, one output) leaves a cached chain of
    all 4 blocks; "b" starts with those 16 tokens, needs only peak_blocks (4) of them, and must
    run -- taking a reference on every cached block only to release those behind its window at
    once left no free block for its next token, so it waited forever with nothing running."""
    bm = BlockManager(4, 4, window=4)
    s = Scheduler(Cfg(max_num_batched_tokens=4, max_model_len=64), bm)
    model = WindowedFakeModel(bm, 4)
    a = req("a", list(range(1, 17)), max_tokens=1)
    b = req("b", list(range(1, 17)) + [9, 9], max_tokens=3)
    s.add_request(a)
    for r in (None, b):
        if r is not None:
            s.add_request(r)
        for _ in range(50):
            if not s.has_unfinished():
                break
            out = s.schedule()
            assert out.chunks or out.finished_early, "scheduler stalled"
            check_step(s, bm, out)
            s.update_from_output(out, *model.execute(out))
            bm.check_invariants(s.running)
    assert a.status == RequestStatus.FINISHED_LENGTH and bm.num_cached_blocks == 4
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert b.num_cached_prefix_tokens == 16  # the whole chain was a hit
    assert b.output_token_ids == reference_output(b.prompt_token_ids, b.sampling_params, 64,
                                                  model.rule)
    assert bm.num_free_blocks == 4
    bm.check_invariants([])
