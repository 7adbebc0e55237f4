"""Node side of the global cache index: ship the shard's block events.

Protocol (conductor side: ``roles.conductor.cluster``; messages in
``mooncaked.node.messages``):
  * first, and whenever the conductor answers ``{"resync": true}``, POST a
    full ``CacheSnapshot`` {node_id, epoch, seq, keys} to /internal/cache/snapshot;
  * then POST each drained batch as ``CacheEvents`` {node_id, epoch, seq,
    stored, evicted, resync} to /internal/cache/events.
Batches are pushed every ``interval_s`` when there are any, and at once when
``kick()`` is called (a prefill finished: its new blocks should be visible
to the next scheduling decision, not a heartbeat later).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from kvstore.shard import StoreShard
from mooncaked.node.internal_client import InternalCallError, InternalClient
from mooncaked.node.messages import CacheEvents, CacheEventsAck, CacheSnapshot, Ok, Route
from mooncaked.node.tasks import cancel_and_wait

log = logging.getLogger("mooncaked.cache_sync")

# How long a finished prefill's reply may wait for its events to be pushed.
FLUSH_TIMEOUT_S = 1.0


class CacheEventPusher:
    def __init__(self, shard: StoreShard, client: InternalClient,
                 conductor_url: str | Callable[[], str], node_id: str,
                 interval_s: float = 0.1) -> None:
        self.shard = shard
        self.client = client
        # A callable is read per push: with etcd the conductor moves to each new leader.
        self._conductor_url = conductor_url
        self.node_id = node_id
        self.interval_s = interval_s
        self._need_snapshot = True
        self._snapshot_sent_to = ""   # the conductor that has our snapshot
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    @property
    def base(self) -> str:
        url = self._conductor_url
        return (url() if callable(url) else url).rstrip("/")

    @property
    def in_sync(self) -> bool:
        """True once the current conductor has acknowledged our snapshot and no
        resync is pending: from then on ``flush`` pushes events directly.  A
        snapshot the conductor has received but not yet answered does not count."""
        return not self._need_snapshot and self.base == self._snapshot_sent_to

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="cache-events")

    def kick(self) -> None:
        self._kick.set()

    async def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Push pending events now, before a finished prefill answers, so that
        the next scheduling decision sees its new blocks.  Best effort: it
        never fails the caller (the prefill is done and its KV delivered) and
        never makes it wait for a whole snapshot; a pending resync or a failed
        or slow push is left to the background loop.  True when pushed."""
        if not self.in_sync:
            self.kick()
            return False
        try:
            async with asyncio.timeout(timeout_s):
                async with self._lock:
                    await self._push()
            return True
        except (InternalCallError, TimeoutError) as exc:
            log.info("cache events not pushed with the reply (the background loop retries): %s",
                     exc or "timed out")
            self._need_snapshot = True
            self.kick()
            return False

    async def _push(self) -> None:
        base = self.base
        if not base:
            return  # no conductor known yet (etcd has not named the leader): the loop retries
        if base != self._snapshot_sent_to:
            # Another conductor (with etcd, a newly elected leader) starts from
            # a snapshot, even when this shard has no new events to push.
            self._need_snapshot = True
        if self._need_snapshot:
            snap = self.shard.snapshot()
            await self.client.call(base + Route.CACHE_SNAPSHOT, CacheSnapshot(
                node_id=self.node_id, epoch=snap.epoch, seq=snap.seq, keys=snap.keys),
                Ok.from_wire, what="cache snapshot")
            self._need_snapshot = False
            self._snapshot_sent_to = base
        batch = self.shard.drain_events()
        if batch is None:
            return
        try:
            answer = await self.client.call(base + Route.CACHE_EVENTS, CacheEvents(
                node_id=self.node_id, epoch=batch.epoch, seq=batch.seq, stored=batch.stored,
                evicted=batch.evicted, resync=batch.resync),
                CacheEventsAck.from_wire, what="cache events")
        except (InternalCallError, asyncio.CancelledError):
            # The batch is lost with the failed (or abandoned) call: resync next time.
            self._need_snapshot = True
            raise
        if answer.resync:
            self._need_snapshot = True

    async def _loop(self) -> None:
        failures = 0
        while True:
            try:
                await asyncio.wait_for(self._kick.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
            self._kick.clear()
            try:
                async with self._lock:
                    await self._push()
                failures = 0
            except InternalCallError as exc:
                self._need_snapshot = True
                failures += 1
                if failures == 1 or failures % 50 == 0:
                    log.warning("pushing cache events failed (%d in a row): %s", failures, exc)
                await asyncio.sleep(min(2.0, self.interval_s * failures))

    async def close(self) -> None:
        await cancel_and_wait(self._task)
