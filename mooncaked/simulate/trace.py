"""Mooncake-format traces: loading, reshaping (rate, outputs, shared prefix), hit-rate bounds."""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, replace
from collections.abc import Callable, Container
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    """One trace line. hash_ids[i] keys block i (tokens [i*bs, (i+1)*bs)) and,
    being a chained hash, stands for the whole prefix up to that block."""

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


def rescale(reqs: list[TraceRequest], rate_scale: float = 1.0,
            output_scale: float = 1.0) -> list[TraceRequest]:
    """The trace with arrivals `rate_scale` x denser and outputs `output_scale` x longer.

    An output of 0 tokens stays 0; any other stays >= 1 token.
    """
    return [replace(r, arrival_s=r.arrival_s / rate_scale,
                    output_length=max(1, round(r.output_length * output_scale))
                    if r.output_length else 0) for r in reqs]


def with_system_prompt(reqs: list[TraceRequest], blocks: int,
                       block_size: int = 512) -> list[TraceRequest]:
    """Every request prefixed by the same `blocks` blocks (fresh hash ids).

    Keys are chained hashes, so one shared leading prefix keeps every
    request's own ids valid; only the leading blocks become common.
    """
    base = 1 + max((h for r in reqs for h in r.hash_ids), default=-1)
    head = tuple(range(base, base + blocks))
    return [replace(r, input_length=r.input_length + blocks * block_size,
                    hash_ids=head + r.hash_ids) for r in reqs]


def reusable_tokens(blocks: int, input_length: int, block_size: int) -> int:
    """Tokens a cached prefix of `blocks` saves; the last token is always computed."""
    return min(blocks * block_size, input_length - 1)


def _replay_hit_rate(reqs: list[TraceRequest], cached: Container[int],
                     admit: Callable[[tuple[int, ...]], None], block_size: int) -> float:
    """Token hit rate of replaying `reqs` in order against one cache.

    A request hits the leading run of its blocks found in `cached`, then
    `admit` stores all its blocks (so a request never hits itself).
    """
    hit = total = 0
    for r in reqs:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in cached:
            k += 1
        hit += reusable_tokens(k, r.input_length, block_size)
        total += r.input_length
        admit(r.hash_ids)
    return hit / total if total else 0.0


def theoretical_hit_rate(reqs: list[TraceRequest], block_size: int = 512) -> float:
    """Hit rate with an unbounded cache and instant storage, in tokens.

    A request reuses its longest prefix of blocks that some earlier
    request also had at the same positions (ids are chained hashes, so a
    shared id means a shared prefix).
    """
    seen: set[int] = set()
    return _replay_hit_rate(reqs, seen, seen.update, block_size)


def lru_pool_hit_rate(reqs: list[TraceRequest], capacity_tokens: int,
                      block_size: int = 512) -> float:
    """Hit rate of one LRU pool of `capacity_tokens` (Fig. 9's x-axis)."""
    cap = max(0, capacity_tokens // block_size)
    lru: OrderedDict[int, None] = OrderedDict()

    def admit(ids: tuple[int, ...]) -> None:
        for h in ids:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > cap:
            lru.popitem(last=False)

    return _replay_hit_rate(reqs, lru, admit, block_size)
