"""Payload authentication (``transfer.payload_auth``): a payload altered in transit is
refused with the option on (the slice is retried and lands intact) and, to show the
test can tell, lands altered with the option off.  Real engines on loopback, with a
real TCP proxy between them that flips one payload byte of the first connection."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from rdma import frames
from rdma.config import TransferConfig
from rdma.engine import TransferEngine
from rdma.types import READ, WRITE, TransferRequest

TOKEN = "payload-auth-test"
SIZE = 256 << 10
# Client-to-server stream of a connection: HELLO, the client's proof, then the
# first request's header; the byte flipped lies inside that request's payload.
_HANDSHAKE = frames.HELLO.size + frames.PROOF_SIZE
FLIP_AT = _HANDSHAKE + frames.HEADER_SIZE + 1000


class FlippingProxy:
    """Forwards loopback connections to ``target``; on the first connection it
    flips the byte at stream offset ``flip_at`` in the direction chosen."""

    def __init__(self, target: tuple[str, int], flip_at: int, upstream: bool) -> None:
        self.target, self.flip_at, self.upstream = target, flip_at, upstream
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.flipped = 0
        self.connections = 0
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.target, timeout=5)
            server.settimeout(None)
            self._socks += [client, server]
            first = self.connections == 0
            self.connections += 1
            for src, dst, corrupt in ((client, server, first and self.upstream),
                                      (server, client, first and not self.upstream)):
                threading.Thread(target=self._pump, args=(src, dst, corrupt), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, corrupt: bool) -> None:
        seen = 0
        try:
            while data := src.recv(1 << 16):
                if corrupt and seen <= self.flip_at < seen + len(data):
                    buf = bytearray(data)
                    buf[self.flip_at - seen] ^= 0xFF
                    data = bytes(buf)
                    self.flipped += 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        for s in self._socks:
            s.close()


async def _pair(payload_auth: bool, upstream: bool, target_buf: bytearray):
    kw = dict(transport="tcp", auth_token=TOKEN, payload_auth=payload_auth, slice_bytes=SIZE,
              connections_per_peer=1, request_timeout_s=20, stall_timeout_s=5)
    target = TransferEngine(TransferConfig(**kw), "target")
    await target.start()
    target_region = target.register_local_memory(target_buf)
    initiator = TransferEngine(TransferConfig(**kw), "initiator")
    await initiator.start()
    desc = target.segment_descriptor()
    nic = desc["nics"][0]
    proxy = FlippingProxy((nic["host"], nic["port"]), FLIP_AT if upstream else
                          frames.HEADER_SIZE + 1000 + _server_handshake_len(desc["name"]),
                          upstream)
    desc["nics"][0] = dict(nic, port=proxy.port)
    initiator.add_segment(desc)
    return target, target_region, initiator, proxy


def _server_handshake_len(name: str) -> int:
    return frames.WELCOME.size + len(name.encode())


@pytest.mark.parametrize("payload_auth", [True, False])
async def test_a_write_payload_altered_in_transit(payload_auth: bool) -> None:
    dst = bytearray(SIZE)
    target, dst_region, initiator, proxy = await _pair(payload_auth, True, dst)
    try:
        src = bytearray(os.urandom(SIZE))
        src_region = initiator.register_local_memory(src)
        await initiator.transfer([TransferRequest(WRITE, src_region.id, 0, SIZE, "target", 0,
                                                  target_region=dst_region.id)])
        assert proxy.flipped == 1
        if payload_auth:
            # Refused unacknowledged, retried on a fresh connection, landed intact.
            assert dst == src
            assert target.stats()["bad_payloads"] == 1 and proxy.connections == 2
            assert initiator.stats()["retries"] >= 1
        else:
            # Without the option the header tag alone cannot see it: it lands altered.
            diff = [i for i in range(SIZE) if dst[i] != src[i]]
            assert diff == [FLIP_AT - _HANDSHAKE - frames.HEADER_SIZE]
            assert target.stats()["bad_payloads"] == 0
    finally:
        proxy.close()
        await initiator.close()
        await target.close()


@pytest.mark.parametrize("payload_auth", [True, False])
async def test_a_read_response_altered_in_transit(payload_auth: bool) -> None:
    src = bytearray(os.urandom(SIZE))
    target, src_region, initiator, proxy = await _pair(payload_auth, False, src)
    try:
        dst = bytearray(SIZE)
        dst_region = initiator.register_local_memory(dst)
        await initiator.transfer([TransferRequest(READ, dst_region.id, 0, SIZE, "target", 0,
                                                  target_region=src_region.id)])
        assert proxy.flipped == 1
        if payload_auth:
            assert dst == src and initiator.stats()["retries"] >= 1
        else:
            assert sum(a != b for a, b in zip(dst, src)) == 1
    finally:
        proxy.close()
        await initiator.close()
        await target.close()


def test_payload_tag_frames() -> None:
    key = os.urandom(32)
    head = frames.pack_header(key, frames.OP_WRITE, 0, 64, 5, 1, payload_tag=True)
    frame = frames.unpack_frame(key, head)
    assert frame.payload_tagged and frame.tag == frames.header_tag(head)
    trailer = frames.payload_tag(key, frame.tag, b"hello")
    frames.check_payload_tag(key, frame, b"hello", trailer)
    with pytest.raises(frames.FrameError, match="payload tag"):
        frames.check_payload_tag(key, frame, b"hellp", trailer)
    other = frames.unpack_frame(key, frames.pack_header(key, frames.OP_WRITE, 0, 64, 5, 2,
                                                        payload_tag=True))
    with pytest.raises(frames.FrameError):  # bound to its header: no splicing onto another
        frames.check_payload_tag(key, other, b"hello", trailer)
    stripped = bytearray(head)
    stripped[6] &= ~frames.FLAG_PAYLOAD_TAG
    with pytest.raises(frames.FrameError, match="tag"):  # the flag is covered by the header tag
        frames.unpack_frame(key, bytes(stripped))
    with pytest.raises(ValueError):
        frames.pack_header(None, frames.OP_WRITE, 0, 0, 1, 1, payload_tag=True)
    with pytest.raises(ValueError, match="payload_auth needs auth_token"):
        TransferConfig(payload_auth=True)
