"""Leader election and node leases against a real etcd (started from PATH).

A crashed candidate is simulated by cancelling its tasks without revoking its
lease (what kill -9 leaves behind): its keys must go away by lease expiry
alone, and the other candidate must take over."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from mooncaked.etcd_process import EtcdProcess, find_etcd
from mooncaked.node.discovery import EtcdDiscovery
from mooncaked.node.election import LeaderElection, new_incarnation
from mooncaked.node.etcd_store import ConductorRecord, EtcdStore, EtcdUnavailable
from mooncaked.node.messages import NodeCapacity, NodeRegistration
from mooncaked.node.sections import EtcdSection
from mooncaked.node.tasks import cancel_and_wait
from tests.waiting import eventually

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(find_etcd() is None,
                                 reason="etcd not found: apt-get install etcd-server")]

TTL = 2


@pytest.fixture
def etcd(tmp_path):
    proc = EtcdProcess(tmp_path / "etcd-data", tmp_path / "etcd.log")
    proc.start()
    yield proc
    proc.kill()


def section(etcd: EtcdProcess, cluster: str = "t") -> EtcdSection:
    return EtcdSection(endpoints=[etcd.endpoint], lease_ttl_s=TTL, cluster=cluster)


def candidate(etcd: EtcdProcess, name: str) -> LeaderElection:
    me = ConductorRecord(conductor_id=name, url=f"http://{name}:1", incarnation=new_incarnation())
    return LeaderElection(EtcdStore(section(etcd)), me, TTL)


async def crash(election: LeaderElection) -> None:
    """Like kill -9: stop renewing, revoke nothing."""
    for task in election._tasks:
        await cancel_and_wait(task)
    election.is_leader = False
    await election.store.close()


async def test_one_leader_and_a_standby_takes_over_on_lease_expiry(etcd):
    a, b = candidate(etcd, "a"), candidate(etcd, "b")
    a.start()
    await eventually(lambda: a.is_leader, 10)
    b.start()
    await eventually(lambda: b.leader is not None, 10)
    assert not b.is_leader and b.leader == a.me and b.reachable
    killed = time.monotonic()
    await crash(a)
    await eventually(lambda: b.is_leader, TTL + 8)
    print(f"\nstandby leads {time.monotonic() - killed:.2f}s after the leader stopped "
          f"renewing (lease TTL {TTL}s)")
    store = EtcdStore(section(etcd))
    try:
        assert await store.get(store.keys.leader) is not None
        names = {k.rsplit(b"/", 1)[1] for k, _ in await store.get_prefix(store.keys.conductors)}
        assert b"b" in names
    finally:
        await store.close()
    await b.close()


async def test_a_graceful_leader_hands_over_at_once_and_a_namesake_is_not_fooled(etcd):
    a, b = candidate(etcd, "a"), candidate(etcd, "b")
    a.start()
    await eventually(lambda: a.is_leader, 10)
    b.start()
    await eventually(lambda: b.leader == a.me, 10)
    await a.close()  # revokes: no TTL to wait out
    await eventually(lambda: b.is_leader, 5)
    # A restarted "b" (same id, new incarnation) must not take b's key for its own.
    b2 = candidate(etcd, "b")
    b2.start()
    await eventually(lambda: b2.leader is not None, 10)
    assert b2.leader == b.me and not b2.is_leader
    await b2.close()
    await b.close()


async def test_node_record_lives_under_its_lease(etcd):
    store = EtcdStore(section(etcd))
    reader = EtcdStore(section(etcd))
    leaders: list[ConductorRecord] = []
    reg = NodeRegistration(node_id="prefill-7", role="prefill", url="http://127.0.0.1:9",
                           capacity=NodeCapacity(pages=4),
                           transfer={"name": "prefill-7", "nics": [{"host": "127.0.0.1", "port": 5}]})
    elector = candidate(etcd, "c")
    elector.start()
    await eventually(lambda: elector.is_leader, 10)
    node = EtcdDiscovery(store, lambda: reg, TTL, leaders.append)
    assert (await node.start(5)) == elector.me
    raw = await reader.get(reader.keys.node("prefill-7"))
    assert raw is not None and NodeRegistration.from_wire(orjson.loads(raw)) == reg
    # The node dies without a word: its record outlives it by at most a TTL or so.
    for task in node._tasks:
        await cancel_and_wait(task)
    died = time.monotonic()
    while await reader.get(reader.keys.node("prefill-7")) is not None:
        assert time.monotonic() - died < TTL + 8, "node record outlived its lease"
        await asyncio.sleep(0.1)
    print(f"\nnode record gone {time.monotonic() - died:.2f}s after the last renewal (TTL {TTL}s)")
    await store.close()
    await reader.close()
    await elector.close()


async def test_a_loop_woken_as_it_is_stopped_still_stops(etcd):
    """A wake-up (the leader key changed) arriving with the cancellation, as
    when a node stops while the conductors do: asyncio.wait_for (Python 3.11)
    swallowed the cancel, the loop ran on and the node's shutdown hung."""
    elector = candidate(etcd, "c")
    elector.start()
    await eventually(lambda: elector.is_leader, 10)
    reg = NodeRegistration(node_id="prefill-8", role="prefill", url="http://127.0.0.1:9",
                           transfer={})
    node = EtcdDiscovery(EtcdStore(section(etcd)), lambda: reg, TTL, lambda leader: None)
    await node.start(5)
    for looping in (node, elector):
        task = looping._tasks[0]  # the presence / campaign loop
        await asyncio.sleep(0.05)
        looping._wake.set()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=3)
        assert done, f"{task.get_name()} still running 3 s after it was cancelled"
    await node.close()
    await elector.close()


async def test_etcd_down_then_back(etcd):
    a = candidate(etcd, "a")
    a.start()
    await eventually(lambda: a.is_leader and a.reachable, 10)
    etcd.kill()
    # A round fails within a call timeout (1 s) plus the channel's close (1 s)
    # after the kill; on the 2-core CI machine, under the full suite, that took
    # over 5 s: a generous bound, not a speed check.
    await eventually(lambda: not a.reachable, 15)
    assert "etcd" in a.status()["last_error"]
    await eventually(lambda: not a.is_leader, TTL + 5)  # no renewal for a TTL: no claim
    etcd.start()
    back = time.monotonic()
    await eventually(lambda: a.reachable and a.is_leader, 20)
    print(f"\nleader again {time.monotonic() - back:.2f}s after etcd came back")
    await a.close()


async def test_a_new_connection_does_not_inherit_a_failed_ones_backoff(etcd):
    """A channel whose close timed out under load stays open, retrying a
    dead etcd with a growing backoff.  gRPC shares subchannels by target
    process-wide, so the connection made after the failure inherited that
    backoff and refused calls ("failed to connect to all addresses") for
    seconds after etcd was back (a conductor stayed etcd_unreachable for
    over 20 s in a CI run).  Each connection has subchannels of its own."""
    old = EtcdStore(section(etcd))
    await old.put(b"k", b"v")
    stuck = old._connection()  # never closed
    etcd.kill()
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline:  # bounded: about 12 s of failing calls
        with pytest.raises(Exception):
            async with asyncio.timeout(1.0):
                await stuck.get(b"k")
        await asyncio.sleep(0.2)
    etcd.start()
    fresh = EtcdStore(EtcdSection(endpoints=[etcd.endpoint], request_timeout_s=5.0))
    assert await fresh.get(b"k") == b"v"  # the first call, not a retry
    await fresh.close()
    await old.close()


async def test_a_call_whose_connection_another_caller_drops_fails_as_unavailable(etcd):
    """gRPC ends a call whose channel is closed meanwhile with CancelledError.
    A failed watch used to close the connection the campaign round was using,
    and that CancelledError ended the campaign task for good: the conductor
    stayed etcd_unreachable after etcd was back (seen in CI and here).  The
    call must fail like any other, leaving the caller's task running."""
    store = EtcdStore(section(etcd))
    await store.put(b"k", b"v")
    call = asyncio.create_task(store.get(b"k"))
    await asyncio.sleep(0)  # the call is in flight on the shared connection
    await store._drop_connection(store._client)  # what another caller's failure does
    with pytest.raises(EtcdUnavailable, match="closed under it"):
        await call
    assert await store.get(b"k") == b"v"  # a new connection serves the next call
    await store.close()


async def test_a_watch_survives_another_callers_dropped_connection(etcd):
    """The watch has a connection of its own: a call failing elsewhere (which
    drops the shared connection) does not break it."""
    store = EtcdStore(section(etcd))
    await store.put(b"w", b"0")

    async def first_change() -> None:
        async for _ in store.changes(b"w"):
            return
    watch = asyncio.create_task(first_change())
    await asyncio.sleep(0.2)  # let the watch open (a missed put is retried below)
    await store._drop_connection(store._client)
    for n in range(100):  # bounded: about 10 s of puts until the watch reports one
        if watch.done():
            break
        await store.put(b"w", str(n).encode())
        await asyncio.sleep(0.1)
    assert watch.done() and watch.exception() is None, watch
    await store.close()


async def test_a_leader_stuck_on_an_etcd_that_does_not_answer_stops_leading_after_a_ttl(etcd):
    """etcd stopped (SIGSTOP: connections open, no answers) and calls allowed
    30 s: the round hangs in the renewal, yet the claim ends a TTL after the
    last renewal, not when the call gives up."""
    import signal

    me = ConductorRecord(conductor_id="a", url="http://a:1", incarnation=new_incarnation())
    a = LeaderElection(EtcdStore(EtcdSection(endpoints=[etcd.endpoint], lease_ttl_s=TTL,
                                             cluster="t", request_timeout_s=30.0)), me, TTL)
    a.start()
    await eventually(lambda: a.is_leader, 10)
    etcd.proc.send_signal(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        await eventually(lambda: not a.is_leader, TTL + 2)
        print(f"\nno longer leading {time.monotonic() - stopped:.2f}s after etcd stopped answering")
    finally:
        etcd.proc.send_signal(signal.SIGCONT)
    await eventually(lambda: a.is_leader, 40)   # the stuck call returns, the lease is renewed
    await a.close()


async def test_no_etcd_at_all_is_reported_not_raised(tmp_path):
    dead = EtcdSection(endpoints=["127.0.0.1:1"], lease_ttl_s=TTL, request_timeout_s=0.5)
    me = ConductorRecord(conductor_id="x", url="http://x:1", incarnation=new_incarnation())
    election = LeaderElection(EtcdStore(dead), me, TTL)
    election.start()
    await asyncio.sleep(1.0)
    assert not election.reachable and not election.is_leader
    assert "127.0.0.1:1" in election.status()["last_error"]
    await election.close()


async def test_status_says_campaigning_until_the_first_round_ends_then_unreachable():
    """A conductor just started has not failed to reach etcd yet: its status
    says "campaigning", not "etcd_unreachable", until its first round ends."""
    from mooncaked.local_cluster import free_port

    dead = EtcdSection(endpoints=[f"127.0.0.1:{free_port()}"], lease_ttl_s=TTL, cluster="t",
                       request_timeout_s=0.3)
    me = ConductorRecord(conductor_id="a", url="http://a:1", incarnation=new_incarnation())
    election = LeaderElection(EtcdStore(dead), me, TTL)
    assert election.role == "campaigning"
    election.start()
    try:
        await eventually(lambda: election.role == "etcd_unreachable", 10)
        assert not election.is_leader and election.status()["last_error"]
    finally:
        await election.close()
