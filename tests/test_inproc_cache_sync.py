"""The prefill node's cache-event pusher against an in-process stand-in conductor.

A finished prefill pushes its new blocks before it answers (``flush``); that
push must never turn the finished prefill into an error, nor make it wait
for a whole snapshot; the background loop catches up (snapshot, then events).
"""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvstore.config import StoreConfig
from kvstore.layout import PageLayout
from kvstore.shard import StoreShard
from mooncaked.node.internal_client import InternalClient
from mooncaked.node.messages import Route
from roles.cache_sync import CacheEventPusher
from tests.waiting import eventually

BLOCK = 16


class StandInConductor:
    def __init__(self) -> None:
        self.failing = False
        # Set: snapshots are answered at once.  Cleared by a test: each snapshot
        # is stored but its answer waits, the window in which the conductor
        # has the snapshot and the pusher does not know yet.
        self.answer_snapshots = asyncio.Event()
        self.answer_snapshots.set()
        self.snapshots: list[dict] = []
        self.events: list[dict] = []

    def app(self) -> web.Application:
        async def snapshot(request: web.Request) -> web.Response:
            if self.failing:
                return web.json_response({"error": {"message": "down"}}, status=500)
            self.snapshots.append(orjson.loads(await request.read()))
            await self.answer_snapshots.wait()
            return web.json_response({"ok": True})

        async def events(request: web.Request) -> web.Response:
            if self.failing:
                return web.json_response({"error": {"message": "down"}}, status=500)
            self.events.append(orjson.loads(await request.read()))
            return web.json_response({"resync": False})

        app = web.Application()
        app.router.add_post(Route.CACHE_SNAPSHOT, snapshot)
        app.router.add_post(Route.CACHE_EVENTS, events)
        return app


def _shard() -> StoreShard:
    layout = PageLayout(num_layers=1, block_size=BLOCK, num_kv_heads=1, head_dim=4)
    return StoreShard(StoreConfig(capacity_bytes=64 * layout.page_bytes, block_size=BLOCK),
                      layout)


def _store_one_block(shard: StoreShard, key: int) -> None:
    [page] = shard.allocate(1)
    shard.publish(key, page, list(range(key, key + BLOCK)))


async def test_a_failed_push_never_fails_the_prefill_and_the_loop_catches_up():
    conductor = StandInConductor()
    # The conductor holds the snapshot before the pusher knows it was taken
    # (under CI load that window once failed this test's first flush).
    conductor.answer_snapshots.clear()
    shard = _shard()
    client = InternalClient.open()
    async with TestServer(conductor.app(), host="127.0.0.1") as server:
        pusher = CacheEventPusher(shard, client, str(server.make_url("")), "prefill-0",
                                  interval_s=0.05)
        try:
            assert await pusher.flush() is False  # first contact needs a snapshot: not here
            assert conductor.snapshots == []
            pusher.start()
            await eventually(lambda: len(conductor.snapshots) == 1)
            assert not pusher.in_sync   # stored there, not yet answered
            _store_one_block(shard, 100)
            assert await pusher.flush() is False   # never waits for a snapshot in flight
            conductor.answer_snapshots.set()
            await eventually(lambda: pusher.in_sync)
            # The loop may have pushed block 100 meanwhile; then this flush has nothing new.
            _store_one_block(shard, 101)
            assert await pusher.flush() is True
            assert sorted(k for e in conductor.events for k in e["stored"]) == [100, 101]

            conductor.failing = True
            _store_one_block(shard, 200)
            assert await pusher.flush() is False  # the conductor failed: no exception
            conductor.failing = False
            # The lost batch is recovered by a resync: a snapshot holding both keys.
            await eventually(lambda: len(conductor.snapshots) == 2)
            assert sorted(conductor.snapshots[-1]["keys"]) == [100, 101, 200]
        finally:
            await pusher.close()
            await client.close()
            shard.close()


async def test_nothing_is_pushed_before_a_conductor_is_known():
    """With etcd a worker knows no conductor until etcd names the leader (its
    locator holds ""): the pusher waits, then snapshots to the leader once
    named, instead of trying node.conductor_url first."""
    from mooncaked.node.config import NodeConfig
    from mooncaked.node.context import NodeContext
    from mooncaked.node.sections import EtcdSection

    ctx = NodeContext(NodeConfig(etcd=EtcdSection(endpoints=["127.0.0.1:2379"])))
    assert ctx.conductor() == ""
    conductor = StandInConductor()
    shard = _shard()
    client = InternalClient.open()
    async with TestServer(conductor.app(), host="127.0.0.1") as server:
        pusher = CacheEventPusher(shard, client, ctx.conductor, "prefill-0", interval_s=0.02)
        try:
            pusher.start()
            _store_one_block(shard, 100)
            assert await pusher.flush() is False
            ctx.conductor.url = str(server.make_url("")).rstrip("/")   # etcd named the leader
            await eventually(lambda: len(conductor.snapshots) == 1)
            assert conductor.snapshots[0]["keys"] == [100]
        finally:
            await pusher.close()
            await client.close()
            shard.close()
