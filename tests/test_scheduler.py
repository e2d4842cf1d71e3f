"""Scheduler invariants against a fake model that reads its context back from a fake paged cache.

The fake model writes each scheduled token into `kv[block][slot]` through the chunk's block table
and, when a chunk samples, reads the whole context back through the block table and returns a
deterministic function of it. Wrong block tables, stale prefix-cache blocks or a bad recompute
after preemption therefore change the generated tokens, which the tests compare against a
reference computed without any cache.
"""

from __future__ import annotations

import random

import pytest
from scheduler_fakes import EOS, VOCAB, Cfg, next_token, reference_output, req

from kvcap.engine.block_manager import BlockManager
from kvcap.engine.request import Request, RequestStatus
from kvcap.engine.scheduler import Scheduler, SchedulerOutput
from kvcap.errors import ConfigError
from kvcap.sampling_params import SamplingParams


class FakeModel:
    def __init__(self, num_blocks: int, block_size: int):
        self.bs = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        for c in out.chunks:
            req, bs = c.request, self.bs
            assert len(req.block_ids) * bs >= c.start + c.num_tokens
            for pos in range(c.start, c.start + c.num_tokens):
                self.kv[req.block_ids[pos // bs]][pos % bs] = req.all_token_ids[pos]
            if c.samples:
                end = c.start + c.num_tokens
                ctx = [self.kv[req.block_ids[p // bs]][p % bs] for p in range(end)]
                assert ctx == req.all_token_ids[:end], "cache content differs from the tokens"
                sampled[req.request_id] = next_token(ctx)
        return sampled


def make(num_blocks: int = 64, **kw: int) -> tuple[Scheduler, BlockManager, FakeModel]:
    cfg = Cfg(**kw)
    bm = BlockManager(num_blocks, cfg.block_size)
    return Scheduler(cfg, bm, eos_token_ids={EOS}), bm, FakeModel(num_blocks, cfg.block_size)


def check_step(s: Scheduler, bm: BlockManager, out: SchedulerOutput) -> None:
    bm.check_invariants(s.running)
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_total_blocks
    assert out.num_batched_tokens <= s.max_num_batched_tokens
    assert len(s.running) <= s.max_num_seqs
    assert all(not r.block_ids for r in s.waiting)
    ids = [c.request.request_id for c in out.chunks]
    assert len(ids) == len(set(ids))
    for c in out.chunks:
        r = c.request
        assert r.status == RequestStatus.RUNNING and c.start == r.num_computed_tokens
        assert c.num_tokens >= 1 and c.samples == (c.start + c.num_tokens == r.num_tokens)


def run_all(s: Scheduler, bm: BlockManager, model: FakeModel, max_steps: int = 10_000
            ) -> tuple[list[Request], list[SchedulerOutput]]:
    finished, outs = [], []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return finished, outs
        out = s.schedule()
        check_step(s, bm, out)
        finished += out.finished_early
        finished += s.update_from_output(out, model.execute(out))
        bm.check_invariants(s.running)
        outs.append(out)
    raise AssertionError("scheduler did not finish")


def test_simple_batch_matches_reference_and_frees_everything() -> None:
    s, bm, model = make()
    prompts = {f"r{i}": [random.Random(i).randrange(1, VOCAB) for _ in range(3 + 5 * i)]
               for i in range(5)}
    for rid, p in prompts.items():
        s.add_request(req(rid, p, max_tokens=6))
    finished, _ = run_all(s, bm, model)
    assert sorted(r.request_id for r in finished) == sorted(prompts)
    for r in finished:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params, 256)
    assert bm.num_used_blocks == 0 and s.num_running == 0 and s.num_waiting == 0


def test_chunked_prefill_respects_budget_and_samples_on_last_chunk() -> None:
    s, bm, model = make(max_num_batched_tokens=32)
    s.add_request(req("long", list(range(1, 101)), max_tokens=3))
    chunks = []
    for _ in range(4):
        out = s.schedule()
        check_step(s, bm, out)
        chunks.append((out.chunks[0].start, out.chunks[0].num_tokens, out.chunks[0].samples))
        s.update_from_output(out, model.execute(out))
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    # A decode and a new prompt share the next step's budget; decode comes first.
    s.add_request(req("new", list(range(2, 61)), max_tokens=2))  # no prefix hit
    out = s.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("long", 1), ("new", 31)]
    assert not out.chunks[1].samples


def test_max_num_seqs_limits_running() -> None:
    s, bm, model = make(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(5):
        s.add_request(req(f"r{i}", [1, 2, 3], max_tokens=4))
    out = s.schedule()
    assert len(out.chunks) == 2 and s.num_running == 2 and s.num_waiting == 3
    s.update_from_output(out, model.execute(out))
    finished, outs = run_all(s, bm, model)
    assert all(len(o.chunks) <= 2 for o in outs) and len(finished) == 5


def test_preemption_by_recompute_keeps_outputs_and_leaks_nothing() -> None:
    # 12 blocks * 4 = 48 slots for 4 requests that each grow to 6 + 20 = 26 tokens.
    s, bm, model = make(num_blocks=12, max_num_batched_tokens=64)
    for i in range(4):
        s.add_request(req(f"r{i}", [i + 1] * 6, max_tokens=20))
    finished, outs = run_all(s, bm, model)
    preempted = [r.request_id for o in outs for r in o.preempted]
    assert preempted, "the pool was meant to run out"
    assert len(finished) == 4
    for r in finished:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params, 256)
    assert max(r.num_preemptions for r in finished) >= 1
    assert bm.num_used_blocks == 0


def test_preempted_request_goes_to_front_and_newest_is_victim() -> None:
    # 6 blocks of 4: both prompts (2 blocks each) are admitted with the watermark to spare,
    # then their generations outgrow the pool and the newest running request is the victim.
    s, bm, model = make(num_blocks=6, max_num_batched_tokens=64)
    s.add_request(req("old", [1] * 7, max_tokens=30))
    s.add_request(req("new", [2] * 7, max_tokens=30))
    s.add_request(req("later", [3] * 3, max_tokens=30))
    victims: list[str] = []
    for _ in range(12):
        out = s.schedule()
        check_step(s, bm, out)
        victims += [r.request_id for r in out.preempted]
        s.update_from_output(out, model.execute(out))
    assert victims and victims[0] == "new"
    assert s.waiting[0].request_id == "new" and s.waiting[0].status == RequestStatus.PREEMPTED
    assert s.waiting[0].num_computed_tokens == 0


def test_prefix_hit_through_scheduler() -> None:
    s, bm, model = make()
    shared = list(range(1, 21))  # 5 full blocks
    s.add_request(req("a", shared + [30], max_tokens=2))
    run_all(s, bm, model)
    s.add_request(req("b", shared + [31, 32], max_tokens=2))
    out = s.schedule()
    b = out.chunks[0].request
    assert b.num_cached_prefix_tokens == 20 and out.chunks[0].start == 20
    assert out.chunks[0].num_tokens == 2
    s.update_from_output(out, model.execute(out))
    finished, _ = run_all(s, bm, model)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, b.sampling_params, 256)
    # A request asking for prompt logprobs needs every prompt row: no prefix-cache skip.
    s.add_request(req("c", shared + [31, 32], max_tokens=2, prompt_logprobs=1))
    out = s.schedule()
    assert out.chunks[0].start == 0 and out.chunks[0].request.num_cached_prefix_tokens == 0


def test_abort_waiting_and_running_frees_blocks() -> None:
    s, bm, model = make(max_num_seqs=1)
    s.add_request(req("run", list(range(1, 50)), max_tokens=10))
    s.add_request(req("wait", [1, 2, 3], max_tokens=10))
    out = s.schedule()
    s.update_from_output(out, model.execute(out))
    assert bm.num_used_blocks > 0
    assert s.abort_request("wait") and s.abort_request("run")
    assert not s.abort_request("run") and not s.abort_request("nope")
    assert bm.num_used_blocks == 0 and not s.has_unfinished()
    bm.check_invariants([])
    # Aborted while the step ran (after execute, before the update): the chunk is ignored.
    s.add_request(req("x", [1, 2, 3], max_tokens=10))
    out = s.schedule()
    sampled = model.execute(out)
    s.abort_request("x")
    assert s.update_from_output(out, sampled) == []
    assert out.chunks[0].request.status == RequestStatus.FINISHED_ABORTED


def test_never_fits_finishes_with_error() -> None:
    s, bm, model = make(num_blocks=4)  # 16 slots
    s.add_request(req("huge", list(range(1, 30)), max_tokens=2))
    s.add_request(req("grows", list(range(1, 11)), max_tokens=50))
    finished, _ = run_all(s, bm, model)
    by_id = {r.request_id: r for r in finished}
    assert len(finished) == 2
    for r in by_id.values():
        assert r.status == RequestStatus.FINISHED_ABORTED
        assert isinstance(r.stop_reason, str) and r.stop_reason.startswith("error:")
    assert by_id["grows"].num_tokens == 17  # 16 slots computed + the last sampled token
    assert bm.num_used_blocks == 0


def test_stop_conditions() -> None:
    s, bm, model = make(max_model_len=12)
    prompt = [5, 6, 7]
    ref = reference_output(prompt, SamplingParams(max_tokens=9, ignore_eos=True), 1000)
    s.add_request(req("stoptok", prompt, max_tokens=9, stop_token_ids=[ref[2]]))
    s.add_request(req("eos", prompt, max_tokens=9, ignore_eos=False))
    s.add_request(req("len", [1] * 8, max_tokens=100))
    s.eos_token_ids = {ref[1]}
    finished, _ = run_all(s, bm, model)
    by_id = {r.request_id: r for r in finished}
    assert by_id["stoptok"].output_token_ids == ref[:3]
    assert by_id["stoptok"].stop_reason == ref[2]
    assert by_id["eos"].output_token_ids == ref[:2]
    assert by_id["eos"].status == RequestStatus.FINISHED_STOPPED
    assert by_id["len"].status == RequestStatus.FINISHED_LENGTH and by_id["len"].num_tokens == 12


def test_finish_request_for_stop_strings() -> None:
    s, bm, model = make()
    s.add_request(req("a", [1, 2, 3], max_tokens=10))
    out = s.schedule()
    s.update_from_output(out, model.execute(out))
    r = out.chunks[0].request
    s.finish_request(r, RequestStatus.FINISHED_STOPPED, "stop-string")
    assert r.stop_reason == "stop-string" and bm.num_used_blocks == 0 and not s.has_unfinished()
    with pytest.raises(ValueError):
        s.finish_request(r, RequestStatus.RUNNING)


def test_bad_input() -> None:
    s, _, _ = make(max_model_len=10)
    with pytest.raises(ConfigError):
        s.add_request(req("long", list(range(11))))
    with pytest.raises(ConfigError):
        s.add_request(req("empty", []))
    s.add_request(req("a", [1]))
    with pytest.raises(ValueError):
        s.add_request(req("a", [1]))
    with pytest.raises(ConfigError):
        Scheduler(Cfg(max_model_len=None), BlockManager(4, 4))
    with pytest.raises(ConfigError):
        Scheduler(Cfg(block_size=8), BlockManager(4, 4))


@pytest.mark.parametrize("seed", range(6))
def test_randomized_simulation(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = rng.choice([8, 12, 24, 48])
    s, bm, model = make(num_blocks=num_blocks, max_num_seqs=rng.choice([1, 3, 8]),
                        max_num_batched_tokens=rng.choice([8, 16, 48]), max_model_len=64)
    s.eos_token_ids = {EOS}
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    added: dict[str, Request] = {}
    done: dict[str, int] = {}
    errored: set[str] = set()
    aborted: set[str] = set()
    step = 0
    while step < 400 or s.has_unfinished():
        assert step < 20_000, "simulation did not finish"
        if step < 400 and rng.random() < 0.3:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 24)] if rng.random() < 0.5 else []
            prompt = prompt + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
            rid = f"r{len(added)}"
            r = req(rid, prompt[:60], max_tokens=rng.randrange(1, 25),
                    ignore_eos=rng.random() < 0.5)
            added[rid] = r
            s.add_request(r)
        if added and rng.random() < 0.05:
            rid = rng.choice(list(added))
            if s.abort_request(rid):
                aborted.add(rid)
                done[rid] = done.get(rid, 0) + 1
        out = s.schedule()
        check_step(s, bm, out)
        for r in out.finished_early:
            errored.add(r.request_id)
            done[r.request_id] = done.get(r.request_id, 0) + 1
        for r in s.update_from_output(out, model.execute(out)):
            done[r.request_id] = done.get(r.request_id, 0) + 1
        bm.check_invariants(s.running)
        step += 1
    assert done == {rid: 1 for rid in added}, "every request finishes exactly once"
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == num_blocks
    for rid, r in added.items():
        assert r.is_finished and not r.block_ids
        if rid in aborted or rid in errored:
            continue
        ref = reference_output(r.prompt_token_ids, r.sampling_params, 64)
        assert r.output_token_ids == ref, rid


def test_admission_keeps_a_watermark_while_others_run() -> None:
    """A new prompt that would leave less than the watermark free waits while others run (no
    prefill that the running decodes would soon preempt); alone, a request may take the pool."""
    s, bm, model = make(num_blocks=8, max_num_batched_tokens=64)
    s.add_request(req("a", [1] * 12, max_tokens=3))  # 3 of the 8 blocks
    s.add_request(req("b", [2] * 17, max_tokens=3))  # 5 blocks: would leave 0 < watermark 1
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["a"]
    assert bm.num_used_blocks == 3 and s.waiting[0].request_id == "b"
    assert s.waiting[0].block_ids == [] and s.waiting[0].num_computed_tokens == 0
    finished, outs = run_all(s, bm, model)
    assert [r.request_id for r in finished] == ["a", "b"]
    assert not any(o.preempted for o in outs)
    big = req("big", [3] * 31, max_tokens=1)  # 8 blocks: the whole pool, nothing running
    s.add_request(big)
    finished, _ = run_all(s, bm, model)
    assert finished[0].request_id == "big" and bm.num_used_blocks == 0


def test_watermark_cuts_preemption_churn(monkeypatch) -> None:
    """Many requests on a small pool: every output still equals the reference, with less than
    half the preemptions of admission without the watermark (measured: 6 vs 14)."""
    def run() -> int:
        s, bm, model = make(num_blocks=24, max_num_batched_tokens=32)
        for i in range(12):
            s.add_request(req(f"r{i}", [i + 1] * (9 + i % 5), max_tokens=20))
        finished, outs = run_all(s, bm, model)
        assert len(finished) == 12 and bm.num_used_blocks == 0
        for r in finished:
            assert r.output_token_ids == reference_output(r.prompt_token_ids,
                                                          r.sampling_params, 256)
        return sum(len(o.preempted) for o in outs)

    with_watermark = run()
    monkeypatch.setattr(Scheduler, "_leaves_headroom", lambda self, r, use_cache: True)
    assert with_watermark * 2 < run()


def run_all_ahead(s: Scheduler, bm: BlockManager, model: FakeModel, max_steps: int = 10_000
                  ) -> tuple[list[Request], int]:
    """The engine's overlap on the fake model: plan the next step (`schedule_ahead`) before
    applying this one's tokens; the fake model runs an ahead step once they are applied, which
    is what the device-side feed achieves."""
    finished, ahead, n_ahead = [], None, 0
    for _ in range(max_steps):
        if ahead is None and not s.has_unfinished():
            return finished, n_ahead
        out = ahead if ahead is not None else s.schedule()
        ahead = None
        live = [c for c in out.chunks if not c.request.is_finished]
        sampled = model.execute(SchedulerOutput(chunks=live))
        ahead = s.schedule_ahead(out)
        if ahead is not None:
            n_ahead += 1
            assert all(c.ahead and c.num_tokens == 1 and c.samples for c in ahead.chunks)
        finished += out.finished_early
        finished += s.update_from_output(out, sampled)
        bm.check_invariants(s.running)
        if ahead is not None and all(c.request.is_finished for c in ahead.chunks):
            ahead = None
    raise AssertionError("scheduler did not finish")


def test_schedule_ahead_gives_the_serial_outputs_and_frees_everything() -> None:
    """Stop tokens, EOS, max_tokens and max_model_len end requests on a token the ahead step
    already ran past; new blocks are taken ahead (block size 4); tokens equal the reference."""
    s, bm, model = make(num_blocks=48, max_model_len=40)
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(1, VOCAB) for _ in range(2 + 3 * i)] for i in range(6)}
    params = [dict(max_tokens=9), dict(max_tokens=30), dict(ignore_eos=False, max_tokens=40),
              dict(stop_token_ids=[5, 11], max_tokens=40), dict(max_tokens=1),
              dict(max_tokens=64)]
    for (rid, p), kw in zip(prompts.items(), params, strict=True):
        s.add_request(req(rid, p, **kw))
    finished, n_ahead = run_all_ahead(s, bm, model)
    assert n_ahead > 10
    assert sorted(r.request_id for r in finished) == sorted(prompts)
    for r in finished:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params, 40)
    assert bm.num_used_blocks == 0 and s.num_running == 0


def test_schedule_ahead_declines_what_needs_the_tokens_or_a_decision() -> None:
    s, bm, model = make(num_blocks=8, max_num_seqs=2)
    s.add_request(req("a", [1, 2, 3], max_tokens=20))
    out = s.schedule()
    assert s.schedule_ahead(out) is not None  # (the last prompt chunk samples: ahead is fine)
    s2, bm2, _ = make(num_blocks=8, max_num_batched_tokens=2)
    s2.add_request(req("b", [1, 2, 3, 4, 5], max_tokens=20))
    assert s2.schedule_ahead(s2.schedule()) is None  # mid-prompt chunk: nothing sampled
    s.update_from_output(out, model.execute(out))
    s.add_request(req("c", [4, 5], max_tokens=20))  # admissible: the regular schedule admits
    out = s.schedule()
    s.update_from_output(out, model.execute(out))
    s.add_request(req("d", [6], max_tokens=20))  # max_num_seqs reached: may run ahead
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["a", "c"]
    ahead = s.schedule_ahead(out)
    assert ahead is not None and [c.request.request_id for c in ahead.chunks] == ["a", "c"]
    assert [c.start for c in ahead.chunks] == [c.start + 1 for c in out.chunks]
    s.update_from_output(out, model.execute(out))
    # no free block for a request that needs one: declined (no preemption ahead)
    s3, bm3, model3 = make(num_blocks=2)
    s3.add_request(req("e", [1, 2, 3, 4, 5, 6, 7], max_tokens=20))
    out = s3.schedule()
    s3.update_from_output(out, model3.execute(out))
    out = s3.schedule()  # decodes position 7, the last slot of block 2
    assert bm3.num_free_blocks == 0 and s3.schedule_ahead(out) is None
    # a request that surely ends by length on the in-flight token is left out
    s4, _, model4 = make()
    s4.add_request(req("f", [1, 2], max_tokens=2))
    s4.add_request(req("g", [3, 4], max_tokens=5))
    out = s4.schedule()
    s4.update_from_output(out, model4.execute(out))
    out = s4.schedule()
    ahead = s4.schedule_ahead(out)
    assert [c.request.request_id for c in ahead.chunks] == ["g"]
