"""TCP transport: emulated one-sided READ/WRITE into registered regions.

Data path design (measured to be the fastest we found in CPython): every
connection is served by plain *blocking* sockets in dedicated threads, so
one slice costs one ``recv_into(..., MSG_WAITALL)`` straight into the
registered region (zero-copy receive, the GIL is released for the whole
copy) and one ``sendmsg([header, memoryview])`` from it (zero-copy send).
The asyncio side only posts slices and is told of completions with
``call_soon_threadsafe``; it never touches payload bytes.

Listener side (the "target"): one accept thread per NIC address and one
thread per accepted connection running ``_serve_conn``. No user code runs
there; the target process only validates headers and moves bytes, which is
as close to one-sided as TCP allows.  The one exception is a region's write
guard (types.WriteGuard), asked before a WRITE's payload is received into
the region: a refused WRITE's payload is read and dropped, and the sender
gets an OP_WRITE_ACK with STATUS_REFUSED (its endpoint fails just that
slice with ``WriteRefused``; the connection stays in use).

With ``payload_auth`` (frames.py, "Payload tag") the payload is still
received straight into the region, then checked against its trailer before
the ACK; a mismatch closes the connection unacknowledged.  The initiator
tags its WRITEs and asks for tagged READ responses; the listener then also
refuses (closes on) an untagged WRITE.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable

from . import frames
from .endpoint import Endpoint, EndpointError, Posted, WriteRefused
from .frames import FrameError
from .types import Region, TransferOp

log = logging.getLogger(__name__)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def tune_socket(sock: socket.socket, user_timeout_ms: int) -> None:
    """Latency and dead-peer detection options shared by both ends."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # An idle connection to a vanished host is noticed in ~1 + 3 s.
    for opt, val in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
    if user_timeout_ms and hasattr(socket, "TCP_USER_TIMEOUT"):
        # Unacknowledged data older than this aborts the socket (a pulled
        # link otherwise keeps retransmitting for ~15 minutes).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_timeout_ms)


def _sendmsg_all(sock: socket.socket, parts: list) -> None:
    """sendmsg of header + payload in one syscall; finish any short write."""
    total = sum(len(p) for p in parts)
    sent = sock.sendmsg(parts)
    if sent == total:
        return
    for p in parts:
        n = len(p)
        if sent >= n:
            sent -= n
            continue
        sock.sendall(memoryview(p)[sent:])
        sent = 0


def _discard(sock: socket.socket, n: int, scratch: memoryview) -> None:
    """Read and drop ``n`` payload bytes (a refused WRITE's), keeping the stream in step."""
    while n:
        k = min(n, len(scratch))
        frames.recv_exact(sock, scratch[:k])
        n -= k


# -- listener (target side) --------------------------------------------------

class TcpListener:
    """Serves one NIC address: accepts connections and runs frames against
    the engine's region table (``regions`` is shared, read without locks:
    dict lookups are atomic and a Region is never mutated)."""

    def __init__(self, host: str, port: int, segment_name: str, regions: dict[int, Region],
                 token: str, user_timeout_ms: int, max_frame_bytes: int,
                 qp_acceptor: Callable[[dict], tuple[dict, Callable[[], None]]] | None = None,
                 payload_auth: bool = False) -> None:
        self.host = host
        # Require a payload tag on every WRITE (frames.py, "Payload tag").
        self.payload_auth = payload_auth
        self.qp_acceptor = qp_acceptor
        self.segment_name = segment_name
        self.regions = regions
        self.token = token
        self.user_timeout_ms = user_timeout_ms
        self.max_frame_bytes = max_frame_bytes
        self.sock = socket.socket(_family(host), socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.port: int = self.sock.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.refused = 0  # connections closed for a bad frame or failed auth
        self.refused_writes = 0  # WRITEs a region's write guard refused (answered, not closed)
        self.bad_payloads = 0  # WRITEs whose payload tag did not match (connection closed)
        self._thread = threading.Thread(target=self._accept_loop, name=f"tcp-accept-{host}:{self.port}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            if not self.token and not ipaddress.ip_address(addr[0].split("%")[0]).is_loopback:
                # Without a shared secret only same-host peers are trusted.
                log.warning("refusing unauthenticated peer %s (set auth_token)", addr[0])
                self.refused += 1
                conn.close()
                continue
            tune_socket(conn, self.user_timeout_ms)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve_conn, args=(conn, addr), daemon=True,
                             name=f"tcp-serve-{addr[0]}:{addr[1]}").start()

    def _serve_conn(self, conn: socket.socket, addr: tuple) -> None:
        cleanups: list[Callable[[], None]] = []
        try:
            conn.settimeout(10.0)  # handshake must not hold a thread forever
            key = frames.server_handshake(conn, self.token, self.segment_name)
            conn.settimeout(None)
            expect_seq = 1
            hdr = bytearray(frames.HEADER_SIZE + frames.CAPABILITY_SIZE)
            scratch: memoryview | None = None  # for dropping refused payloads
            while True:
                frame = frames.recv_frame(conn, key, hdr)
                op, rid, off, length, seq, cap = (frame.op, frame.region, frame.offset, frame.length,
                                                  frame.seq, frame.capability)
                tagged = frame.payload_tagged
                # Invariant: nothing below touches region memory unless every
                # check passed; any failure closes the connection, except a
                # WRITE its region's guard refuses, which is answered.
                if op == frames.OP_QP_CONNECT and self.qp_acceptor is not None and seq == expect_seq:
                    expect_seq += 1
                    if length > frames.MAX_QP_INFO:
                        raise FrameError("QP info too long")
                    try:
                        reply, cleanup = self.qp_acceptor(json.loads(frames.recv_bytes(conn, length)))
                    except (ValueError, KeyError, TypeError) as e:
                        raise FrameError(f"bad QP info: {e}") from None
                    cleanups.append(cleanup)
                    body = json.dumps(reply).encode()
                    conn.sendall(frames.pack_header(key, frames.OP_QP_REPLY, 0, 0, len(body), seq) + body)
                    continue
                if op not in frames.REQUEST_OPS:
                    raise FrameError(f"op {op} is not a request")
                if seq != expect_seq:
                    raise FrameError(f"sequence {seq}, expected {expect_seq}")
                expect_seq += 1
                region = self.regions.get(rid)
                if region is None:
                    raise FrameError(f"unknown region {rid}")
                if length > self.max_frame_bytes:
                    raise FrameError(f"frame of {length} bytes exceeds max_frame_bytes")
                if off > region.length or length > region.length - off:
                    raise FrameError(f"range [{off}, +{length}) outside region {rid} of {region.length} bytes")
                view = region.view[off:off + length]
                if op == frames.OP_WRITE:
                    if self.payload_auth and not tagged:
                        raise FrameError("WRITE without a payload tag (payload_auth is on)")
                    guard = region.write_guard
                    if guard is not None and not guard.admit(cap, off, length):
                        self.refused_writes += 1
                        log.debug("refused WRITE [%d, +%d) of region %d from %s: not granted",
                                  off, length, rid, addr[0])
                        if scratch is None:
                            scratch = memoryview(bytearray(1 << 16))
                        _discard(conn, length + (frames.TAG_SIZE if tagged else 0), scratch)
                        conn.sendall(frames.pack_header(key, frames.OP_WRITE_ACK, rid, off, length, seq,
                                                        status=frames.STATUS_REFUSED))
                        continue
                    try:
                        frames.recv_exact(conn, view)
                        if tagged:
                            assert key is not None  # unpack_frame refuses the flag without one
                            try:
                                frames.check_payload_tag(key, frame, view,
                                                         frames.recv_bytes(conn, frames.TAG_SIZE))
                            except FrameError:
                                # Landed but never acknowledged: the sender
                                # counts the slice as failed (frames.py).
                                self.bad_payloads += 1
                                raise
                    finally:
                        if guard is not None:
                            guard.landed(cap)
                    conn.sendall(frames.pack_header(key, frames.OP_WRITE_ACK, rid, off, length, seq))
                else:
                    resp = frames.pack_header(key, frames.OP_READ_RESP, rid, off, length, seq,
                                              payload_tag=tagged)
                    parts = [resp, view]
                    if tagged:
                        assert key is not None
                        parts.append(frames.payload_tag(key, frames.header_tag(resp), view))
                    _sendmsg_all(conn, parts)
        except FrameError as e:
            self.refused += 1
            log.warning("closing connection from %s: %s", addr[0], e)
        except (OSError, ConnectionError):
            pass  # peer went away; its side rebuilds on next use
        except Exception as e:  # e.g. PyverbsRDMAError while building a QP
            log.warning("closing connection from %s: %s: %s", addr[0], type(e).__name__, e)
        finally:
            for cleanup in cleanups:  # the initiator's QP went away with this connection
                try:
                    cleanup()
                except Exception:
                    pass
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass


# -- endpoint (initiator side) ----------------------------------------------

class _Post(Posted):
    __slots__ = ("op", "rid", "offset", "view", "capability")

    def __init__(self, op: TransferOp, rid: int, offset: int, view: memoryview, fut: asyncio.Future,
                 capability: int = 0) -> None:
        super().__init__(fut, len(view))
        self.op, self.rid, self.offset, self.view = op, rid, offset, view
        self.capability = capability


class TcpEndpoint(Endpoint):
    """One connection to one remote NIC; slices are pipelined on it.

    ``post`` is called from the event loop; a sender thread writes requests
    in order and a receiver thread matches responses (in order, the target
    serves a connection sequentially) to posted slices by sequence number.
    """

    pending: dict[int, _Post]

    def __init__(self, loop: asyncio.AbstractEventLoop, local_host: str, remote_host: str, remote_port: int,
                 token: str, expect_segment: str, user_timeout_ms: int, connect_timeout_s: float,
                 on_fail: Callable[[Endpoint, str, bool], None] | None = None,
                 payload_auth: bool = False) -> None:
        super().__init__(loop, token, user_timeout_ms, connect_timeout_s, on_fail)
        # Tag WRITE payloads and require tagged READ responses (frames.py).
        self.payload_auth = payload_auth
        self.local_host, self.remote_host, self.remote_port = local_host, remote_host, remote_port
        self.expect_segment = expect_segment
        self.sock: socket.socket | None = None
        self.key: bytes | None = None
        self._q: queue.SimpleQueue[_Post | None] = queue.SimpleQueue()

    # connection setup runs in a worker thread (blocking connect + handshake)
    def _connect_blocking(self) -> None:
        sock = socket.socket(_family(self.remote_host), socket.SOCK_STREAM)
        try:
            tune_socket(sock, self.user_timeout_ms)
            sock.bind((self.local_host, 0))
            sock.settimeout(self.connect_timeout_s)
            sock.connect((self.remote_host, self.remote_port))
            key, name = frames.client_handshake(sock, self.token)
            if name != self.expect_segment:
                raise EndpointError(f"{self.remote_host}:{self.remote_port} serves segment {name!r}, "
                                    f"not {self.expect_segment!r}")
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        self.sock, self.key = sock, key

    async def connect(self) -> None:
        try:
            await self._connect_in_thread()
        except (OSError, FrameError, asyncio.TimeoutError) as e:
            raise EndpointError(f"connect {self.local_host}->{self.remote_host}:{self.remote_port}: "
                                f"{e or type(e).__name__}") from e
        for fn, name in ((self._send_loop, "send"), (self._recv_loop, "recv")):
            threading.Thread(target=fn, daemon=True, name=f"tcp-{name}-{self.remote_host}:{self.remote_port}").start()

    def post(self, op: TransferOp, rid: int, offset: int, view: memoryview, local_region: int = 0,
             local_offset: int = 0, capability: int = 0) -> asyncio.Future:
        """Queue one slice; the future resolves when the target acknowledged it
        (WriteRefused when its write guard refused it)."""
        fut = self._new_future()
        if fut.done():
            return fut
        p = _Post(op, rid, offset, view, fut, capability if op == TransferOp.WRITE else 0)
        self._track(p)
        self._q.put(p)
        return fut

    def _send_loop(self) -> None:
        seq = 0
        try:
            while True:
                p = self._q.get()
                if p is None or self.failed is not None:
                    return
                seq += 1
                hdr = frames.pack_header(self.key, frames.OP_WRITE if p.op == TransferOp.WRITE else frames.OP_READ,
                                         p.rid, p.offset, len(p.view), seq, capability=p.capability,
                                         payload_tag=self.payload_auth)
                if p.op == TransferOp.WRITE:
                    parts = [hdr, p.view] if len(p.view) else [hdr]
                    if self.payload_auth:
                        assert self.key is not None  # TransferConfig needs auth_token for it
                        parts.append(frames.payload_tag(self.key, frames.header_tag(hdr), p.view))
                    _sendmsg_all(self.sock, parts)
                else:
                    self.sock.sendall(hdr)
        except (OSError, AttributeError) as e:
            self._fail_from_thread(f"send: {e}")

    def _recv_loop(self) -> None:
        hdr = bytearray(frames.HEADER_SIZE)
        hview = memoryview(hdr)
        expect = 1
        try:
            while True:
                frames.recv_exact(self.sock, hview)
                frame = frames.unpack_frame(self.key, bytes(hdr))
                op, status, length, seq = frame.op, frame.status, frame.length, frame.seq
                p = self.pending.get(seq)
                want = frames.OP_READ_RESP if p is not None and p.op == TransferOp.READ else frames.OP_WRITE_ACK
                refused = op == frames.OP_WRITE_ACK and status == frames.STATUS_REFUSED
                if (seq != expect or p is None or op != want or length != len(p.view)
                        or (status != frames.STATUS_OK and not refused)):
                    raise FrameError(f"unexpected response op={op} status={status} seq={seq} "
                                     f"(expected {expect})")
                expect += 1
                if op == frames.OP_READ_RESP:
                    if self.payload_auth and not frame.payload_tagged:
                        raise FrameError("READ response without a payload tag (payload_auth is on)")
                    frames.recv_exact(self.sock, p.view)
                    if frame.payload_tagged:
                        # Received in place; a mismatch fails the slice below,
                        # so the bytes are never reported as read.
                        assert self.key is not None
                        frames.check_payload_tag(self.key, frame, p.view,
                                                 frames.recv_bytes(self.sock, frames.TAG_SIZE))
                self.last_progress = time.monotonic()
                if refused:
                    self.loop.call_soon_threadsafe(self._complete, seq, WriteRefused(
                        f"{self.expect_segment} refused the WRITE of [{p.offset}, +{length}) into region "
                        f"{p.rid}: its capability grants no such range (reservation released or expired?)"))
                else:
                    self.loop.call_soon_threadsafe(self._complete, seq)
        except (OSError, ConnectionError, FrameError, AttributeError) as e:
            self._fail_from_thread(f"recv: {e}")
        finally:
            # Only this thread closes the fd, so it is never reused under a
            # thread still blocked on it; everyone else just shuts it down.
            self.sock.close()

    def _teardown(self) -> None:
        self._q.put(None)
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
