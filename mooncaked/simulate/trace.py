"""Mooncake-format traces: loading, rate scaling, theoretical hit rate."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str, rate_scale: float = 1.0, limit: int = 0,
               block_size: int = 512) -> list[TraceRequest]:
    """Read a JSONL trace; arrivals are timestamps (ms) / 1000 / rate_scale.

    Validates every line, naming the line on error, and checks
    len(hash_ids) == ceil(input_length / block_size).
    """
    if rate_scale <= 0:
        raise ValueError("rate_scale must be > 0")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"trace: {path!r} is not a file")
    out: list[TraceRequest] = []
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                o = json.loads(line)
                ts, n, m, ids = (o["timestamp"], int(o["input_length"]),
                                 int(o["output_length"]), tuple(int(h) for h in o["hash_ids"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"trace {path}:{lineno}: bad record ({e})") from None
            if n <= 0 or m < 0:
                raise ValueError(f"trace {path}:{lineno}: input_length must be > 0, "
                                 "output_length >= 0")
            if len(ids) != -(-n // block_size):
                raise ValueError(f"trace {path}:{lineno}: {len(ids)} hash_ids for "
                                 f"{n} tokens at block size {block_size}")
            out.append(TraceRequest(len(out), float(ts) / 1000.0 / rate_scale, n, m, ids))
            if limit and len(out) >= limit:
                break
    out.sort(key=lambda r: (r.arrival_s, r.index))
    return out


def reusable_tokens(blocks: int, input_length: int, block_size: int) -> int:
    """Tokens a cached prefix of `blocks` saves; the last token is always computed."""
    return min(blocks * block_size, input_length - 1)


def theoretical_hit_rate(reqs: list[TraceRequest], block_size: int = 512) -> float:
    """Hit rate with an unbounded cache and instant storage, in tokens.

    A request reuses its longest prefix of blocks that some earlier
    request also had at the same positions.
    """
    seen: set[int] = set()
    hit = total = 0
    for r in reqs:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in seen:
            k += 1
        hit += reusable_tokens(k, r.input_length, block_size)
        total += r.input_length
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


def lru_pool_hit_rate(reqs: list[TraceRequest], capacity_tokens: int,
                      block_size: int = 512) -> float:
    """Hit rate of one LRU pool of `capacity_tokens` (Fig. 9's x-axis)."""
    from collections import OrderedDict

    cap = max(0, capacity_tokens // block_size)
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in reqs:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in lru:
            k += 1
        hit += reusable_tokens(k, r.input_length, block_size)
        total += r.input_length
        for h in r.hash_ids:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > cap:
            lru.popitem(last=False)
    return hit / total if total else 0.0
