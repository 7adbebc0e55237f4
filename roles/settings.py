"""Config sections of the prefill and decode roles."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillSection:
    # Reuse cached prefixes and keep new blocks (the store shard as a cache).
    # false = recompute every prompt in full: the "no prefix caching" baseline.
    prefix_cache: bool = True
    # Short queued requests (prompts up to model.prefill_chunk tokens) are
    # prefilled together, up to this many tokens per forward pass.
    batch_tokens: int = 4096
    # Largest number of requests waiting in the prefill queue (503 above).
    max_queue: int = 256
    # Give up on a peer prefix fetch after this long and recompute instead.
    fetch_timeout_s: float = 10.0
    # Chunked Pipeline Parallelism: this node is stage `cpp_stage` of the
    # `cpp_stages`-node group `cpp_group` (contiguous layer ranges); "" = a
    # single prefill node holding every layer.
    cpp_group: str = ""
    cpp_stage: int = 0
    cpp_stages: int = 1
    # Requests a stage can hold in flight (each takes two activation slots of
    # model.prefill_chunk x hidden floats).
    cpp_slots: int = 8
    # How long a stage waits for the next chunk from upstream before failing.
    cpp_chunk_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_queue <= 0 or self.batch_tokens <= 0:
            raise ValueError("prefill.max_queue and prefill.batch_tokens must be positive")
        if self.fetch_timeout_s <= 0:
            raise ValueError("prefill.fetch_timeout_s must be positive")
        if self.cpp_stages < 1 or not 0 <= self.cpp_stage < self.cpp_stages:
            raise ValueError("prefill.cpp_stage must be in [0, prefill.cpp_stages)")
        if (self.cpp_stages > 1) != bool(self.cpp_group):
            raise ValueError("prefill.cpp_group names the group iff prefill.cpp_stages > 1")
        if self.cpp_slots < 1 or self.cpp_chunk_timeout_s <= 0:
            raise ValueError("prefill.cpp_slots and prefill.cpp_chunk_timeout_s must be positive")


def stage_layers(num_layers: int, stages: int, stage: int) -> tuple[int, int]:
    """Contiguous, near-equal layer range [first, end) of one pipeline stage."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    first = stage * base + min(stage, extra)
    return first, first + base + (1 if stage < extra else 0)


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
