"""Config sections of the prefill and decode roles."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillSection:
    # Prompts whose uncached suffix exceeds this many tokens are computed in
    # chunks (the paper pipelines inputs above ~1000 uncached tokens).
    chunk_threshold: int = 1024
    # Tokens computed per prefill step when batching queued requests.
    batch_tokens: int = 4096
    # Largest number of requests waiting in the prefill queue (503 above).
    max_queue: int = 256
    # Give up on a peer prefix fetch after this long and recompute instead.
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.chunk_threshold <= 0 or self.batch_tokens <= 0 or self.max_queue <= 0:
            raise ValueError("prefill.chunk_threshold, batch_tokens and max_queue must be positive")
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
