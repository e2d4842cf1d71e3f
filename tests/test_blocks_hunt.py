"""KV block management and scheduling: regressions found by a bug hunt, and a property test of
random request lifecycles (prefix hits on shared prefixes, chunked prefill, preemption, aborts
mid-step, stop-string finishes, drafts, steps scheduled ahead, sliding windows) that checks the
tokens read back through the block tables, the budget, and that every block is free with a
zero reference count at the end."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from scheduler_fakes import EOS, VOCAB, Cfg, next_token, reference_output, req

from kvcap.engine.block_manager import BlockManager
from kvcap.engine.model_runner import accept_draft
from kvcap.engine.ngram import NgramProposer
from kvcap.engine.request import RequestStatus
from kvcap.engine.scheduler import Scheduler, SchedulerOutput


def _compute(bm: BlockManager, r, n: int) -> None:
    assert bm.ensure_slots(r, n)
    r.num_computed_tokens += n
    bm.commit_full_blocks(r)


def test_reset_prefix_cache_stops_a_running_request_caching_its_later_blocks():
    """A request that ran across reset_prefix_cache (the attention mode changed mid-run) fills
    its later blocks with K/V that attended to blocks computed before the reset. They were
    registered under the request's old digest chain, so once another request recomputed the
    leading blocks after the reset, a third one hit the fresh head and then the stale tail."""
    bm = BlockManager(16, 2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    r = req("r", prompt)
    assert bm.allocate_prompt(r)
    _compute(bm, r, 4)  # blocks 0-1 before the reset
    bm.reset_prefix_cache()
    _compute(bm, r, 2)  # block 2 after it, over the old blocks 0-1
    s = req("s", prompt)  # recomputes everything after the reset
    assert bm.allocate_prompt(s) and s.num_computed_tokens == 0
    _compute(bm, s, 7)
    t = req("t", prompt)
    assert bm.allocate_prompt(t) and t.num_computed_tokens == 6
    assert t.block_ids == s.block_ids[:3]  # (was s's blocks 0-1, then r's block 2)
    for x in (r, s, t):
        bm.free(x)
    bm.check_invariants()
    assert bm.num_free_blocks == 16
    # once freed (or preempted) and admitted again, a request caches as before
    assert bm.allocate_prompt(r) and r.num_computed_tokens == 6
    _compute(bm, r, 1)
    bm.free(r)
    assert bm.num_cached_blocks == 3


def test_admission_takes_blocks_under_python_optimize():
    """`python -O` strips asserts: admission took the first chunk's blocks inside one, so the
    chunk was scheduled with an empty block table."""
    root = Path(__file__).resolve().parents[1]
    code = """
import sys
sys.path.insert(0, 'tests')
from scheduler_fakes import Cfg, req
from kvcap.engine.block_manager import BlockManager
from kvcap.engine.scheduler import Scheduler
bm = BlockManager(8, 4)
s = Scheduler(Cfg(), bm)
r = req('a', list(range(1, 10)))
s.add_request(r)
c = s.schedule().chunks[0]
print(c.num_tokens, len(r.block_ids), bm.num_used_blocks)
"""
    res = subprocess.run([sys.executable, "-O", "-c", code], cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["9", "3", "3"]


def test_blocks_needed_at_block_boundaries():
    """L = k * B tokens take k blocks; the token after them (decode) opens block k + 1 only
    when it is fed."""
    bs = 4
    bm = BlockManager(8, bs)
    s = Scheduler(Cfg(block_size=bs), bm)
    r = req("a", list(range(1, 9)), max_tokens=3)  # 2 full blocks
    s.add_request(r)
    out = s.schedule()
    assert out.chunks[0].num_tokens == 8 and len(r.block_ids) == 2
    s.update_from_output(out, {"a": 5})
    assert len(r.block_ids) == 2  # the sampled 9th token is not fed yet
    out = s.schedule()
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (8, 1) and len(r.block_ids) == 3
    assert bm.num_blocks_for(8) == 2 and bm.num_blocks_for(9) == 3


def test_latest_arrival_is_preempted_and_readmitted_first():
    """Preemption takes the newest running requests first; preempted requests wait at the front
    in arrival order and finish with the reference tokens."""
    bm = BlockManager(8, 2)
    s = Scheduler(Cfg(block_size=2, max_num_batched_tokens=64, max_model_len=64), bm)
    rs = [req(f"r{i}", [3 + i, 4, 5], max_tokens=12) for i in range(3)]
    for r in rs:
        s.add_request(r)
    model = _FakeModel(8, 2, None)
    preempted = 0
    while s.has_unfinished():
        newest_first = [r.request_id for r in reversed(s.running)]
        out = s.schedule()
        got = [r.request_id for r in out.preempted]
        assert got == newest_first[:len(got)]
        preempted += len(got)
        ids = [r.request_id for r in s.waiting]
        assert ids == sorted(ids)  # arrival order
        s.update_from_output(out, *model.execute(out))
        bm.check_invariants(s.running)
    assert preempted
    for r in rs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params,
                                                      64, _rule)
    assert bm.num_free_blocks == 8


# --- random lifecycles --------------------------------------------------------------------------
def _rule(ctx: list[int]) -> int:
    """Mostly the token 5 back (drafts are often right), else a hash of the whole context."""
    if len(ctx) >= 5 and next_token(ctx) % 3:
        return ctx[-5]
    return next_token(ctx)


class _FakeModel:
    """Writes each fed token into a fake paged cache through the block table and, at every
    sampling row, reads the context (the window's part of it) back: a stale prefix hit, a block
    reused while its owner still reads it or a wrong table changes or fails the tokens."""

    def __init__(self, num_blocks: int, block_size: int, window: int | None):
        self.bs, self.window = block_size, window
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, int], dict[str, list[int]]]:
        sampled, accepted = {}, {}
        bs = self.bs
        for c in out.chunks:
            r = c.request
            if r.is_finished:  # aborted while the step ran
                continue
            assert len(r.block_ids) * bs >= c.start + c.num_tokens
            full = r.all_token_ids[:c.start + c.num_tokens - len(c.draft)] + c.draft
            for pos in range(c.start, c.start + c.num_tokens):
                assert pos // bs >= r.num_released_blocks, "write into a released block"
                self.kv[r.block_ids[pos // bs]][pos % bs] = full[pos]
            if not c.samples:
                continue
            rows = []
            for end in range(c.start + c.num_tokens - len(c.draft), c.start + c.num_tokens + 1):
                lo = 0 if self.window is None else max(0, end - self.window)
                ctx = [self.kv[r.block_ids[p // bs]][p % bs] for p in range(lo, end)]
                assert ctx == full[lo:end], f"{r.request_id}: cache differs from the tokens"
                rows.append(_rule(full[:end]))
            if c.draft:
                accepted[r.request_id], sampled[r.request_id] = accept_draft(c.draft, rows)
            else:
                sampled[r.request_id] = rows[0]
        return sampled, accepted


def _lifecycles(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    nb = rng.choice([4, 6, 8, 12, 24, 48])
    mml = rng.choice([24, 40, 64])
    window = rng.choice([None, None, 3, 5, 8, 16])
    cfg = Cfg(max_num_seqs=rng.choice([1, 2, 3, 8]),
              max_num_batched_tokens=rng.choice([1, 2, 5, 8, 16, 48]), max_model_len=mml,
              block_size=bs)
    bm = BlockManager(nb, bs, enable_prefix_caching=rng.random() < 0.8, window=window)
    k = rng.choice([0, 0, 2, 4])
    s = Scheduler(cfg, bm, eos_token_ids={EOS}, proposer=NgramProposer(k, 3, 1) if k else None)
    model = _FakeModel(nb, bs, window)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(3)]
    added, done, cut = {}, {}, set()  # cut: aborted, stopped by a "string" or never fitting
    use_ahead = rng.random() < 0.5
    ahead = None

    def ended(r) -> None:
        done[r.request_id] = done.get(r.request_id, 0) + 1

    def abort_one() -> None:
        rid = rng.choice(list(added))
        if s.abort_request(rid):
            cut.add(rid)
            ended(added[rid])

    step = 0
    while step < 200 or s.has_unfinished() or ahead is not None:
        assert step < 20_000, "a request starved"
        if step < 200 and rng.random() < 0.3:
            shared = rng.choice(prefixes)[:rng.randrange(1, 30)] if rng.random() < 0.6 else []
            tail = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(not shared, 20))]
            params = dict(max_tokens=rng.randrange(1, 30), ignore_eos=rng.random() < 0.5)
            if rng.random() < 0.2:
                params["prompt_logprobs"] = 1  # no prefix-cache lookup
            r = req(f"r{len(added)}", (shared + tail)[:mml - 1], **params)
            added[r.request_id] = r
            s.add_request(r)
        if added and rng.random() < 0.04:
            abort_one()
        out = ahead if ahead is not None else s.schedule()
        ahead = None
        assert out.num_batched_tokens <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs
        bm.check_invariants(s.running)
        for r in out.finished_early:
            cut.add(r.request_id)
            ended(r)
            assert r.stop_reason.startswith("error: ")
        nxt = (s.schedule_ahead(out) if use_ahead and not any(c.draft for c in out.chunks)
               else None)
        if added and rng.random() < 0.02:  # while the step runs
            abort_one()
        sampled, accepted = model.execute(out)
        for r in s.update_from_output(out, sampled, accepted):
            ended(r)
        for c in out.chunks:  # a stop string found by the engine
            if c.samples and not c.request.is_finished and rng.random() < 0.01:
                s.finish_request(c.request, RequestStatus.FINISHED_STOPPED, "stop")
                cut.add(c.request.request_id)
                ended(c.request)
        bm.check_invariants(s.running)
        if nxt is not None and not all(c.request.is_finished for c in nxt.chunks):
            ahead = nxt
        step += 1
    assert done == dict.fromkeys(added, 1), "every request finishes exactly once"
    assert bm.num_free_blocks == nb and bm.num_used_blocks == 0
    assert not any(bm._ref) and not bm._req_hashes
    for rid, r in added.items():
        assert r.is_finished and not r.block_ids
        if rid not in cut:
            assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params,
                                                          mml, _rule), rid


@pytest.mark.parametrize("seed", range(40))
def test_random_lifecycles_free_every_block(seed):
    _lifecycles(seed)
