"""A request's way to an end state, with in-process engines: waiting for a
path spends no attempt and ends at the deadline, a failing resolver fails
the request, a cancelled transfer leaves no batch behind, and the tables a
long-running engine keeps per peer or path stay bounded."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator

import pytest

from rdma import frames
from rdma.config import TransferConfig
from rdma.endpoint import EndpointError
from rdma.engine import TransferEngine
from rdma.slices import PathHealth
from rdma.types import WRITE, TransferError, TransferRequest, TransferState
from tests.waiting import eventually

LOOP = "127.0.0.1"
PATH = (LOOP, LOOP)  # the only path between two loopback engines
SIZE = 3 * 4096 + 7



@contextlib.asynccontextmanager
async def pair(**kw) -> AsyncIterator[tuple[TransferEngine, TransferEngine, bytearray, bytearray]]:
    """Engine A (config ``kw``) knowing engine B; A's ``src`` (a pattern) and B's ``dst`` (zeros)."""
    cfg = TransferConfig(transport="tcp", slice_bytes=4096, **kw)
    async with TransferEngine(cfg, "A") as a, TransferEngine(TransferConfig(transport="tcp"), "B") as b:
        src, dst = bytearray(i % 251 for i in range(SIZE)), bytearray(SIZE)
        a.register_local_memory(src)
        b.register_local_memory(dst)
        a.add_segment(b.segment_descriptor())
        yield a, b, src, dst


WRITE_ALL = TransferRequest(WRITE, 0, 0, SIZE, "B", 0)


async def run_one(eng: TransferEngine, req: TransferRequest, timeout: float = 10):
    """The batch API's view of one request: submit, wait, status."""
    bid = eng.allocate_batch(1)
    await eng.submit_transfer(bid, [req])
    await eng.wait(bid, timeout=timeout)
    st = eng.transfer_status(bid, 0)
    if st.done:
        eng.free_batch(bid)
    return st


# -- waiting for a path ---------------------------------------------------------

async def test_waiting_for_a_path_spends_no_attempt(monkeypatch):
    """``choose`` finds no path more often than a slice has attempts: the
    slices wait instead of failing, then complete once the path opens."""
    async with pair(max_retries=2) as (a, _b, src, dst):
        refusals = {"left": 4 * (a.config.max_retries + 1) * 4}  # several per slice, more than its attempts
        real = a.paths.choose

        def stubborn(*args, **kw):
            if refusals["left"]:
                refusals["left"] -= 1
                return None
            return real(*args, **kw)

        monkeypatch.setattr(a.paths, "choose", stubborn)
        await a.transfer([WRITE_ALL])
        assert dst == src and refusals["left"] == 0
        assert a.retries == 0  # nothing failed, so nothing was re-posted


async def test_path_that_never_reopens_times_out_at_the_deadline():
    """Another slice probes the only path and never answers: the request
    ends in TIMEOUT at request_timeout_s, not FAILED after a few short waits."""
    async with pair(request_timeout_s=0.5) as (a, _b, _src, dst):
        a.paths.health[("B", PATH)] = PathHealth(failures=1, probing=True, last_reason="down")
        st = await run_one(a, WRITE_ALL)
        assert st.state == TransferState.TIMEOUT, st
        assert "request_timeout_s=0.5" in st.reason and not any(dst)


async def test_end_of_a_probe_wakes_the_waiting_slices():
    async with pair(request_timeout_s=10) as (a, _b, src, dst):
        a.paths.health[("B", PATH)] = PathHealth(failures=1, probing=True, last_reason="down")
        task = asyncio.create_task(a.transfer([WRITE_ALL]))
        await asyncio.sleep(0.1)  # longer than max_retries+1 short waits
        assert not task.done()
        a.paths.success("B", PATH)  # the other slice's probe got through
        await asyncio.wait_for(task, 5)
        assert dst == src


async def test_probe_that_fails_without_a_charge_is_given_back(monkeypatch):
    """A probe slice whose endpoint failed for a reason not charged to the
    path (another request's cancellation aborted the shared connection)
    must not leave the path marked as probing: nobody would try it again."""
    async with pair(request_timeout_s=3) as (a, _b, src, dst):
        a.paths.health[("B", PATH)] = PathHealth(failures=1, until=0.0, last_reason="down")
        conns = a._connections
        real = conns.endpoint
        fails = {"left": 1}

        async def endpoint(desc, path):
            if fails["left"]:
                fails["left"] -= 1
                raise EndpointError("request cancelled or timed out")  # an abort with penalize=False
            return await real(desc, path)

        monkeypatch.setattr(conns, "endpoint", endpoint)
        st = await run_one(a, WRITE_ALL)
        assert st.state == TransferState.COMPLETED, st
        assert dst == src and ("B", PATH) not in a.paths.health
        assert a.retries == 1  # the one failed post was re-posted once


# -- resolver failures ------------------------------------------------------------

def _malformed(b: TransferEngine) -> dict:
    wire = b.segment_descriptor()
    wire["nics"][0]["port"] = "x"
    return wire


@pytest.mark.parametrize("answer, says", [
    ("lookup", "LookupError: segment 'B' unknown to the conductor (HTTP 404)"),
    ("malformed", "ValueError: segment.nics[0].port: expected an integer"),
], ids=["lookup", "malformed"])
async def test_failing_resolver_fails_the_request(answer, says):
    cfg = TransferConfig(transport="tcp")
    async with TransferEngine(cfg, "A") as a, TransferEngine(cfg, "B") as b:
        b.register_local_memory(bytearray(64))
        r = a.register_local_memory(bytearray(64))

        async def resolve(name):
            if answer == "lookup":
                raise LookupError(f"segment {name!r} unknown to the conductor (HTTP 404)")
            return _malformed(b)

        a.set_resolver(resolve)
        req = TransferRequest(WRITE, r.id, 0, 64, "B", 0)
        with pytest.raises(TransferError) as e:
            await a.transfer([req])
        [st] = e.value.statuses
        assert st.state == TransferState.FAILED and "'B'" in st.reason and says in st.reason, st
        st = await run_one(a, req)
        assert st.state == TransferState.FAILED and says in st.reason, st


async def test_hanging_resolver_still_times_out():
    """The resolver's failures are caught, the deadline's cancellation is not."""
    async with TransferEngine(TransferConfig(transport="tcp", request_timeout_s=0.3), "A") as a:
        r = a.register_local_memory(bytearray(64))

        async def resolve(name):
            await asyncio.Event().wait()

        a.set_resolver(resolve)
        st = await run_one(a, TransferRequest(WRITE, r.id, 0, 64, "B", 0))
        assert st.state == TransferState.TIMEOUT, st


# -- the batch table ---------------------------------------------------------------

def segment_wire(name: str, length: int, port: int) -> dict:
    """A one-region tcp segment at ``LOOP:port``, in wire form."""
    return {"name": name, "transport": "tcp",
            "regions": [{"id": 0, "length": length, "location": "cpu:0"}],
            "nics": [{"name": LOOP, "host": LOOP, "port": port}],
            "topology": {"*": [[LOOP], []]}}


class SilentPeer:
    """A segment that takes connections, shakes hands and reads what it is
    sent, but never acknowledges anything."""

    def __init__(self, name: str, length: int) -> None:
        self.name, self.length = name, length
        self.sock = socket.create_server((LOOP, 0))
        self.got_bytes = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                frames.server_handshake(conn, "", self.name)
                while conn.recv(1 << 16):
                    self.got_bytes.set()
            except (OSError, frames.FrameError):
                pass

    def descriptor(self) -> dict:
        return segment_wire(self.name, self.length, self.sock.getsockname()[1])

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("how", ["cancel", "caller_timeout"])
async def test_cancelled_transfer_leaves_no_batch(how):
    peer = SilentPeer("S", 1 << 20)
    try:
        async with TransferEngine(TransferConfig(transport="tcp"), "A") as a:
            a.add_segment(peer.descriptor())
            r = a.register_local_memory(bytearray(1 << 20))
            req = TransferRequest(WRITE, r.id, 0, 1 << 20, "S", 0)
            if how == "cancel":
                task = asyncio.create_task(a.transfer([req]))
                assert await asyncio.to_thread(peer.got_bytes.wait, 5)  # mid-flight
                assert a.stats()["batches"] == 1
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.3):
                        await a.transfer([req])
            await eventually(lambda: a.stats()["batches"] == 0)
            bid = a.allocate_batch(1)  # the batch API's own batches are the caller's to free
            assert a.stats()["batches"] == 1
            a.free_batch(bid)
            assert a.stats()["batches"] == 0
    finally:
        peer.close()


async def test_a_cancelled_requester_does_not_fail_the_requests_sharing_its_connect():
    """Two transfers wait on one connect to B; the one that opened it is
    cancelled while it is still connecting.  The other was not cancelled:
    it connects anew and completes, rather than ending "cancelled"."""
    async with pair(request_timeout_s=10) as (a, _b, src, dst):
        conns = a._connections
        real = conns._new_endpoint
        opened = asyncio.Event()
        gate = asyncio.Event()

        def gated(desc, path):
            ep = real(desc, path)
            if not opened.is_set():   # only the first connect hangs
                opened.set()
                connect = ep.connect

                async def slow_connect():
                    await gate.wait()
                    await connect()
                ep.connect = slow_connect
            return ep

        conns._new_endpoint = gated
        first = asyncio.create_task(a.transfer([WRITE_ALL]))
        await asyncio.wait_for(opened.wait(), 5)
        second = asyncio.create_task(a.transfer([WRITE_ALL]))
        await asyncio.sleep(0.05)     # its slices now wait on the first's connect
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        gate.set()
        await asyncio.wait_for(second, 10)
        assert dst == src


async def test_a_slice_that_ends_cancelled_fails_the_request_not_completes_it(monkeypatch):
    """A slice whose post raised CancelledError without the request being
    cancelled (a shared wait cancelled under it) ends its task group with no
    error: the request must still not report COMPLETED with bytes missing."""
    async with pair(request_timeout_s=5) as (a, _b, _src, dst):
        runner = a._runner
        real = runner._post
        hit = {"left": 1}

        async def post(st, desc, local, s, path):
            if hit["left"]:
                hit["left"] -= 1
                raise asyncio.CancelledError()
            return await real(st, desc, local, s, path)

        monkeypatch.setattr(runner, "_post", post)
        st = await run_one(a, WRITE_ALL)
        assert st.state == TransferState.FAILED and "not acknowledged" in st.reason, st


# -- bounded tables ---------------------------------------------------------------

async def test_in_flight_counts_do_not_outlive_the_traffic():
    async with pair() as (a, _b, src, dst):
        await a.transfer([WRITE_ALL])
        assert dst == src
        assert a.paths.inflight == {}


async def test_gone_segment_leaves_no_path_state():
    """A peer that went away: its path's health record and slot semaphore are
    dropped once its back-off is long over and nothing uses it."""
    closed = socket.create_server((LOOP, 0))
    gone = segment_wire("G", 4096, closed.getsockname()[1])
    closed.close()  # nothing listens there any more: connects are refused
    cfg = TransferConfig(transport="tcp", nic_backoff_s=0.05, nic_backoff_max_s=0.1, stall_timeout_s=0.4,
                         max_retries=0)
    async with TransferEngine(cfg, "A") as a:
        a.add_segment(gone)
        r = a.register_local_memory(bytearray(4096))
        st = await run_one(a, TransferRequest(WRITE, r.id, 0, 4096, "G", 0))
        assert st.state == TransferState.FAILED, st
        assert ("G", PATH) in a.paths.health
        await eventually(lambda: not a.paths.health and not a._connections._slots)


async def test_resolved_descriptors_are_bounded():
    """Descriptors fetched through the resolver are a cache bounded by
    max_endpoints; an evicted one is simply asked for again."""
    cfg = TransferConfig(transport="tcp", max_endpoints=2)
    async with TransferEngine(cfg, "A") as a, TransferEngine(TransferConfig(transport="tcp"), "B") as b:
        b.register_local_memory(bytearray(64))
        r = a.register_local_memory(bytearray(64))
        asked: list[str] = []

        async def resolve(name):
            asked.append(name)
            return {**b.segment_descriptor(), "name": name}

        a.set_resolver(resolve)
        names = [f"P{i}" for i in range(6)]
        for name in names + names[:1]:
            await a.transfer([TransferRequest(WRITE, r.id, 0, 0, name, 0)])  # resolves, moves nothing
            assert len(a._directory) <= 2
        assert asked == names + names[:1]


# -- a peer's topology ------------------------------------------------------------

@pytest.mark.parametrize("row, state", [
    ([[], [LOOP]], TransferState.COMPLETED),  # no preferred nic: the secondary one serves
    ([[], []], TransferState.FAILED),         # no nic at all for that memory
], ids=["secondary_only", "no_nic"])
async def test_peer_topology_without_preferred_nics(row, state):
    async with pair() as (a, b, src, dst):
        a.add_segment({**b.segment_descriptor(), "topology": {"*": row}})
        st = await run_one(a, WRITE_ALL)
        assert st.state == state, st
        assert (dst == src) == (state == TransferState.COMPLETED)
        if state == TransferState.FAILED:
            assert "no path" in st.reason and "'B'" in st.reason, st
