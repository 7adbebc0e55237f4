"""Cluster membership in one process (mooncaked/node/membership.py).

``NodeRegistry`` is driven with explicit clock values, so every alive/dead
boundary below is computed by hand from ``timeout_s``.  ``MembershipClient``
talks to a stand-in conductor: a small aiohttp app that keeps a real
``NodeRegistry`` and records every call it gets.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from mooncaked.local_cluster import free_port
from mooncaked.node.membership import ConductorUnreachable, MembershipClient, NodeRegistry
from mooncaked.node.messages import MessageError, NodeCapacity, NodeLoad, NodeRegistration


def info(node_id: str = "prefill-0", role: str = "prefill", **extra) -> dict:
    return {"node_id": node_id, "role": role, "url": f"http://127.0.0.1:1/{node_id}/", **extra}


@pytest.fixture
def registry():
    """A registry with a 5 s timeout and the list of events it emitted."""
    reg = NodeRegistry(timeout_s=5.0)
    reg.events = []
    reg.subscribe(lambda event, record: reg.events.append((event, record.node_id)))
    return reg


# ---- NodeRegistry ---------------------------------------------------------------

def test_alive_until_the_timeout_has_passed_then_dead_once(registry):
    registry.register(info(), now=100.0)
    assert registry.sweep(now=105.0) == []             # exactly timeout_s old: still alive
    assert [r.node_id for r in registry.alive()] == ["prefill-0"]
    dead = registry.sweep(now=105.01)
    assert [r.node_id for r in dead] == ["prefill-0"] and not dead[0].alive
    assert registry.sweep(now=200.0) == []             # newly dead only: reported once
    assert registry.alive() == [] and [r.node_id for r in registry.dead()] == ["prefill-0"]
    assert registry.events == [("joined", "prefill-0"), ("dead", "prefill-0")]


def test_heartbeats_move_the_deadline_and_carry_the_load(registry):
    registry.register(info(load={"queue_len": 1}), now=0.0)
    assert registry.heartbeat("prefill-0", {"queue_len": 7}, now=4.0) is True
    assert registry.sweep(now=9.0) == []               # 9 - 4 = 5: not older than timeout
    record = registry.get("prefill-0")
    assert record.load == NodeLoad(queue_len=7)
    assert record.last_seen == 4.0 and record.registered_at == 0.0
    assert record.to_dict(now=6.5)["seconds_since_heartbeat"] == 2.5
    assert [r.node_id for r in registry.sweep(now=9.5)] == ["prefill-0"]
    # A dead node's heartbeat is refused (it must register again), as is a stranger's.
    assert registry.heartbeat("prefill-0", {}, now=9.6) is False
    assert registry.heartbeat("nobody", {}, now=9.6) is False
    assert registry.get("prefill-0").last_seen == 4.0
    assert registry.events == [("joined", "prefill-0"), ("heartbeat", "prefill-0"),
                               ("dead", "prefill-0")]


def test_a_bad_load_report_is_refused_and_changes_nothing(registry):
    registry.register(info(), now=0.0)
    with pytest.raises(MessageError) as refused:
        registry.heartbeat("prefill-0", {"batch_size": "many"}, now=3.0)
    assert refused.value.field == "load.batch_size"
    assert registry.get("prefill-0").last_seen == 0.0
    assert registry.events == [("joined", "prefill-0")]


def test_sweep_only_kills_the_silent_nodes_and_alive_filters_by_role(registry):
    registry.register(info("prefill-0"), now=0.0)
    registry.register(info("decode-0", "decode"), now=0.0)
    registry.register(info("colo-0", "colocated"), now=3.0)
    registry.heartbeat("decode-0", {}, now=2.0)
    assert [r.node_id for r in registry.sweep(now=6.0)] == ["prefill-0"]
    assert [r.node_id for r in registry.alive("decode")] == ["decode-0"]
    assert registry.alive("prefill") == []
    assert {r.node_id for r in registry.alive()} == {"decode-0", "colo-0"}
    assert [r.node_id for r in registry.sweep(now=7.5)] == ["decode-0"]  # 7.5 - 2 > 5
    assert [r.node_id for r in registry.alive()] == ["colo-0"]


def test_reregistering_a_live_name_replaces_the_old_incarnation(registry):
    first = registry.register(info(capacity={"pages": 10}), now=0.0)
    second = registry.register(info(capacity={"pages": 20}), now=1.0)
    # The old record leaves (its cached blocks must be forgotten), then the new joins.
    assert registry.events == [("joined", "prefill-0"), ("left", "prefill-0"),
                               ("joined", "prefill-0")]
    assert registry.get("prefill-0") is second and second is not first
    assert second.capacity == NodeCapacity(pages=20) and second.registered_at == 1.0
    assert len(registry.alive()) == 1


def test_reregistering_after_death_joins_without_a_second_goodbye(registry):
    registry.register(info(), now=0.0)
    registry.sweep(now=10.0)
    record = registry.register(info(), now=11.0)
    assert registry.events == [("joined", "prefill-0"), ("dead", "prefill-0"),
                               ("joined", "prefill-0")]
    assert record.alive and registry.dead() == [] and registry.heartbeat("prefill-0", {}, 12.0)


def test_deregister_says_goodbye_only_for_live_nodes(registry):
    registry.register(info("a"), now=0.0)
    registry.register(info("b"), now=0.0)
    registry.sweep(now=1.0)
    registry.heartbeat("a", {}, now=4.0)
    registry.sweep(now=6.0)                              # b dead, a alive
    registry.events.clear()
    assert registry.deregister("a") is True and registry.deregister("b") is True
    assert registry.events == [("left", "a")]            # b's death was already announced
    assert registry.deregister("a") is False and registry.get("a") is None
    assert registry.alive() == [] and registry.dead() == []


@pytest.mark.parametrize("bad", [
    {"role": "prefill", "url": "http://x"},                      # no node_id
    {"node_id": "", "role": "prefill", "url": "http://x"},       # empty node_id
    {"node_id": "n", "role": "prefill", "url": 5},               # url not a string
    {"node_id": "n", "role": "conductor", "url": "http://x"},    # not a worker role
])
def test_bad_registrations_are_refused_and_change_nothing(registry, bad):
    with pytest.raises(ValueError):
        registry.register(bad, now=0.0)
    assert registry.events == [] and registry.alive() == [] and registry.dead() == []


def test_the_record_owns_copies_and_describes_itself(registry):
    capacity, transfer = {"pages": 4}, {"nics": [{"host": "10.0.0.1", "port": 7000}]}
    record = registry.register(info(capacity=capacity, transfer=transfer), now=0.0)
    capacity["pages"] = 99
    assert record.capacity == NodeCapacity(pages=4)
    assert record.url == "http://127.0.0.1:1/prefill-0"  # trailing slash dropped
    d = record.to_dict(now=0.25)
    assert d["transfer_endpoints"] == ["10.0.0.1:7000"] and d["alive"] is True
    assert d["capacity"] == {"pages": 4} and d["load"] == {}   # as the node sent them
    assert (d["node_id"], d["role"], d["seconds_since_heartbeat"]) == ("prefill-0", "prefill", 0.25)


# ---- MembershipClient against a stand-in conductor ------------------------------

class StandInConductor:
    """The three membership endpoints over a real NodeRegistry, recording calls."""

    def __init__(self, refuse: bool = False) -> None:
        self.registry = NodeRegistry(timeout_s=60.0)
        self.calls: list[tuple[str, dict, str | None]] = []
        self.refuse = refuse
        self.app = web.Application()
        for name in ("register", "heartbeat", "deregister"):
            self.app.router.add_post(f"/internal/nodes/{name}", getattr(self, name))

    def count(self, name: str) -> int:
        return sum(path == name for path, _, _ in self.calls)

    async def _record(self, request: web.Request, name: str) -> dict:
        body = await request.json()
        self.calls.append((name, body, request.headers.get("Authorization")))
        return body

    async def register(self, request: web.Request) -> web.Response:
        body = await self._record(request, "register")
        if self.refuse:
            return web.json_response({"error": {"message": "cluster is full"}}, status=400)
        self.registry.register(body, time.monotonic())
        return web.json_response({"node_id": body["node_id"]})

    async def heartbeat(self, request: web.Request) -> web.Response:
        body = await self._record(request, "heartbeat")
        if not self.registry.heartbeat(body["node_id"], body["load"], time.monotonic()):
            return web.json_response({"error": {"message": "register first"}}, status=404)
        return web.json_response({"ok": True})

    async def deregister(self, request: web.Request) -> web.Response:
        body = await self._record(request, "deregister")
        self.registry.deregister(body["node_id"])
        return web.json_response({"ok": True})


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def client_for(port: int, **kw) -> MembershipClient:
    loads = iter(range(1000))
    args = dict(conductor_url=f"http://127.0.0.1:{port}/",
                info_fn=lambda: NodeRegistration.from_wire(
                    info("decode-3", "decode", capacity={"pages": 8})),
                load_fn=lambda: NodeLoad(steps=next(loads)), interval_s=0.05, connect_timeout_s=5.0,
                token="tok")
    return MembershipClient(**{**args, **kw})


async def test_registers_once_the_conductor_comes_up_then_heartbeats():
    port = free_port()
    conductor = StandInConductor()
    client = client_for(port)
    t0 = time.monotonic()
    starting = asyncio.create_task(client.start())
    await asyncio.sleep(0.4)            # nothing listens yet: the client keeps retrying
    assert not starting.done() and not client.registered
    async with TestServer(conductor.app, port=port):
        await starting
        try:
            assert time.monotonic() - t0 >= 0.4 and client.registered
            assert conductor.count("register") == 1
            record = conductor.registry.get("decode-3")
            assert record.role == "decode" and record.capacity == NodeCapacity(pages=8)
            await wait_for(lambda: conductor.count("heartbeat") >= 3)
            beats = [body for name, body, _ in conductor.calls if name == "heartbeat"]
            # load_fn is asked afresh for every heartbeat.
            assert [b["load"] for b in beats[:3]] == [{"steps": n} for n in (0, 1, 2)]
            assert all(b["node_id"] == "decode-3" for b in beats)
            assert {auth for _, _, auth in conductor.calls} == {"Bearer tok"}
        finally:
            await client.close()
        assert [name for name, _, _ in conductor.calls][-1] == "deregister"
        assert conductor.registry.get("decode-3") is None
        calls = len(conductor.calls)
        await asyncio.sleep(0.2)        # the heartbeat loop is gone with close()
        assert len(conductor.calls) == calls


async def test_a_forgetful_conductor_gets_registered_again():
    conductor = StandInConductor()
    async with TestServer(conductor.app) as server:
        client = client_for(server.port)
        await client.start()
        try:
            await wait_for(lambda: conductor.count("heartbeat") >= 1)
            conductor.registry.deregister("decode-3")    # as after a conductor restart
            await wait_for(lambda: conductor.count("register") == 2)
            assert conductor.registry.get("decode-3").alive
            names = [name for name, _, _ in conductor.calls]
            # The refused heartbeat came right before the second registration.
            assert names[names.index("register", 1) - 1] == "heartbeat"
            beats = conductor.count("heartbeat")
            await wait_for(lambda: conductor.count("heartbeat") > beats + 1)
        finally:
            await client.close()


async def test_a_restarted_conductor_on_the_same_port_learns_of_the_node_again():
    port = free_port()
    first = StandInConductor()
    client = client_for(port)
    async with TestServer(first.app, port=port):
        await client.start()
    try:
        await asyncio.sleep(0.3)        # heartbeats fail meanwhile; the loop survives
        assert client._task is not None and not client._task.done()
        second = StandInConductor()
        async with TestServer(second.app, port=port):
            await wait_for(lambda: second.count("register") == 1)
            assert second.registry.get("decode-3").alive
            assert second.calls[0][0] == "heartbeat"     # refused: unknown here
    finally:
        await client.close()                             # deregister fails quietly


async def test_a_refusal_is_final_and_not_retried():
    conductor = StandInConductor(refuse=True)
    async with TestServer(conductor.app) as server:
        client = client_for(server.port, connect_timeout_s=30.0)
        t0 = time.monotonic()
        with pytest.raises(ConductorUnreachable, match=r"refused registration.*HTTP 400.*cluster is full"):
            await client.start()
        assert time.monotonic() - t0 < 5.0 and conductor.count("register") == 1
        await client.close()
        assert conductor.count("deregister") == 0        # never registered: no goodbye


async def test_no_conductor_within_the_deadline_is_reported():
    client = client_for(free_port(), connect_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(ConductorUnreachable, match="cannot reach conductor .* within 0.5s"):
        await client.start()
    assert 0.5 <= time.monotonic() - t0 < 3.0 and not client.registered
    await client.close()
