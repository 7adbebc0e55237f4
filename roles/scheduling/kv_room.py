"""The KV blocks a request takes at an engine.

An engine such as vLLM starts a waiting request only once its KV cache has
free blocks for the request's tokens: blocks no running request holds
(cached blocks of finished requests count as free; they are evicted on
demand).  A request holds its blocks from its start until it finishes
decoding; blocks of one prompt prefix that several running requests share
are held once.  When the blocks free up is engine_timeline.py's to say.

Pure arithmetic: nothing here reads a clock.
"""
from __future__ import annotations

import math
from typing import Iterable


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens that ``tokens`` tokens occupy."""
    return max(0, math.ceil(max(0, tokens) / block_size)) if block_size > 0 else 0


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
