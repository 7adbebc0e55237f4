"""Per-reservation WRITE capabilities on the tcp transport (issue 15, item 3).

A region registered with a write guard (``rdma/guard.py``'s ``PageGrants``
here) takes a WRITE only when the frame's capability grants every page the
WRITE touches; anything else is answered with a refusal before a byte of
the region is touched, and the sender's request ends FAILED naming it.
Real engines and sockets in one process; a raw socket plays the slow or
hostile sender where the engine would not.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator

import pytest

from rdma import frames
from rdma.config import TransferConfig
from rdma.engine import TransferEngine
from rdma.guard import PageGrants
from rdma.types import READ, WRITE, TransferError, TransferRequest
from tests.waiting import eventually

PAGE = 4096
PAGES = 8
SIZE = PAGES * PAGE



@contextlib.asynccontextmanager
async def guarded_pair(**kw) -> AsyncIterator[tuple[TransferEngine, TransferEngine, PageGrants, bytearray]]:
    """Sender A (config ``kw``, source region 0 = a pattern) and target B whose
    region 0 (zeros, ``PAGES`` pages of ``PAGE`` bytes) is guarded by the grants."""
    cfg = TransferConfig(transport="tcp", **{"slice_bytes": 2 * PAGE, **kw})
    async with TransferEngine(cfg, "A") as a, TransferEngine(TransferConfig(transport="tcp"), "B") as b:
        src, dst = bytearray(i % 251 for i in range(SIZE)), bytearray(SIZE)
        a.register_local_memory(src)
        grants = PageGrants(PAGE)
        b.register_local_memory(dst, write_guard=grants)
        a.add_segment(b.segment_descriptor())
        yield a, b, grants, dst


def write_pages(first: int, n: int, capability: int, src_page: int = 0) -> TransferRequest:
    return TransferRequest(WRITE, 0, src_page * PAGE, n * PAGE, "B", first * PAGE, capability=capability)


# -- frames -------------------------------------------------------------------

def test_capability_rides_in_a_tagged_header_extension():
    key = b"k" * 32
    cap = 0xDEADBEEF_01234567
    h = frames.pack_header(key, frames.OP_WRITE, 3, 1 << 33, 4096, 7, capability=cap)
    assert len(h) == frames.HEADER_SIZE + frames.CAPABILITY_SIZE
    assert frames.unpack_frame(key, h)[:7] == (frames.OP_WRITE, 0, 3, 1 << 33, 4096, 7, cap)
    assert frames.unpack_frame(key, h).capability == cap
    assert frames.unpack_header(key, h) == (frames.OP_WRITE, 0, 3, 1 << 33, 4096, 7)
    # Without a capability the header is the plain one, capability 0.
    plain = frames.pack_header(key, frames.OP_WRITE, 3, 0, 16, 1)
    assert len(plain) == frames.HEADER_SIZE and frames.unpack_frame(key, plain).capability == 0
    # The capability is covered by the tag: one bit changed is a bad frame ...
    bad = bytearray(h)
    bad[-1] ^= 1
    with pytest.raises(frames.FrameError, match="tag"):
        frames.unpack_frame(key, bytes(bad))
    # ... and so is stripping the extension (the flag is under the tag too).
    with pytest.raises(frames.FrameError):
        frames.unpack_frame(key, h[:frames.HEADER_SIZE])
    stripped = bytearray(h[:frames.HEADER_SIZE])
    stripped[6] = 0
    with pytest.raises(frames.FrameError, match="tag"):
        frames.unpack_frame(key, bytes(stripped))
    # Unknown flag bits are still refused, and so is the flag with capability 0.
    odd = frames.HEADER.pack(frames.MAGIC, frames.VERSION, frames.OP_WRITE, 4, 0, 0, 0, 0, 1, bytes(16))
    with pytest.raises(frames.FrameError, match="flags"):
        frames.unpack_frame(None, odd)
    zero = frames.HEADER.pack(frames.MAGIC, frames.VERSION, frames.OP_WRITE, frames.FLAG_CAPABILITY,
                              0, 0, 0, 0, 1, bytes(16)) + bytes(8)
    with pytest.raises(frames.FrameError, match="capability"):
        frames.unpack_frame(None, zero)
    # A version-1 peer (no capability in its frames) is refused outright.
    old = bytearray(frames.pack_header(None, frames.OP_WRITE, 0, 0, 16, 1))
    old[4] = 1
    with pytest.raises(frames.FrameError, match="version"):
        frames.unpack_frame(None, bytes(old))


def test_transfer_request_checks_its_capability():
    assert TransferRequest(WRITE, 0, 0, 1, "B", 0).capability == 0
    assert TransferRequest(WRITE, 0, 0, 1, "B", 0, capability=(1 << 64) - 1).capability == (1 << 64) - 1
    for bad in (-1, 1 << 64, True, "1"):
        with pytest.raises(ValueError, match="capability"):
            TransferRequest(WRITE, 0, 0, 1, "B", 0, capability=bad)


def test_page_grants_admit_only_granted_pages_of_live_capabilities():
    g = PageGrants(PAGE)
    cap = g.grant([2, 3, 5])
    assert cap != 0 and g.grant([6]) not in (0, cap)
    assert g.admit(cap, 2 * PAGE, 2 * PAGE)            # pages 2-3
    g.landed(cap)
    assert g.admit(cap, 5 * PAGE + 100, 10)
    g.landed(cap)
    assert not g.admit(cap, 3 * PAGE, 2 * PAGE)        # 3-4: page 4 is not granted
    assert not g.admit(cap, PAGE, 1)
    assert not g.admit(cap ^ 1, 2 * PAGE, 1)           # a guessed capability
    assert not g.admit(0, 2 * PAGE, 1)                 # no capability at all
    assert g.revoke(cap, lambda: pytest.fail("nothing was landing")) is True
    assert not g.admit(cap, 2 * PAGE, 1)               # revoked
    assert g.live == 1 and g.landing(cap) == 0


def test_a_revoked_capability_with_a_write_landing_says_so_once_it_is_in():
    g = PageGrants(PAGE)
    cap = g.grant([0])
    assert g.admit(cap, 0, PAGE) and g.admit(cap, 0, 16)
    quiet = []
    assert g.revoke(cap, lambda: quiet.append(True)) is False
    assert not g.admit(cap, 0, 16)                     # no new WRITE after the revoke
    g.landed(cap)
    assert quiet == []
    g.landed(cap)
    assert quiet == [True] and g.landing(cap) == 0


# -- the target refuses, the sender is told -------------------------------------

async def test_a_write_with_the_granted_capability_lands():
    async with guarded_pair() as (a, b, grants, dst):
        cap = grants.grant([2, 3])
        await a.transfer([write_pages(2, 2, cap, src_page=1)])
        assert dst[2 * PAGE:4 * PAGE] == bytes(i % 251 for i in range(PAGE, 3 * PAGE))
        assert dst[:2 * PAGE] == bytes(2 * PAGE) and dst[4 * PAGE:] == bytes(4 * PAGE)
        assert b.stats()["refused_writes"] == 0 and grants.landing(cap) == 0


@pytest.mark.parametrize("case", ["wrong", "none", "revoked", "outside", "straddles"])
async def test_a_write_the_grants_do_not_cover_is_refused_and_touches_nothing(case):
    async with guarded_pair() as (a, b, grants, dst):
        cap = grants.grant([2, 3])
        other = grants.grant([6])
        req = {"wrong": write_pages(2, 1, other),
               "none": write_pages(2, 1, 0),
               "revoked": write_pages(2, 1, cap),
               "outside": write_pages(4, 1, cap),
               "straddles": TransferRequest(WRITE, 0, 0, PAGE, "B", 3 * PAGE + 1, capability=cap)}[case]
        if case == "revoked":
            assert grants.revoke(cap, lambda: None)
        with pytest.raises(TransferError, match="refused") as exc:
            await a.transfer([req])
        assert "capability" in exc.value.reason
        assert dst == bytes(SIZE)
        stats_b, stats_a = b.stats(), a.stats()
        assert stats_b["refused_writes"] >= 1 and stats_b["refused_connections"] == 0
        # A refusal is an answer, not a broken path: nothing retried or charged.
        assert stats_a["retries"] == 0 and stats_a["path_failures"] == 0
        # And the connection is still good for a WRITE that is granted.
        await a.transfer([write_pages(6, 1, other)])
        assert dst[6 * PAGE:7 * PAGE] == bytes(i % 251 for i in range(PAGE))
        assert a.stats()["path_failures"] == 0


async def test_a_refused_slice_fails_the_whole_multislice_request():
    async with guarded_pair(slice_bytes=1024) as (a, b, grants, dst):
        cap = grants.grant([0, 1, 2])        # the request covers pages 0-3: its last slices are refused
        with pytest.raises(TransferError, match="refused"):
            await a.transfer([write_pages(0, 4, cap)])
        assert dst[3 * PAGE:] == bytes(SIZE - 3 * PAGE)
        assert b.stats()["refused_writes"] >= 1


async def test_unguarded_regions_and_reads_need_no_capability():
    async with guarded_pair() as (a, b, grants, dst):
        dst[:PAGE] = b"r" * PAGE
        into = bytearray(PAGE)
        r = a.register_local_memory(into)
        await a.transfer([TransferRequest(READ, r.id, 0, PAGE, "B", 0)])   # READ of a guarded region
        assert into == b"r" * PAGE
        plain = bytearray(PAGE)
        region = b.register_local_memory(plain)
        a.add_segment(b.segment_descriptor())
        for cap in (0, 12345):                   # an unguarded region ignores the capability
            await a.transfer([TransferRequest(WRITE, 0, 0, PAGE, "B", 0, target_region=region.id,
                                              capability=cap)])
        assert plain == bytes(i % 251 for i in range(PAGE))
        assert b.stats()["refused_writes"] == 0


async def test_set_write_guard_on_a_registered_region():
    async with guarded_pair() as (a, b, grants, dst):
        plain = bytearray(PAGE)
        region = b.register_local_memory(plain)
        a.add_segment(b.segment_descriptor())
        later = PageGrants(PAGE)
        b.set_write_guard(region.id, later)
        req = TransferRequest(WRITE, 0, 0, PAGE, "B", 0, target_region=region.id, capability=0)
        with pytest.raises(TransferError, match="refused"):
            await a.transfer([req])
        assert plain == bytes(PAGE)
        b.set_write_guard(region.id, None)       # back to an open region
        await a.transfer([req])
        assert plain == bytes(i % 251 for i in range(PAGE))
        with pytest.raises(KeyError):
            b.set_write_guard(99, later)


async def test_write_local_goes_through_the_same_guard():
    async with guarded_pair() as (a, b, grants, dst):
        cap = grants.grant([1])
        assert b.write_local(0, PAGE, b"x" * 16, cap) is True
        assert dst[PAGE:PAGE + 16] == b"x" * 16
        assert b.write_local(0, 2 * PAGE, b"y" * 16, cap) is False
        assert grants.revoke(cap, lambda: None)
        assert b.write_local(0, PAGE, b"z" * 16, cap) is False
        assert dst[PAGE:PAGE + 16] == b"x" * 16 and dst[2 * PAGE:2 * PAGE + 16] == bytes(16)
        assert b.stats()["refused_writes"] == 2


# -- a WRITE already admitted when its capability is revoked ----------------------

def _raw_conn(eng: TransferEngine) -> socket.socket:
    nic = eng.segment_descriptor()["nics"][0]
    s = socket.create_connection((nic["host"], nic["port"]), timeout=5)
    assert frames.client_handshake(s, "")[1] == eng.name
    return s


async def test_revoking_while_a_write_is_landing_reports_quiet_only_after_its_last_byte():
    """A slow sender: the header is in and admitted, half the payload is not.
    The revoke cannot stop those bytes, so it must say "not quiet yet" and
    call back only once they are in, never before."""
    async with TransferEngine(TransferConfig(transport="tcp"), "B") as b:
        dst = bytearray(SIZE)
        grants = PageGrants(PAGE)
        b.register_local_memory(dst, write_guard=grants)
        cap = grants.grant([1])
        s = await asyncio.to_thread(_raw_conn, b)
        try:
            s.sendall(frames.pack_header(None, frames.OP_WRITE, 0, PAGE, PAGE, 1, capability=cap)
                      + b"s" * (PAGE // 2))
            await eventually(lambda: grants.landing(cap) == 1)
            quiet = asyncio.Event()
            loop = asyncio.get_running_loop()
            assert grants.revoke(cap, lambda: loop.call_soon_threadsafe(quiet.set)) is False
            assert not quiet.is_set()
            s.sendall(b"s" * (PAGE // 2))
            ack = await asyncio.to_thread(frames.recv_bytes, s, frames.HEADER_SIZE)
            assert frames.unpack_header(None, ack)[:2] == (frames.OP_WRITE_ACK, frames.STATUS_OK)
            await asyncio.wait_for(quiet.wait(), 5)
            assert dst[PAGE:2 * PAGE] == b"s" * PAGE
            # The next WRITE of the revoked capability is answered "refused".
            s.sendall(frames.pack_header(None, frames.OP_WRITE, 0, PAGE, 8, 2, capability=cap) + b"late-one")
            ack = await asyncio.to_thread(frames.recv_bytes, s, frames.HEADER_SIZE)
            assert frames.unpack_header(None, ack)[:2] == (frames.OP_WRITE_ACK, frames.STATUS_REFUSED)
            assert dst[PAGE:PAGE + 8] == b"s" * 8
        finally:
            s.close()


async def test_a_connection_dying_mid_payload_still_ends_the_landing():
    async with TransferEngine(TransferConfig(transport="tcp"), "B") as b:
        grants = PageGrants(PAGE)
        b.register_local_memory(bytearray(SIZE), write_guard=grants)
        cap = grants.grant([0])
        s = await asyncio.to_thread(_raw_conn, b)
        s.sendall(frames.pack_header(None, frames.OP_WRITE, 0, 0, PAGE, 1, capability=cap) + b"a" * 10)
        await eventually(lambda: grants.landing(cap) == 1)
        quiet = asyncio.Event()
        loop = asyncio.get_running_loop()
        assert grants.revoke(cap, lambda: loop.call_soon_threadsafe(quiet.set)) is False
        s.close()
        await asyncio.wait_for(quiet.wait(), 5)
        assert grants.landing(cap) == 0


def test_header_struct_layout_is_what_the_docstring_says():
    # 56 bytes, then the 8-byte capability when flags bit 0 is set.
    assert frames.HEADER_SIZE == 56 and frames.CAPABILITY_SIZE == 8
    h = frames.pack_header(None, frames.OP_WRITE, 1, 2, 3, 4, capability=5)
    assert struct.unpack_from("<H", h, 6)[0] == frames.FLAG_CAPABILITY
    assert struct.unpack_from("<Q", h, frames.HEADER_SIZE)[0] == 5
