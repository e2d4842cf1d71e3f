"""Bytes per token and capacity arithmetic for a paged KV cache (no allocation here)."""

from __future__ import annotations

from dataclasses import dataclass

from kvcap.config import ModelSpec

_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8_e4m3": 1}


def peak_blocks(num_tokens: int, block_size: int, window: int | None, chunk: int) -> int:
    """The most blocks a sequence of `num_tokens` tokens, computed in chunks of at most `chunk`
    tokens, holds at once: all of them; or, when every layer slides over `window` tokens and
    the blocks behind it are released (BlockManager.release_behind), a chunk's blocks and the
    window before its first token (one more for alignment)."""
    whole = -(-num_tokens // block_size)
    if window is None:
        return whole
    return min(whole, -(-(window - 1 + chunk) // block_size) + 1)


def admission_watermark(num_blocks: int, running: int) -> int:
    """Free blocks the scheduler keeps after admitting a prompt beside `running` requests
    (Scheduler._leaves_headroom): 1% of the pool, at least one block per running request."""
    return max(-(-num_blocks // 100), running)


def admissible_concurrency(num_blocks: int, per_seq: int) -> int:
    """Sequences of `per_seq` blocks each that the scheduler runs at once in a pool of
    `num_blocks`: the first may take the whole pool, each later one is admitted only while
    its blocks leave the admission watermark free. `num_blocks // per_seq` promised more: a
    pool of exactly two sequences ran them one after the other."""
    if num_blocks < per_seq:
        return 0
    reserve = admission_watermark(num_blocks, 0)
    # c-th admission, c - 1 running: num_blocks - c * per_seq >= max(reserve, c - 1)
    return max(1, min((num_blocks - reserve) // per_seq, (num_blocks + 1) // (per_seq + 1)))


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str  # fp32 | fp16 | bf16 | fp8_e4m3
    side_bytes_per_token: int = 0  # FP16 side caches (QSA indexer) that stay unquantized
    # Each layer's attention window (ModelSpec.layer_window; empty: no layer slides).
    layer_windows: tuple[int | None, ...] = ()

    @classmethod
    def for_model(cls, spec: ModelSpec, block_size: int, kv_dtype: str) -> KVCacheSpec:
        windows = tuple(spec.layer_window(i) for i in range(spec.num_layers))
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size, kv_dtype,
                   layer_windows=windows if any(windows) else ())

    @property
    def released_window(self) -> int | None:
        """The window behind which blocks are released: set only when every layer slides
        (over the same window), since a full layer still reads every token."""
        windows = set(self.layer_windows)
        if len(self.layer_windows) != self.num_layers or None in windows or len(windows) != 1:
            return None
        return windows.pop()

    @property
    def element_bytes(self) -> int:
        return _BYTES[self.kv_dtype]

    @property
    def values_per_token(self) -> int:
        """K and V values a token holds over all layers (side caches aside)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.values_per_token * self.element_bytes + self.side_bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        return max(0, memory_bytes // self.bytes_per_block)

    def tokens_for(self, memory_bytes: int) -> int:
        return self.num_blocks_for(memory_bytes) * self.block_size

    def max_concurrency(self, memory_bytes: int, context_len: int, chunk: int = 1) -> int:
        """Sequences of `context_len` tokens the memory holds at once (with a released window,
        each holds peak_blocks for prefill chunks of `chunk` tokens)."""
        per_seq = peak_blocks(context_len, self.block_size, self.released_window, chunk)
        # as the scheduler admits them (the engine's startup line counts the same way):
        # `num_blocks // per_seq` ignored the admission watermark, and `kvcap capacity`
        # promised 100 sequences of a pool that runs 94
        return admissible_concurrency(self.num_blocks_for(memory_bytes), per_seq)
