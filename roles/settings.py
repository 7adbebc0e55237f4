"""Config sections of the prefill and decode roles."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillSection:
    # Reuse cached prefixes and keep new blocks (the store shard as a cache).
    # false = recompute every prompt in full: the "no prefix caching" baseline.
    prefix_cache: bool = True
    # Largest number of requests waiting in the prefill queue (503 above).
    max_queue: int = 256
    # Give up on a peer prefix fetch after this long and recompute instead.
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_queue <= 0:
            raise ValueError("prefill.max_queue must be positive")
        if self.fetch_timeout_s <= 0:
            raise ValueError("prefill.fetch_timeout_s must be positive")


@dataclass
class DecodeSection:
    # Most sequences decoded together in one continuous-batching step.
    max_batch: int = 32
    # A reservation whose KV has not fully arrived after this long is freed
    # (covers a prefill node that died mid-request).
    reservation_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_batch <= 0:
            raise ValueError("decode.max_batch must be positive")
        if self.reservation_timeout_s <= 0:
            raise ValueError("decode.reservation_timeout_s must be positive")
