"""Two real processes over loopback: data integrity, bounds, auth, failures."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import time

import pytest

from rdma import frames
from rdma.config import TransferConfig
from rdma.engine import TransferEngine
from rdma.peer import PeerProcess, pattern
from rdma.types import READ, WRITE, TransferError, TransferRequest, TransferState

SLICE = 64 << 10
SIZE = 4 << 20
TOKEN = "test-secret"


def sha(b) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture(scope="module")
def peer():
    p = PeerProcess("B", SIZE, token=TOKEN)
    yield p
    p.close()


@pytest.fixture
async def engine(peer):
    eng = TransferEngine(TransferConfig(transport="tcp", slice_bytes=SLICE, auth_token=TOKEN,
                                        request_timeout_s=20), "A")
    await eng.start()
    eng.add_segment(peer.descriptor)
    yield eng
    await eng.close()


SIZES = [0, 1, SLICE - 1, SLICE, SLICE + 1, 3 * SLICE + 7, SIZE - 11]


@pytest.mark.parametrize("length", SIZES)
async def test_write_then_read_checksums(engine, peer, length):
    src = bytearray(pattern(length + 1, SIZE))
    region = engine.register_local_memory(src)
    before = peer.sha(0, SIZE)
    off_l, off_r = 3, 5  # deliberately unaligned
    length = min(length, SIZE - 11)
    await engine.transfer([TransferRequest(WRITE, region.id, off_l, length, "B", off_r)])
    assert peer.sha(off_r, length) == sha(src[off_l:off_l + length])
    if length == 0:
        assert peer.sha(0, SIZE) == before  # zero-length touched nothing
    # Read it back into a fresh buffer at another offset.
    dst = bytearray(SIZE)
    r2 = engine.register_local_memory(dst)
    await engine.transfer([TransferRequest(READ, r2.id, 11, length, "B", off_r)])
    assert dst[11:11 + length] == src[off_l:off_l + length]
    assert dst[:11] == bytes(11) and dst[11 + length:] == bytes(SIZE - 11 - length)


async def test_batch_api_statuses(engine, peer):
    peer.cmd("fill 9")
    want = pattern(9, SIZE)
    dst = bytearray(SIZE)
    r = engine.register_local_memory(dst)
    bid = engine.allocate_batch(4)
    reqs = [TransferRequest(READ, r.id, i * (SIZE // 4), SIZE // 4, "B", i * (SIZE // 4)) for i in range(4)]
    await engine.submit_transfer(bid, reqs)
    assert engine.transfer_status(bid, 0).state in (TransferState.WAITING, TransferState.PENDING,
                                                    TransferState.COMPLETED)
    statuses = await engine.wait(bid)
    assert [s.state for s in statuses] == [TransferState.COMPLETED] * 4
    assert all(s.transferred_bytes == SIZE // 4 for s in statuses)
    engine.free_batch(bid)
    assert bytes(dst) == want
    with pytest.raises(KeyError):
        engine.transfer_status(bid, 0)


async def test_bad_requests(engine, peer):
    buf = bytearray(1024)
    r = engine.register_local_memory(buf)
    before = peer.sha(0, SIZE)
    with pytest.raises(ValueError, match="exceeds region"):
        await engine.transfer([TransferRequest(WRITE, r.id, 1000, 100, "B", 0)])
    with pytest.raises(ValueError, match="not registered"):
        await engine.transfer([TransferRequest(WRITE, 999, 0, 1, "B", 0)])
    with pytest.raises(ValueError, match="non-negative"):
        TransferRequest(WRITE, r.id, -1, 1, "B", 0)
    with pytest.raises(TransferError, match="exceeds region"):
        await engine.transfer([TransferRequest(WRITE, r.id, 0, 100, "B", SIZE - 50)])
    with pytest.raises(TransferError, match="no region 7"):
        await engine.transfer([TransferRequest(WRITE, r.id, 0, 100, "B", 0, target_region=7)])
    with pytest.raises(TransferError, match="unknown segment"):
        await engine.transfer([TransferRequest(WRITE, r.id, 0, 100, "nobody", 0)])
    bid = engine.allocate_batch(1)
    with pytest.raises(ValueError, match="holds 1"):
        await engine.submit_transfer(bid, [TransferRequest(READ, r.id, 0, 1, "B", 0)] * 2)
    assert peer.sha(0, SIZE) == before


async def test_resolver(peer):
    async with TransferEngine(TransferConfig(transport="tcp", auth_token=TOKEN), "A2") as eng:
        asked = []

        async def resolve(name):
            asked.append(name)
            return {"B": peer.descriptor}.get(name)

        eng.set_resolver(resolve)
        buf = bytearray(1000)
        r = eng.register_local_memory(buf)
        await eng.transfer([TransferRequest(READ, r.id, 0, 1000, "B", 0)])
        assert asked == ["B"]
        assert peer.sha(0, 1000) == sha(buf)


async def test_wrong_token_fails_cleanly(peer):
    async with TransferEngine(TransferConfig(transport="tcp", auth_token="wrong", request_timeout_s=10,
                                             max_retries=1, nic_backoff_s=0.05), "A3") as eng:
        eng.add_segment(peer.descriptor)
        before = peer.sha(0, SIZE)
        buf = bytearray(b"x" * 4096)
        r = eng.register_local_memory(buf)
        with pytest.raises(TransferError, match="authentication"):
            await eng.transfer([TransferRequest(WRITE, r.id, 0, 4096, "B", 0)])
        assert peer.sha(0, SIZE) == before


# -- hostile frames straight at the listener --------------------------------

def _raw_conn(peer, token: str | None):
    nic = peer.descriptor["nics"][0]
    s = socket.create_connection((nic["host"], nic["port"]), timeout=5)
    key = frames.client_handshake(s, token)[0] if token is not None else None
    return s, key


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, TimeoutError, socket.timeout):
        return True


@pytest.mark.parametrize("case", ["oob", "bad_region", "bad_magic", "bad_tag", "bad_seq", "huge_len",
                                  "no_auth", "response_op"])
def test_hostile_frames_refused(peer, case):
    peer.cmd("fill 5")
    before = peer.sha(0, SIZE)
    if case == "no_auth":
        s, _ = _raw_conn(peer, None)
        # Without the token our handshake proof is zeros: the server must close.
        try:
            frames.client_handshake(s, "")
            s.sendall(frames.pack_header(None, frames.OP_WRITE, 0, 0, 16, 1) + b"A" * 16)
        except (OSError, frames.FrameError):
            pass
        assert _closed(s)
        s.close()
        assert peer.sha(0, SIZE) == before
        return
    s, key = _raw_conn(peer, TOKEN)
    payload = b"Z" * 4096
    if case == "oob":
        hdr = frames.pack_header(key, frames.OP_WRITE, 0, SIZE - 100, 4096, 1)
    elif case == "bad_region":
        hdr = frames.pack_header(key, frames.OP_WRITE, 42, 0, 4096, 1)
    elif case == "bad_magic":
        hdr = b"EVIL" + frames.pack_header(key, frames.OP_WRITE, 0, 0, 4096, 1)[4:]
    elif case == "bad_tag":
        hdr = frames.pack_header(b"not-the-session-key", frames.OP_WRITE, 0, 0, 4096, 1)
    elif case == "bad_seq":
        hdr = frames.pack_header(key, frames.OP_WRITE, 0, 0, 4096, 7)
    elif case == "huge_len":
        hdr = frames.pack_header(key, frames.OP_WRITE, 0, 0, 1 << 40, 1)
    else:
        hdr = frames.pack_header(key, frames.OP_READ_RESP, 0, 0, 4096, 1)
    try:
        s.sendall(hdr + payload)
    except OSError:
        pass
    assert _closed(s)
    s.close()
    assert peer.sha(0, SIZE) == before
    stats = peer.cmd("stats")
    assert stats["refused_connections"] >= 1


def test_valid_raw_frame_then_oob_on_same_connection(peer):
    """An accepted frame lands; a later OOB frame on the same connection closes it
    and changes nothing else."""
    s, key = _raw_conn(peer, TOKEN)
    s.sendall(frames.pack_header(key, frames.OP_WRITE, 0, 100, 8, 1) + b"12345678")
    ack = frames.recv_bytes(s, frames.HEADER_SIZE)
    assert frames.unpack_header(key, ack)[0] == frames.OP_WRITE_ACK
    after_ok = peer.sha(0, SIZE)
    s.sendall(frames.pack_header(key, frames.OP_WRITE, 0, SIZE, 1, 2) + b"!")
    assert _closed(s)
    s.close()
    assert peer.sha(0, SIZE) == after_ok
    assert peer.sha(100, 8) == sha(b"12345678")


# -- failures ---------------------------------------------------------------

@pytest.mark.slow  # peer processes of its own, waits out timeouts
async def test_kill_9_fails_pending_within_timeout():
    size = 64 << 20
    victim = PeerProcess("V", size, token=TOKEN)
    try:
        cfg = TransferConfig(transport="tcp", auth_token=TOKEN, slice_bytes=256 << 10, request_timeout_s=8,
                             stall_timeout_s=2, max_retries=2, nic_backoff_s=0.1, connections_per_peer=2)
        async with TransferEngine(cfg, "K") as eng:
            eng.add_segment(victim.descriptor)
            buf = bytearray(size)
            r = eng.register_local_memory(buf)
            bid = eng.allocate_batch(8)
            await eng.submit_transfer(bid, [TransferRequest(READ, r.id, 0, size, "V", 0)
                                            for _ in range(8)])
            while eng.transfer_status(bid, 0).transferred_bytes == 0:
                await asyncio.sleep(0.001)
            os.kill(victim.proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            statuses = await eng.wait(bid, timeout=30)
            waited = time.monotonic() - t0
            assert all(s.done for s in statuses), statuses
            # Some requests may have finished before the kill; none may hang.
            failed = [s for s in statuses if s.state != TransferState.COMPLETED]
            assert failed, "kill -9 mid-transfer should fail something"
            assert all(s.state in (TransferState.FAILED, TransferState.TIMEOUT) and s.reason for s in failed)
            assert waited < cfg.request_timeout_s + 2
            eng.free_batch(bid)
    finally:
        victim.proc.kill()
        victim.close()


@pytest.mark.slow  # peer processes of its own, waits out timeouts
async def test_stopped_peer_times_out_not_hangs():
    victim = PeerProcess("S", 32 << 20, token=TOKEN)
    try:
        cfg = TransferConfig(transport="tcp", auth_token=TOKEN, request_timeout_s=2.5, stall_timeout_s=0.5,
                             nic_backoff_s=0.1, max_retries=50)
        async with TransferEngine(cfg, "T") as eng:
            eng.add_segment(victim.descriptor)
            buf = bytearray(32 << 20)
            r = eng.register_local_memory(buf)
            os.kill(victim.proc.pid, signal.SIGSTOP)
            bid = eng.allocate_batch(1)
            await eng.submit_transfer(bid, [TransferRequest(WRITE, r.id, 0, 32 << 20, "S", 0)])
            [st] = await eng.wait(bid, timeout=15)
            assert st.state in (TransferState.TIMEOUT, TransferState.FAILED), st
            assert st.reason
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
        victim.close()


@pytest.mark.slow  # peer processes of its own, waits out timeouts
async def test_endpoint_pool_bound_with_real_connections():
    peers = [PeerProcess(f"P{i}", 1 << 20, token=TOKEN) for i in range(3)]
    try:
        cfg = TransferConfig(transport="tcp", auth_token=TOKEN, max_endpoints=2, connections_per_peer=1)
        async with TransferEngine(cfg, "E") as eng:
            for p in peers:
                eng.add_segment(p.descriptor)
            buf = bytearray(pattern(1, 1 << 20))
            r = eng.register_local_memory(buf)
            for rounds in range(2):
                for i, p in enumerate(peers):
                    await eng.transfer([TransferRequest(WRITE, r.id, 0, 1 << 20, f"P{i}", 0)])
                    assert len(eng._pool) <= 2
            assert eng.stats()["evictions"] >= 4
            for p in peers:  # evicted endpoints were rebuilt and data is intact
                assert p.sha(0, 1 << 20) == sha(buf)
    finally:
        for p in peers:
            p.close()
