"""Fault matrix, transfer row in one process: the peer restarted under the
same segment name, listening on new ports (a decode node restarted by
``mooncaked up``).  The first WRITE after the restart reaches the new
listener: a connect refused by the stale descriptor drops it, the slices
stop posting to the old address (each refusal would double the path's
back-off, up to ``nic_backoff_max_s``, past the request's deadline), and the
request, with nothing moved, is run once more against a fresh lookup.
(tests/test_faults_kill.py shows the same on a real cluster.)"""

from __future__ import annotations

import asyncio
import socket

import pytest

from rdma.config import TransferConfig
from rdma.connections import Connections
from rdma.directory import SegmentDirectory
from rdma.endpoint import EndpointError
from rdma.engine import TransferEngine
from rdma.types import WRITE, TransferError, TransferRequest, TransferState

SIZE = 256 << 10


def engine(name: str) -> TransferEngine:
    return TransferEngine(TransferConfig(transport="tcp", slice_bytes=64 << 10, request_timeout_s=10,
                                         nic_backoff_s=0.05, connect_timeout_s=1), name)


async def test_a_write_after_the_peer_restarted_elsewhere_lands_on_the_new_peer():
    current: dict = {}

    async def resolver(name: str):  # the conductor's lookup: the latest registration
        return current.get(name)

    src = bytearray(b"\x5a" * SIZE)
    async with engine("prefill") as sender:
        sender.set_resolver(resolver)
        region = sender.register_local_memory(src)
        write = [TransferRequest(WRITE, region.id, 0, SIZE, "decode", 0)]
        old_target = bytearray(SIZE)
        async with engine("decode") as old:
            old.register_local_memory(old_target)
            current["decode"] = old.segment_descriptor()
            await sender.transfer(write)  # raises TransferError naming a failure
        assert old_target == src
        # The peer is gone (its ports closed); a new one registers under its name.
        new_target = bytearray(SIZE)
        async with engine("decode") as new:
            new.register_local_memory(new_target)
            current["decode"] = new.segment_descriptor()
            src[:] = b"\xa5" * SIZE
            await sender.transfer(write)
        assert new_target == src


async def test_a_connect_to_the_old_address_neither_serves_nor_drops_the_new_registration():
    """The race behind a 502 after a decode node's restart (clean-clone CI):
    one request still connecting to the stale address while another already
    holds the peer's new descriptor.  The new one gets its own connection,
    and the stale connect's failure leaves the new descriptor in place."""
    silent = socket.socket()  # the old address: accepts, never answers the handshake
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    cfg = TransferConfig(transport="tcp", connect_timeout_s=1, nic_backoff_s=0.05)
    directory = SegmentDirectory()
    current: dict = {}

    async def resolver(name: str):
        return current.get(name)

    directory.set_resolver(resolver)
    conns = Connections(cfg, directory)
    conns.start(asyncio.get_running_loop(), None)
    path = ("127.0.0.1", "127.0.0.1")
    try:
        async with engine("decode") as new:
            new.register_local_memory(bytearray(SIZE))
            fresh_wire = new.segment_descriptor()
            stale_wire = {**fresh_wire, "nics": [{**fresh_wire["nics"][0],
                                                  "port": silent.getsockname()[1]}]}
            current["decode"] = stale_wire
            stale = await directory.resolve("decode")
            old_connect = asyncio.create_task(conns.endpoint(stale, path))
            await asyncio.sleep(0.2)  # connected at TCP level, waiting for the handshake
            assert not old_connect.done()
            current["decode"] = fresh_wire
            directory.add(fresh_wire)  # another request looked the peer up again
            fresh = await directory.resolve("decode")
            ep = await conns.endpoint(fresh, path)
            assert ep.failed is None and ep.descriptor == fresh
            with pytest.raises(EndpointError):
                await old_connect
            assert directory.holds(fresh)
            assert await directory.resolve("decode") == fresh
            # A request still holding the stale descriptor is told at once.
            with pytest.raises(EndpointError, match="registered again"):
                await conns.endpoint(stale, path)
    finally:
        conns.close()
        silent.close()


async def test_a_connect_lost_on_the_way_is_retried_when_the_peer_is_where_it_was(monkeypatch):
    """Under packet loss a connect can time out (its SYN dropped) although the
    peer never moved: the failed connect drops the descriptor, the lookup
    names the same one again, and the slice is posted once more instead of
    failing the request (a 502 in test_faults_netns's 5% loss row)."""
    from rdma.tcp import TcpEndpoint

    real_connect = TcpEndpoint.connect
    failed: list[str] = []

    async def connect_lost_once(self):
        if not failed:
            failed.append(self.remote_host)
            raise EndpointError("connect timed out (a lost SYN)")
        return await real_connect(self)

    monkeypatch.setattr(TcpEndpoint, "connect", connect_lost_once)
    current: dict = {}

    async def resolver(name: str):
        return current.get(name)

    src = bytearray(b"\x3c" * SIZE)
    target = bytearray(SIZE)
    async with engine("prefill") as sender, engine("decode") as peer:
        sender.set_resolver(resolver)
        region = sender.register_local_memory(src)
        peer.register_local_memory(target)
        current["decode"] = peer.segment_descriptor()
        await sender.transfer([TransferRequest(WRITE, region.id, 0, SIZE, "decode", 0)])
    assert failed and target == src


async def test_the_back_off_of_a_restarted_peers_old_address_does_not_hold_up_the_new_one():
    """A connect refused at the old address puts the path in back-off; the
    peer's new registration starts without that history, and connects that
    still fail at the old address after the lookup found the new one are not
    charged to it.  With a back-off far past the request deadline, writes
    that waited it out would time out instead of landing."""
    current: dict = {}

    async def resolver(name: str):
        return current.get(name)

    src = bytearray(b"\x77" * SIZE)
    patient = TransferConfig(transport="tcp", slice_bytes=64 << 10, request_timeout_s=5,
                             nic_backoff_s=600, nic_backoff_max_s=600, connect_timeout_s=1)
    async with TransferEngine(patient, "prefill") as sender:
        sender.set_resolver(resolver)
        region = sender.register_local_memory(src)
        async with engine("decode") as old:
            old.register_local_memory(bytearray(SIZE))
            current["decode"] = old.segment_descriptor()
            await sender.transfer([TransferRequest(WRITE, region.id, 0, SIZE, "decode", 0)])
        target = bytearray(SIZE)
        async with engine("decode") as new:
            new.register_local_memory(target)
            current["decode"] = new.segment_descriptor()
            quarter = SIZE // 4
            # Four requests at once: each slice first meets the stale address.
            await asyncio.gather(*(sender.transfer([TransferRequest(WRITE, region.id, i * quarter, quarter,
                                                                    "decode", i * quarter)])
                                   for i in range(4)))
            assert target == src
            assert not sender.paths.health  # nothing of the old address is held against the path


async def test_a_deadline_after_the_retry_on_a_new_address_is_reported_as_a_timeout():
    """The request's retry against the peer's new registration runs in the
    same task as its first try, whose slices failed.  That first failure
    must leave the task uncancelled (Python 3.11's TaskGroup cancels it and
    never takes that back), or the deadline during the retry ends the
    request as "cancelled" instead of TIMEOUT (a 502 "... cancelled" after
    a decode node's restart)."""
    refused = socket.socket()  # the old address: closed, refuses connects
    refused.bind(("127.0.0.1", 0))
    refused_port = refused.getsockname()[1]
    refused.close()
    silent = socket.socket()   # the new address: accepts, never answers the handshake
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    lookups: list[str] = []
    try:
        async with engine("decode") as peer:
            peer.register_local_memory(bytearray(SIZE))
            wire = peer.segment_descriptor()
        old = {**wire, "nics": [{**wire["nics"][0], "port": refused_port}]}
        new = {**wire, "nics": [{**wire["nics"][0], "port": silent.getsockname()[1]}]}

        async def resolver(name: str):
            lookups.append(name)
            return old if len(lookups) == 1 else new

        cfg = TransferConfig(transport="tcp", slice_bytes=64 << 10, request_timeout_s=1.5,
                             nic_backoff_s=0.05, connect_timeout_s=30)
        async with TransferEngine(cfg, "prefill") as sender:
            sender.set_resolver(resolver)
            region = sender.register_local_memory(bytearray(SIZE))
            with pytest.raises(TransferError) as err:
                await sender.transfer([TransferRequest(WRITE, region.id, 0, SIZE, "decode", 0)])
        (status,) = err.value.statuses
        assert len(lookups) >= 2, status  # the retry ran against the new address
        assert status.state == TransferState.TIMEOUT, status
        assert "request_timeout_s" in status.reason
    finally:
        silent.close()
