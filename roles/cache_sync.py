"""Node side of the global cache index: ship the shard's block events.

Protocol (conductor side: ``roles.conductor.cache_api``):
  * first, and whenever the conductor answers ``{"resync": true}``, POST a
    full snapshot ``{node_id, epoch, seq, keys}`` to /internal/cache/snapshot;
  * then POST each drained batch ``{node_id, epoch, seq, stored, evicted,
    resync}`` to /internal/cache/events.
Batches are pushed every ``interval_s`` when there are any, and at once when
``kick()`` is called (a prefill finished: its new blocks should be visible
to the next scheduling decision, not a heartbeat later).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvstore.shard import StoreShard
from mooncaked.node.tasks import cancel_and_wait

log = logging.getLogger("mooncaked.cache_sync")


class CacheEventPusher:
    def __init__(self, shard: StoreShard, http: aiohttp.ClientSession, conductor_url: str,
                 node_id: str, interval_s: float = 0.1) -> None:
        # ``http`` carries the cluster token (the worker's session), if any.
        self.shard = shard
        self.http = http
        self.base = conductor_url.rstrip("/")
        self.node_id = node_id
        self.interval_s = interval_s
        self._need_snapshot = True
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="cache-events")

    def kick(self) -> None:
        self._kick.set()

    async def flush(self) -> None:
        """Push pending events now (used before answering a finished prefill)."""
        async with self._lock:
            await self._push()

    async def _post(self, path: str, body: dict) -> dict:
        async with self.http.post(self.base + path, json=body,
                                  timeout=aiohttp.ClientTimeout(total=5)) as resp:
            data = await resp.json(content_type=None)
            if resp.status != 200:
                raise aiohttp.ClientError(f"HTTP {resp.status}: {data}")
            return data if isinstance(data, dict) else {}

    async def _push(self) -> None:
        if self._need_snapshot:
            snap = self.shard.snapshot()
            await self._post("/internal/cache/snapshot", {"node_id": self.node_id, **snap.to_dict()})
            self._need_snapshot = False
        batch = self.shard.drain_events()
        if batch is None:
            return
        try:
            answer = await self._post("/internal/cache/events", {"node_id": self.node_id,
                                                                  **batch.to_dict()})
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            # The batch is lost with the failed call: resync next time.
            self._need_snapshot = True
            raise
        if answer.get("resync"):
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
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                self._need_snapshot = True
                failures += 1
                if failures == 1 or failures % 50 == 0:
                    log.warning("pushing cache events failed (%d in a row): %s", failures, exc)
                await asyncio.sleep(min(2.0, self.interval_s * failures))

    async def close(self) -> None:
        await cancel_and_wait(self._task)
