"""Moves between the shard's DRAM pages and its SSD tier, with their counters and events.

The shard owns pages, :class:`SsdTier` owns SSD slots.  A demotion hands the
tier the bytes of a block the shard has just evicted; a promotion is split
between them: the tier reserves the block's slot (:meth:`SsdTier.reserve`),
the shard finds a page for it, the tier reads it back
(:meth:`SsdTier.read_back`) and frees the slot.  Every key that leaves the
node here (an SSD drop, a failed write or read) is reported as evicted; a
key that only changes tier is not, since the node still holds it.

The pool writes in the background when the shard runs on an event loop (see
ssd.py).  A write that fails after its demotion was counted is reported here
when the pool hands back its key (``_write_failed``).  Finished writes are
applied at the tier's entry points, except :meth:`demote`: a demotion may run
in the middle of a promotion (finding the promoted block a page), and the
promoted entry must not change state until :meth:`read_back` or
:meth:`unreserve`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from kvstore.events import EventLog
from kvstore.ssd import SsdEntry, SsdPool
from kvstore.stats import ShardCounters


class SsdTier:
    def __init__(self, pool: SsdPool, events: EventLog, counters: ShardCounters) -> None:
        self.pool = pool
        self._events = events
        self._counters = counters
        pool.on_write_failed = self._write_failed

    # ---------------------------------------------------------------- queries

    def __contains__(self, key: int) -> bool:
        # No reap here: match_prefix asks once per key (an in-flight write
        # is held, so the answer is the same either way).
        return key in self.pool

    def __len__(self) -> int:
        return len(self.pool)

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    def keys(self) -> list[int]:
        self.pool.reap()
        return self.pool.keys()

    def peek(self, key: int) -> SsdEntry | None:
        return self.pool.peek(key)

    def set_replicas(self, key: int, n: int) -> int:
        return self.pool.set_replicas(key, n)

    def remove(self, key: int) -> bool:
        """Forget the SSD copy of ``key``; the caller reports the event, if any."""
        self.pool.reap()
        return self.pool.remove(key)

    # ------------------------------------------------------------------ moves

    def demote(self, key: int, data: memoryview, tokens: bytes | None, replicas: int) -> None:
        """Write a block just evicted from DRAM; ``data`` must stay valid for
        the call only (the shard frees its page afterwards; a background
        write works on the pool's own copy)."""
        stored, dropped = self.pool.put(key, data, tokens, replicas)
        if stored:
            self._counters.demotions += 1
        else:  # no SSD slot or a failed write: the block leaves the node
            dropped.append(key)
        for k in dropped:
            self._counters.ssd_drops += 1
            self._events.evicted(k)

    def reserve(self, key: int) -> SsdEntry | None:
        """Start promoting ``key``: take it out of the tier's index but keep its
        slot, so that a demotion caused by finding a page for it cannot
        overwrite it.  None if the tier does not hold it."""
        self.pool.reap()
        return self.pool.take(key)

    def unreserve(self, key: int, entry: SsdEntry) -> None:
        """Abandon a promotion (no page could be had): the SSD copy stays,
        unless its write failed meanwhile."""
        if not self.pool.untake(key, entry):
            self._write_failed([key])

    def read_back(self, key: int, entry: SsdEntry, out: memoryview) -> None:
        """Finish a promotion: read the block into ``out`` and free its slot.
        On a read error the block is gone from the node (counted, reported)
        and the OSError propagates."""
        try:
            self.pool.read_into(entry, out)
        except OSError:
            self.pool.release_slot(entry)
            self._counters.ssd_drops += 1
            self._events.evicted(key)
            raise
        self.pool.release_slot(entry)
        self._counters.promotions += 1

    async def read_back_off_loop(self, key: int, entry: SsdEntry, out: memoryview) -> None:
        """:meth:`read_back` with the disk read on a worker thread: the entry
        is out of the index and its slot reserved, so nothing else touches
        them meanwhile; the slot and the counters change on the loop."""
        try:
            await asyncio.to_thread(self.pool.read_bytes, entry, out)
        except OSError:
            self.pool.release_slot(entry)
            self._counters.ssd_drops += 1
            self._events.evicted(key)
            raise
        self.pool.reads += 1
        self.pool.release_slot(entry)
        self._counters.promotions += 1

    def _write_failed(self, keys: list[int]) -> None:
        """Background writes of ``keys`` failed: the blocks left the node."""
        for k in keys:
            self._counters.ssd_drops += 1
            self._events.evicted(k)

    def settle(self) -> None:
        """Wait for every background write and apply the results."""
        self.pool.wait_writes()

    # -------------------------------------------------------------- lifecycle

    def check_integrity(self, dram_keys: Iterable[int]) -> None:
        """Assert the pool's own invariants and that no key is in both tiers."""
        self.pool.reap()
        self.pool.check_integrity()
        assert not set(self.pool.keys()) & set(dram_keys), "a key is in both tiers"

    def close(self) -> None:
        self.pool.close()
