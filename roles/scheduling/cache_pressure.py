"""What storing a prompt's blocks on an engine costs the requests after it.

An engine's prefix cache holds a fixed number of blocks (vLLM's
``num_gpu_blocks``).  A prompt sent there stores every full block of it the
engine does not hold; once the cache is full each one evicts a cached block
(vLLM: the least recently used free one), and a later request that would
have hit an evicted block computes it again.  In expectation a placement
costs the requests after it

    evicted blocks x block tokens x seconds per prefilled token x reuse share

where *reuse share* is the share of recently routed prompt tokens that some
engine already held: how likely a cached block is asked for again, as this
workload shows it (near 0 for one-off prompts, most of the prompt for
documents asked about again and again).

A new block that no engine holds evicts only once the cache is full: free
room holds it at no cost.  A copy of a block another engine holds does not
wait for that: it adds nothing the fleet lacks, and an engine's prefix cache
never gives room back (freed blocks stay cached until they are needed), so
the room the copy takes is room the fleet's next unique prefix at that
engine would have had.  It is priced as evicting one block, free room or
not; a hot prefix is still copied once the queue at its holder costs more
than recomputing it and that.  Algorithm 1 over engines chooses on
predicted TTFT plus this cost, admission stays on the TTFT alone: a busy
holder of a prefix loses its request to an idle engine only when the TTFT
saved outweighs the cached work the copy would push out, and a new prefix
goes where there is room for it.

Nothing here does I/O or reads a clock.
"""
from __future__ import annotations

from collections import deque

from .estimators import PrefillEstimator

# Routed requests the reuse share is measured over.
REUSE_WINDOW = 64


class ReuseShare:
    """Share of the last ``window`` routed prompts' tokens some engine held."""

    def __init__(self, window: int = REUSE_WINDOW) -> None:
        self._recent: deque[tuple[int, int]] = deque(maxlen=window)

    def add(self, prompt_tokens: int, held_tokens: int) -> None:
        """One routed prompt and the longest prefix of it any engine held."""
        self._recent.append((prompt_tokens, max(0, min(held_tokens, prompt_tokens))))

    def share(self) -> float:
        """0 before any prompt was routed (no reuse seen, none assumed)."""
        prompt = sum(p for p, _ in self._recent)
        return sum(h for _, h in self._recent) / prompt if prompt else 0.0


def new_blocks(prompt_tokens: int, held_tokens: int, block_size: int) -> int:
    """Full blocks of the prompt the engine will store that it does not hold
    (a partial last block is never cached)."""
    full = prompt_tokens // block_size
    return full - min(full, max(0, held_tokens) // block_size)


def blocks_evicted(capacity_blocks: int, occupied_blocks: int, storing: int) -> int:
    """Cached blocks pushed out by storing ``storing`` more into a cache of
    ``capacity_blocks`` holding ``occupied_blocks``."""
    return max(0, min(storing, occupied_blocks + storing - capacity_blocks))


def blocks_displaced(capacity_blocks: int, occupied_blocks: int, unique: int,
                     copies: int) -> int:
    """Cached blocks that storing ``unique`` blocks no engine holds and
    ``copies`` of blocks another engine holds costs a cache of
    ``capacity_blocks`` holding ``occupied_blocks``: every copy one, the
    unique blocks those the room left after the copies does not take."""
    return copies + blocks_evicted(capacity_blocks, occupied_blocks + copies, unique)


def eviction_seconds(estimator: PrefillEstimator, evicted_blocks: int, block_size: int,
                     reuse_share: float, typical_prompt: int) -> float:
    """Expected prefill seconds later requests spend recomputing what is
    evicted: the evicted tokens priced at the margin of a typical prompt
    (what they are recomputed as part of), times the reuse share."""
    if evicted_blocks <= 0 or reuse_share <= 0.0:
        return 0.0
    tokens = evicted_blocks * block_size
    marginal = estimator.seconds(typical_prompt + tokens, 0) - estimator.seconds(typical_prompt, 0)
    return reuse_share * max(0.0, marginal)
