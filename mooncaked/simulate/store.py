"""A node's KV store shard for the simulator: LRU over block keys, with pins.

Only the semantics the scheduler sees matter here (which keys a node holds,
what it evicts), so a block is just its key. Invariant: a pinned key (in use
by an in-flight request) is never evicted; if every resident key is pinned,
new keys are not admitted (the shard stays within capacity).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class LruShard:
    def __init__(self, capacity_blocks: int | None) -> None:
        # None: unbounded
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0 or None")
        self.capacity = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pins: dict[int, int] = {}
        self.seq = 0  # next event batch sequence number

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: int) -> bool:
        return key in self._lru

    def prefix_blocks(self, keys: Iterable[int]) -> int:
        n = 0
        for k in keys:
            if k not in self._lru:
                break
            n += 1
        return n

    def pin(self, keys: Iterable[int]) -> None:
        for k in keys:
            self._pins[k] = self._pins.get(k, 0) + 1

    def unpin(self, keys: Iterable[int]) -> None:
        for k in keys:
            c = self._pins.get(k, 0) - 1
            if c > 0:
                self._pins[k] = c
            else:
                self._pins.pop(k, None)

    def put(self, keys: Iterable[int]) -> tuple[list[int], list[int]]:
        """Store/refresh keys in order; returns (newly stored, evicted)."""
        stored: list[int] = []
        evicted: list[int] = []
        lru = self._lru
        cap = self.capacity
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
                continue
            if cap is not None and len(lru) >= cap and not self._evict_one(evicted):
                continue  # all pinned (or capacity 0): not admitted
            lru[k] = None
            stored.append(k)
        # a key stored and evicted within one call is reported as neither
        if evicted and stored:
            gone = set(evicted) & set(stored)
            if gone:
                stored = [k for k in stored if k not in gone]
                evicted = [k for k in evicted if k not in gone]
        return stored, evicted

    def touch(self, keys: Iterable[int]) -> None:
        lru = self._lru
        for k in keys:
            if k in lru:
                lru.move_to_end(k)

    def _evict_one(self, evicted: list[int]) -> bool:
        lru = self._lru
        for _ in range(len(lru)):
            k = next(iter(lru))
            if k in self._pins:
                lru.move_to_end(k)  # in use counts as recently used
                continue
            del lru[k]
            evicted.append(k)
            return True
        return False

    def keys(self) -> list[int]:
        return list(self._lru)
