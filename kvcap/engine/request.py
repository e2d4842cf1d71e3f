"""A request's state as the scheduler and engine see it. Pure Python, no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvcap.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; will recompute from scratch (prefix cache may help)
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self is _STOPPED or self is _LENGTH or self is _ABORTED


_STOPPED, _LENGTH, _ABORTED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                               RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (prompt + outputs); prefill chunks advance it.
    num_computed_tokens: int = 0
    # Physical block ids, in order; owned by the BlockManager while the request holds them.
    block_ids: list[int] = field(default_factory=list)
    # block_ids[:num_released_blocks] lie behind every layer's sliding window: handed back to
    # the pool (BlockManager.release_behind), kept in the list so it only grows by append
    num_released_blocks: int = 0
    num_cached_prefix_tokens: int = 0  # prefix-cache hit on the last admission
    num_preemptions: int = 0
    stop_reason: str | int | None = None
    # Teacher-forced scoring needs logits at every prompt row: never skip rows via the cache.
    needs_all_prompt_rows: bool = False

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None:
            self.needs_all_prompt_rows = True

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without concatenating the prompt and the outputs."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        s = self.status
        return s is _STOPPED or s is _LENGTH or s is _ABORTED
