"""Paged KV-cache bookkeeping: free list, reference counts and prefix caching. Pure Python.

The pool holds `num_blocks` physical blocks of `block_size` token slots. A request owns the
blocks listed in `req.block_ids` (in token order); block `i` holds the K/V of tokens
`[i * block_size, (i + 1) * block_size)`.

Prefix caching (FULL blocks only). A block whose `block_size` tokens all have their K/V written
gets a chained digest, BLAKE2b-256 of (parent digest, the block's token ids as int64) (parent =
the previous block's digest, none for the first block), registered by `commit_full_blocks`. A
later request whose token prefix chains to the same digests shares those blocks (ref count + 1)
instead of recomputing them. When the last reference is dropped a hashed block stays in the
cache, unreferenced; it counts as free and is evicted (least recently freed first) only when
the free list needs it. Unhashed free blocks are always handed out before any cached block is
evicted. The digest is cryptographic on purpose: Python's hash of an int tuple (what this used)
is deterministic and not collision resistant, so a crafted prompt could chain to another
request's digests and be served that request's K/V (vLLM's CVE-2025-25183); the same tokens
still map to the same blocks.

API (what the scheduler calls):
    num_free_blocks / num_used_blocks / num_total_blocks   free + used == total, always
    allocate_prompt(req, use_prefix_cache=True) -> bool
                                        admission: prefix-cache lookup, take refs, set
                                        req.num_computed_tokens = req.num_cached_prefix_tokens
    ensure_slots(req, n) -> bool        cover num_computed_tokens + n tokens with blocks
    commit_full_blocks(req)             hash blocks that became full of computed tokens
    free(req)                           drop req's references; idempotent
    num_blocks_for(num_tokens) -> int   blocks needed to hold that many tokens
    peak_blocks(num_tokens, chunk) -> int   the most a sequence ever holds at once
    release_behind(req)                 sliding window: hand back blocks no query sees again
    reset_prefix_cache()                forget every hash (e.g. after KV scales change)
    check_invariants(requests=None)     internal consistency, for tests
Every method that returns False has changed nothing.

Sliding windows (`window`: every layer of the model attends to at most its last `window`
tokens). The next query of a request sits at position p = num_computed_tokens and sees
p - window + 1 .. p; later queries see less. So after every step the blocks wholly before that
position are released (`release_behind`): dropped like `free` drops them (a hashed one stays
in the prefix cache), but left in `req.block_ids` -- which only ever grows by append, as the
step inputs' block-table mirror expects -- with `req.num_released_blocks` counting them. The
attention kernels never read a position outside a query's window (nor its block-table entry's
block), so a released block may be reused by another request at once. A sequence then holds at
most `peak_blocks` blocks, whatever its length.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvcap.kv_cache.spec import peak_blocks

if TYPE_CHECKING:
    from kvcap.engine.request import Request

logger = logging.getLogger(__name__)

BlockHash = bytes  # a 32-byte digest


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 token, got {window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self._num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._cache: dict[BlockHash, int] = {}  # hash -> block holding those tokens
        # Free blocks: unhashed ones (handed out first) and cached ones in LRU order.
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() from the end
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # Chained hashes of each request's leading full blocks (request_id -> hashes; None for
        # a request that ran across reset_prefix_cache: it caches nothing more).
        self._req_hashes: dict[str, list[BlockHash] | None] = {}
        # The chained hashes _lookup_prefix computed for a waiting request (request_id ->
        # (request, hashes of its leading full blocks)): a prompt waiting for blocks is looked
        # up twice a step, and re-hashing a 128K-token cached prefix took ~12 ms each time, a
        # stall of every decode step beside it. Its tokens only grow, so the hashes stay valid;
        # dropped when it is admitted or freed (finished, aborted).
        self._wait_hashes: dict[str, tuple[Request, list[BlockHash]]] = {}

    # ----------------------------------------------------------------- counts
    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cache)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of `num_tokens` tokens, computed in chunks of at most
        `chunk`, holds at once: all of them, or with a window the blocks of a chunk and the
        window before its first token (one more for alignment)."""
        return peak_blocks(num_tokens, self.block_size, self.window, chunk)

    # ----------------------------------------------------------------- hashing
    def _hash(self, parent: BlockHash | None, tokens: list[int]) -> BlockHash:
        digest = hashlib.blake2b(parent or b"", digest_size=32)
        digest.update(array("q", tokens).tobytes())
        return digest.digest()

    def _lookup_prefix(self, req: Request) -> tuple[list[int], list[BlockHash]]:
        """Cached blocks (and their hashes) for the longest prefix, leaving >= 1 token."""
        if not self.enable_prefix_caching:
            return [], []
        tokens = req.all_token_ids
        bs = self.block_size
        memo = self._wait_hashes.get(req.request_id)
        if memo is None or memo[0] is not req:
            memo = self._wait_hashes[req.request_id] = (req, [])
        known = memo[1]
        blocks: list[int] = []
        for i in range((len(tokens) - 1) // bs):
            if i == len(known):
                known.append(self._hash(known[-1] if known else None,
                                        tokens[i * bs:(i + 1) * bs]))
            block = self._cache.get(known[i])
            if block is None:
                break
            blocks.append(block)
        return blocks, known[:len(blocks)]

    # ----------------------------------------------------------------- allocation
    def _take_free(self) -> int:
        if self._free_plain:
            block = self._free_plain.pop()
        else:
            block, _ = self._free_cached.popitem(last=False)  # evict least recently freed
            h = self._block_hash[block]
            assert h is not None and self._cache.get(h) == block
            del self._cache[h]
            self._block_hash[block] = None
        assert self._ref[block] == 0
        self._ref[block] = 1
        return block

    def _on_free_list(self, blocks: list[int]) -> int:
        """How many of these cached blocks sit on the free list (no request holds them)."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    def blocks_to_admit(self, req: Request, use_prefix_cache: bool = True,
                        chunk: int | None = None) -> int:
        """Free blocks that admitting `req` for its whole prompt would consume: its cached
        prefix blocks now on the free list plus new blocks for the rest (with a window, at most
        the peak_blocks of chunks of `chunk` tokens). Changes nothing."""
        blocks, _ = self._lookup_prefix(req) if use_prefix_cache else ([], [])
        need = self._on_free_list(blocks) + self.num_blocks_for(req.num_tokens) - len(blocks)
        if self.window is not None and chunk is not None:
            need = min(need, self.peak_blocks(req.num_tokens, chunk))
        return need

    def allocate_prompt(self, req: Request, use_prefix_cache: bool = True) -> bool:
        """Admit `req`: share its longest cached prefix and check one more block is free.

        `use_prefix_cache=False` (e.g. prompt logprobs wanted) computes the whole sequence.

        Sets `req.num_computed_tokens` and `req.num_cached_prefix_tokens` to the cached length
        (a multiple of block_size, always < req.num_tokens); with a window, the cached blocks
        behind the first query's window are listed but not taken (`num_released_blocks`).
        Returns False, changing nothing, if after taking the cached blocks no free block would
        remain for the next token.
        """
        if req.block_ids:
            raise ValueError(f"request {req.request_id} already holds blocks")
        if req.num_tokens < 1:
            raise ValueError(f"request {req.request_id} has no tokens")
        blocks, hashes = self._lookup_prefix(req) if use_prefix_cache else ([], [])
        cached = len(blocks) * self.block_size
        # With a window, the cached blocks wholly behind the first query's are listed as
        # released without being taken: taking them only for release_behind to hand them back
        # needed them all free at once, and a cached chain as long as the pool then left no
        # block for the next token -- the request waited forever with nothing running.
        behind = self._num_behind(cached, len(blocks))
        if self.num_free_blocks - self._on_free_list(blocks[behind:]) < 1:
            return False
        for block in blocks[behind:]:
            if self._ref[block] == 0:
                del self._free_cached[block]
            self._ref[block] += 1
        req.block_ids = list(blocks)
        req.num_released_blocks = behind
        self._req_hashes[req.request_id] = hashes
        self._wait_hashes.pop(req.request_id, None)
        req.num_computed_tokens = cached
        req.num_cached_prefix_tokens = cached
        if blocks:
            logger.debug("prefix hit: request %s reuses %d blocks (%d tokens)",
                         req.request_id, len(blocks), cached)
        return True

    def ensure_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make req.block_ids cover num_computed_tokens + num_new_tokens tokens."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        need = self.num_blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            req.block_ids.append(self._take_free())
        return True

    def commit_full_blocks(self, req: Request) -> None:
        """Register hashes of req's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = self._req_hashes.setdefault(req.request_id, [])
        if hashes is None:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if num_full <= len(hashes):
            return
        bs = self.block_size
        for i in range(len(hashes), num_full):
            h = self._hash(hashes[-1] if hashes else None, req.token_slice(i * bs, (i + 1) * bs))
            hashes.append(h)
            block = req.block_ids[i]
            # Another request may have computed the same tokens first: keep its block cached.
            if h not in self._cache and self._block_hash[block] is None:
                self._cache[h] = block
                self._block_hash[block] = h

    def _drop(self, block: int) -> None:
        assert self._ref[block] > 0, f"double free of block {block}"
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if self._block_hash[block] is None:
                self._free_plain.append(block)
            else:
                self._free_cached[block] = None

    def free(self, req: Request) -> None:
        """Drop req's references; hashed blocks stay cached. Clears req.block_ids."""
        # Reverse order: a chain's tail is evicted before its head, which keeps heads reusable.
        for block in reversed(req.block_ids[req.num_released_blocks:]):
            self._drop(block)
        req.block_ids = []
        req.num_released_blocks = 0
        self._req_hashes.pop(req.request_id, None)
        self._wait_hashes.pop(req.request_id, None)

    def _num_behind(self, num_computed: int, num_blocks: int) -> int:
        """Leading blocks (of `num_blocks`) wholly before the first position the query at
        `num_computed` sees (num_computed - window + 1); 0 without a window."""
        if self.window is None:
            return 0
        first_seen = num_computed - self.window + 1
        return min(max(first_seen, 0) // self.block_size, num_blocks)

    def release_behind(self, req: Request) -> int:
        """With a window: drop req's blocks wholly before the first position its next query
        sees (num_computed_tokens - window + 1); call after commit_full_blocks, so a released
        block keeps its prefix-cache hash. Returns how many were released."""
        if self.window is None:
            return 0
        upto = self._num_behind(req.num_computed_tokens, len(req.block_ids))
        released = 0
        for i in range(req.num_released_blocks, upto):
            self._drop(req.block_ids[i])
            released += 1
        req.num_released_blocks = max(req.num_released_blocks, upto)
        return released

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes; unreferenced cached blocks become plain free blocks."""
        for block in self._free_cached:
            self._free_plain.append(block)
        self._free_cached.clear()
        self._cache.clear()
        self._block_hash = [None] * self._num_blocks
        # A request holding blocks computed before the reset fills its next blocks with K/V
        # that attended to them: registered under the same token chain, those blocks were
        # hits for a prefix recomputed after the reset (stale K/V). Its digests go too.
        for request_id in self._req_hashes:
            self._req_hashes[request_id] = None
        logger.info("prefix cache reset")

    # ----------------------------------------------------------------- tests
    def check_invariants(self, requests: Iterable[Request] | None = None) -> None:
        """Raise AssertionError on any inconsistency. With `requests` (every request that may
        hold blocks), also check that ref counts equal the number of holders of each block."""
        plain, cached = set(self._free_plain), set(self._free_cached)
        assert len(plain) == len(self._free_plain), "duplicate in free list"
        assert not plain & cached, "block in both free lists"
        assert self.num_free_blocks + self.num_used_blocks == self._num_blocks
        for b in range(self._num_blocks):
            assert self._ref[b] >= 0
            assert (self._ref[b] == 0) == (b in plain or b in cached), f"block {b} free-list state"
            if b in plain:
                assert self._block_hash[b] is None, f"hashed block {b} in plain free list"
            if b in cached:
                assert self._block_hash[b] is not None, f"unhashed block {b} in cached list"
        for h, b in self._cache.items():
            assert self._block_hash[b] == h, f"cache entry for block {b} is stale"
        assert sum(h is not None for h in self._block_hash) == len(self._cache)
        if requests is not None:
            holders = [0] * self._num_blocks
            for req in requests:
                held = req.block_ids[req.num_released_blocks:]
                assert len(set(held)) == len(held), "block listed twice"
                for b in held:
                    holders[b] += 1
            assert holders == self._ref, "ref counts differ from the requests' block lists"
