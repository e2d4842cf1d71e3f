"""BlockManager invariants: accounting, prefix-cache hits, LRU eviction, no leaks."""

from __future__ import annotations

import pytest

from kvcap.engine.block_manager import BlockManager
from kvcap.engine.request import Request
from kvcap.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def run_prompt(bm: BlockManager, req: Request) -> None:
    """Admit req and 'compute' its whole prompt, as a scheduler + model would."""
    assert bm.allocate_prompt(req)
    n = req.num_tokens - req.num_computed_tokens
    assert bm.ensure_slots(req, n)
    req.num_computed_tokens += n
    bm.commit_full_blocks(req)


def check(bm: BlockManager, *reqs: Request) -> None:
    bm.check_invariants(reqs)
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_total_blocks


def test_allocate_and_free_accounting() -> None:
    bm = BlockManager(10, BS)
    a = make_req("a", range(10))
    assert bm.allocate_prompt(a)
    assert a.num_computed_tokens == 0 and a.block_ids == []
    assert bm.ensure_slots(a, 10)
    assert len(a.block_ids) == 3 and bm.num_used_blocks == 3 and bm.num_free_blocks == 7
    check(bm, a)
    a.num_computed_tokens = 10
    assert bm.ensure_slots(a, 2)  # 12 tokens still fit in 3 blocks
    assert len(a.block_ids) == 3
    assert bm.ensure_slots(a, 3)  # 13 tokens need a 4th
    assert len(a.block_ids) == 4
    check(bm, a)
    bm.free(a)
    bm.free(a)  # idempotent
    assert a.block_ids == [] and bm.num_free_blocks == 10 and bm.num_used_blocks == 0
    check(bm)


def test_ensure_slots_failure_changes_nothing() -> None:
    bm = BlockManager(3, BS)
    a = make_req("a", range(8))
    assert bm.allocate_prompt(a) and bm.ensure_slots(a, 8)
    before = list(a.block_ids)
    assert not bm.ensure_slots(a, 13)  # 13 tokens > 3 blocks
    assert a.block_ids == before and bm.num_free_blocks == 1
    check(bm, a)
    with pytest.raises(ValueError):
        bm.ensure_slots(a, -1)


def test_prefix_hit_reuses_same_blocks_after_free() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = make_req("a", prompt)
    run_prompt(bm, a)
    full = a.block_ids[:2]
    assert bm.num_cached_blocks == 2  # the partial block is never cached
    bm.free(a)
    assert bm.num_free_blocks == 16  # cached-but-unreferenced blocks count as free
    check(bm)

    b = make_req("b", prompt + [7, 8, 9])
    assert bm.allocate_prompt(b)
    assert b.block_ids == full
    assert b.num_computed_tokens == 8 and b.num_cached_prefix_tokens == 8
    assert bm.num_used_blocks == 2
    check(bm, b)


def test_prefix_hit_while_shared_and_leaves_one_token() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(12))  # exactly 3 full blocks
    a = make_req("a", prompt)
    run_prompt(bm, a)
    assert bm.num_cached_blocks == 3
    b = make_req("b", prompt)  # identical prompt: last block must be recomputed for logits
    assert bm.allocate_prompt(b)
    assert b.num_computed_tokens == 8 and b.block_ids == a.block_ids[:2]
    assert bm.ensure_slots(b, 4)
    assert b.block_ids[2] != a.block_ids[2]
    check(bm, a, b)  # shared blocks have ref count 2
    used = bm.num_used_blocks
    bm.free(a)
    assert bm.num_used_blocks == used - 1  # only a's private third block is released
    check(bm, b)
    bm.free(b)
    check(bm)
    assert bm.num_free_blocks == 16


def test_divergent_suffix_only_matches_common_blocks() -> None:
    bm = BlockManager(16, BS)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prompt(bm, a)
    bm.free(a)
    b = make_req("b", [1, 2, 3, 4, 5, 6, 7, 0, 9, 9])  # differs inside block 1
    assert bm.allocate_prompt(b)
    assert b.num_computed_tokens == 4
    c = make_req("c", [0, 2, 3, 4, 5, 6, 7, 8, 9])  # differs in block 0: chain breaks
    assert bm.allocate_prompt(c)
    assert c.num_computed_tokens == 0 and c.block_ids == []
    check(bm, b, c)


def test_generated_tokens_are_cached_too() -> None:
    bm = BlockManager(16, BS)
    a = make_req("a", [5, 6, 7])
    run_prompt(bm, a)
    for t in (8, 9, 10):  # decode three tokens
        a.output_token_ids.append(t)
        assert bm.ensure_slots(a, 1)
        a.num_computed_tokens += 1
        bm.commit_full_blocks(a)
    assert bm.num_cached_blocks == 1  # [5, 6, 7, 8]; token 10 not computed yet
    bm.free(a)
    b = make_req("b", [5, 6, 7, 8, 9, 10])
    assert bm.allocate_prompt(b) and b.num_computed_tokens == 4


def test_lru_eviction_prefers_plain_blocks_then_oldest_cached() -> None:
    bm = BlockManager(6, BS)
    a = make_req("a", list(range(8)) + [99])  # 2 full + 1 partial
    run_prompt(bm, a)
    b = make_req("b", list(range(50, 58)) + [99])
    run_prompt(bm, b)
    bm.free(a)  # a's two full blocks freed first: evicted first
    bm.free(b)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6
    c = make_req("c", list(range(200, 220)))
    assert bm.allocate_prompt(c)
    assert bm.ensure_slots(c, 12)  # 3 blocks: 2 plain + 1 evicted (a's tail block)
    assert bm.num_cached_blocks == 3
    check(bm, c)
    probe = make_req("p", list(range(8)) + [1])
    assert bm.allocate_prompt(probe) and probe.num_computed_tokens == 4  # a's head survives
    bm.free(probe)
    probe = make_req("q", list(range(50, 58)) + [1])
    assert bm.allocate_prompt(probe) and probe.num_computed_tokens == 8  # b untouched
    check(bm, c, probe)


def test_allocate_prompt_fails_without_a_free_block() -> None:
    bm = BlockManager(2, BS)
    a = make_req("a", list(range(8)))
    assert bm.allocate_prompt(a) and bm.ensure_slots(a, 8)
    b = make_req("b", [1, 2])
    assert not bm.allocate_prompt(b)
    assert b.block_ids == [] and b.num_computed_tokens == 0
    check(bm, a)
    with pytest.raises(ValueError):
        bm.allocate_prompt(a)  # already holds blocks


def test_cache_hit_on_free_block_counts_against_free_space() -> None:
    bm = BlockManager(2, BS)
    a = make_req("a", list(range(8)) + [1])  # needs 3 blocks: cannot, so compute 8 only
    assert bm.allocate_prompt(a) and bm.ensure_slots(a, 8)
    a.num_computed_tokens = 8
    bm.commit_full_blocks(a)
    bm.free(a)
    # Both free blocks are cached hits; taking them leaves nothing for the 9th token.
    b = make_req("b", list(range(8)) + [2])
    assert not bm.allocate_prompt(b)
    assert bm.num_free_blocks == 2 and bm.num_cached_blocks == 2
    check(bm)


def test_concurrent_duplicate_prefix_keeps_one_cache_entry() -> None:
    bm = BlockManager(8, BS)
    a, b = make_req("a", range(9)), make_req("b", range(9))
    assert bm.allocate_prompt(a) and bm.allocate_prompt(b)  # neither cached yet
    for r in (a, b):
        assert bm.ensure_slots(r, 9)
        r.num_computed_tokens = 9
        bm.commit_full_blocks(r)
    assert bm.num_cached_blocks == 2
    check(bm, a, b)
    bm.free(a)
    bm.free(b)
    check(bm)
    assert bm.num_free_blocks == 8


def test_prefix_caching_disabled_and_reset() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_req("a", range(9))
    run_prompt(bm, a)
    bm.free(a)
    b = make_req("b", range(9))
    assert bm.allocate_prompt(b) and b.num_computed_tokens == 0
    assert bm.num_cached_blocks == 0

    bm = BlockManager(8, BS)
    run_prompt(bm, make_req("c", range(9)))
    d = make_req("d", range(9))
    run_prompt(bm, d)
    bm.free(d)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    e = make_req("e", range(9))
    assert bm.allocate_prompt(e) and e.num_computed_tokens == 0
    bm.check_invariants()


def test_bad_construction() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_sliding_window_releases_blocks_behind_the_next_query() -> None:
    """Window 6 in blocks of 4: after 17 computed tokens the next query (position 17) sees
    12..17, so blocks 0-2 (tokens 0-11) go back to the pool -- hashed ones into the prefix
    cache, where a request with the same prefix finds them -- while block_ids only grows."""
    bm = BlockManager(10, BS, window=6)
    a = make_req("a", range(17))
    run_prompt(bm, a)
    ids = list(a.block_ids)
    assert len(ids) == 5 and bm.num_used_blocks == 5
    assert bm.release_behind(a) == 3 and a.num_released_blocks == 3
    assert a.block_ids == ids and bm.num_used_blocks == 2 and bm.num_cached_blocks == 4
    check(bm, a)
    assert bm.release_behind(a) == 0  # nothing new behind the window
    a.num_computed_tokens = 18  # one decode step later: 13..18, block 3 (12-15) still seen
    assert bm.release_behind(a) == 0
    b = make_req("b", list(range(12)) + [99, 98])  # shares the released blocks 0-2
    assert bm.allocate_prompt(b) and b.block_ids == ids[:3]
    check(bm, a, b)
    bm.free(a)
    assert a.num_released_blocks == 0 and a.block_ids == []
    bm.free(b)
    check(bm)
    assert bm.num_free_blocks == 10


def test_peak_blocks_bound_a_windowed_sequence() -> None:
    """Without a window a sequence holds all its blocks; with one, at most the window before
    a chunk plus the chunk (and one block for alignment)."""
    assert BlockManager(10, BS).peak_blocks(100, 8) == 25
    bm = BlockManager(10, BS, window=6)
    assert bm.peak_blocks(100, 8) == 5  # ceil((6 - 1 + 8) / 4) + 1
    assert bm.peak_blocks(9, 8) == 3  # a short sequence: all of it
    a = make_req("a", range(100))
    assert bm.allocate_prompt(a)
    most = 0
    while a.num_computed_tokens < a.num_tokens:  # prefill in 8-token chunks
        n = min(8, a.num_tokens - a.num_computed_tokens)
        assert bm.ensure_slots(a, n)
        most = max(most, bm.num_used_blocks)
        a.num_computed_tokens += n
        bm.commit_full_blocks(a)
        bm.release_behind(a)
        check(bm, a)
    assert most <= bm.peak_blocks(100, 8)
    with pytest.raises(ValueError, match="window"):
        BlockManager(10, BS, window=0)


def test_capacity_counts_a_released_window_only_where_every_layer_slides() -> None:
    """KVCacheSpec.released_window is the window when every layer slides over the same one (a
    full layer still reads every token), and max_concurrency then counts each sequence's peak
    blocks: 1 GiB of 8B-shaped FP16 KV (8,192 tokens in blocks of 16) runs 1 sequence of 4K
    tokens at a time (two would fill it exactly, and the scheduler keeps its admission
    watermark free), 0 of 32K, and 15 of 32K through a 500-token window, decoding (one-token
    chunks)."""
    from kvcap.kv_cache.spec import KVCacheSpec

    full = KVCacheSpec(32, 8, 128, 16, "fp16")
    mixed = KVCacheSpec(32, 8, 128, 16, "fp16", layer_windows=(500, None) * 16)
    sliding = KVCacheSpec(32, 8, 128, 16, "fp16", layer_windows=(500,) * 32)
    assert (full.released_window, mixed.released_window, sliding.released_window) == (
        None, None, 500)
    gib = 2**30
    assert full.tokens_for(gib) == 8192
    assert [full.max_concurrency(gib, c) for c in (4096, 32768)] == [1, 0]
    assert mixed.max_concurrency(gib, 32768) == 0
    assert sliding.max_concurrency(gib, 32768) == 512 // 33  # ceil(500 / 16) + 1 blocks each
    assert sliding.max_concurrency(gib, 32768, chunk=2048) == 512 // (-(-2547 // 16) + 1)


def test_prefix_digests_resist_crafted_collisions():
    """The chained key was Python's hash of (parent, token tuple): a deterministic 64-bit
    value with no collision resistance, one int standing for a whole prefix, which a prompt
    crafted offline could match. The simplest collision: hash(-1) == hash(-2) in CPython, so
    the blocks [-1] and [-2] shared a key. The digest keeps them apart and still maps equal
    tokens to equal keys."""
    bm = BlockManager(num_blocks=4, block_size=1)
    assert hash((None, (-1,))) == hash((None, (-2,)))  # what the old key did
    assert bm._hash(None, [-1]) != bm._hash(None, [-2])
    assert bm._hash(None, [5, 6]) == bm._hash(None, [5, 6])
    assert bm._hash(bm._hash(None, [1]), [2]) != bm._hash(None, [1, 2])
    assert len(bm._hash(None, [7])) == 32
