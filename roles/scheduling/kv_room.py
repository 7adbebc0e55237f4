"""When an engine's KV cache has room for a request.

An engine such as vLLM starts a waiting request only once its KV cache has
free blocks for the request's tokens: blocks no running request holds
(cached blocks of finished requests count as free; they are evicted on
demand).  A request holds its blocks from its start until it finishes
decoding.  So a request sent to an engine whose running requests fill its
cache waits until enough of them finish, however short the prefill queue
there is: a FIFO count of prefill work does not see that wait.

The model: each request at the engine is a holder of some blocks until an
expected release time (its expected first token plus its expected output
tokens at the engine's decode step); a new request needing ``need`` blocks
starts once capacity less what is still held covers it, holders releasing
in order of their release times.  Blocks of one prompt prefix shared by
several holders are counted once (the engine shares them).

Pure arithmetic: the caller passes ``now``; nothing here reads a clock.
"""
from __future__ import annotations

import math
from typing import Iterable, NamedTuple


class Holder(NamedTuple):
    """Blocks a request holds at an engine, and when it should free them."""

    blocks: int
    release_at: float


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens that ``tokens`` tokens occupy."""
    return max(0, math.ceil(max(0, tokens) / block_size)) if block_size > 0 else 0


def room_wait_s(capacity_blocks: int, holders: Iterable[Holder], need_blocks: int,
                now: float) -> float:
    """Seconds from ``now`` until ``capacity_blocks`` less the blocks still
    held covers ``need_blocks``.  A holder past its expected release is
    taken to release now (it is late, not gone for ever).  A request larger
    than the whole cache waits for every holder: the engine then runs it
    alone (chunked, or by preempting), which is the most that can be said."""
    if need_blocks <= 0:
        return 0.0
    ordered = sorted(holders, key=lambda h: h.release_at)
    free = capacity_blocks - sum(h.blocks for h in ordered)
    if free >= need_blocks:
        return 0.0
    wait = 0.0
    for h in ordered:
        free += h.blocks
        wait = max(wait, h.release_at - now)
        if free >= need_blocks:
            break
    return max(0.0, wait)


def shared_blocks(block_keys: Iterable[int], held: set[int]) -> int:
    """Leading full blocks of a prompt (its chained ``block_keys``) that
    the engine already holds for a running request: the engine maps them
    into the new request instead of taking free blocks.  Chained keys: a
    block matches only with every block before it, so the count stops at
    the first miss."""
    n = 0
    for key in block_keys:
        if key not in held:
            break
        n += 1
    return n
