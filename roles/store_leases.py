"""Leases on cached blocks, so a peer can READ them with the transfer engine.

A peer that wants our blocks asks for a lease on their keys: we pin the
longest prefix of those keys we hold (pinned blocks are never evicted or
overwritten) and answer with their page ids; the peer READs the pages
one-sided and then releases the lease.  A lease the peer never releases
(it died) expires after its TTL, so nothing stays pinned forever.

POST /internal/store/lease    LeaseRequest {keys: [...], ttl_s}
                              -> LeaseGrant {lease_id, pages, region, segment}
POST /internal/store/release  LeaseRelease {lease_id} -> Released
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

from aiohttp import web

from kvstore.shard import StoreShard
from mooncaked.node.context import CTX
from mooncaked.node.errors import ApiError
from mooncaked.node.internal_client import read_message, reply
from mooncaked.node.messages import LeaseGrant, LeaseRelease, LeaseRequest, Released, Route
from mooncaked.node.tasks import cancel_and_wait
from roles.worker_node import WORKER

log = logging.getLogger("mooncaked.leases")
MAX_TTL_S = 120.0


@dataclass
class Lease:
    keys: list[int]
    expires_at: float


class LeaseTable:
    def __init__(self, shard: StoreShard) -> None:
        self.shard = shard
        self.leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)

    def grant(self, keys: list[int], ttl_s: float, now: float) -> tuple[int, list[int]]:
        # Peer reads are not prompt lookups: keep them out of the hit-rate metrics.
        pages = self.shard.acquire_prefix(keys, count_query=False)
        lease_id = next(self._ids)
        self.leases[lease_id] = Lease(keys[:len(pages)], now + ttl_s)
        return lease_id, pages

    def release(self, lease_id: int) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        self.shard.release(lease.keys)
        return True

    def expire(self, now: float) -> int:
        expired = [i for i, lease in self.leases.items() if lease.expires_at <= now]
        for lease_id in expired:
            self.release(lease_id)
        return len(expired)

    def release_all(self) -> None:
        for lease_id in list(self.leases):
            self.release(lease_id)


LEASES = web.AppKey("leases", LeaseTable)


def add_lease_routes(app: web.Application) -> None:
    """Lease routes over the node's open worker (``app[WORKER]``)."""

    async def lease(request: web.Request) -> web.Response:
        req = await read_message(request, LeaseRequest, 8 << 20)
        if not 0 < req.ttl_s <= MAX_TTL_S:
            raise ApiError(400, f"lease.ttl_s: must be in (0, {MAX_TTL_S}]", param="lease.ttl_s")
        table = request.app[LEASES]
        await table.shard.promote_prefix(req.keys)   # SSD reads off the event loop
        lease_id, pages = table.grant(req.keys, req.ttl_s, time.monotonic())
        worker = request.app[WORKER]
        return reply(LeaseGrant(lease_id=lease_id, pages=pages, region=worker.region_id,
                                segment=worker.engine.name))

    async def release(request: web.Request) -> web.Response:
        req = await read_message(request, LeaseRelease, 1 << 16)
        return reply(Released(released=request.app[LEASES].release(req.lease_id)))

    async def leases_ctx(app: web.Application):
        table = LeaseTable(app[WORKER].shard)
        app[LEASES] = table
        ctx = app.get(CTX)  # absent in the in-process tests' bare apps
        if ctx is not None:
            ctx.collection_sizes.append(lambda: {"store_leases": len(table.leases)})

        async def expire_loop() -> None:
            while True:
                await asyncio.sleep(1.0)
                n = table.expire(time.monotonic())
                if n:
                    log.warning("%d block lease(s) expired unreleased (peer gone?)", n)

        task = asyncio.create_task(expire_loop(), name="lease-expiry")
        yield
        await cancel_and_wait(task)
        table.release_all()

    app.router.add_post(Route.LEASE, lease)
    app.router.add_post(Route.LEASE_RELEASE, release)
    app.cleanup_ctx.append(leases_ctx)
