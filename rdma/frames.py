"""Wire format of the tcp transport (also the rdma control channel).

Every operation is one fixed-size header, optionally followed by payload:

    offset size field
    0      4    magic  b"MCTE"
    4      1    version
    5      1    op     (OP_* below)
    6      2    flags  (reserved, must be 0)
    8      4    status (0 in requests; responses: 0 = ok)
    12     4    region id
    16     8    offset into the region
    24     8    length of the payload
    32     8    sequence number (per connection, starts at 1, +1 per request)
    40     16   tag    truncated HMAC-SHA256(session key, bytes 0..40)

Requests: OP_WRITE header + ``length`` payload bytes -> OP_WRITE_ACK header;
OP_READ header -> OP_READ_RESP header + ``length`` payload bytes;
OP_QP_CONNECT header + JSON (rdma only) -> OP_QP_REPLY header + JSON, after
which the connection stays open as the QP's liveness channel.
A listener that meets anything it cannot accept (bad magic, version, op,
tag, sequence, unknown region, out-of-bounds range) closes the connection
before touching memory; there is no error frame, so a malicious peer learns
nothing beyond "closed".

Before the first frame the two sides shake hands (see ``client_handshake``):
nonces, mutual proof of the shared token, and a per-connection session key,
so a captured frame cannot be replayed on another connection and the
sequence number stops replays within one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

MAGIC = b"MCTE"
HELLO_MAGIC = b"MCTH"
VERSION = 1

OP_READ = 1
OP_WRITE = 2
OP_READ_RESP = 3
OP_WRITE_ACK = 4
OP_QP_CONNECT = 5   # rdma control: JSON QP address in, OP_QP_REPLY + JSON out
OP_QP_REPLY = 6
REQUEST_OPS = (OP_READ, OP_WRITE)
MAX_QP_INFO = 4096

HEADER = struct.Struct("<4sBBHIIQQQ16s")
HEADER_SIZE = HEADER.size  # 56
_SIGNED = 40               # bytes covered by the tag
TAG_SIZE = 16
_NO_TAG = bytes(TAG_SIZE)

HELLO = struct.Struct("<4sB3x16s")           # magic, version, client nonce
WELCOME = struct.Struct("<4sBxH16s32s")      # magic, version, name len, server nonce, proof
PROOF_SIZE = 32
MAX_NAME = 1024


class FrameError(Exception):
    """The peer sent something we refuse; the connection must be closed."""


def _mac(key: bytes, msg: bytes) -> bytes:
    return hmac.digest(key, msg, hashlib.sha256)


def pack_header(session_key: bytes | None, op: int, region: int, offset: int, length: int,
                seq: int, status: int = 0) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, op, 0, status, region, offset, length, seq, _NO_TAG)
    if session_key is None:
        return head
    return head[:_SIGNED] + _mac(session_key, head[:_SIGNED])[:TAG_SIZE]


def unpack_header(session_key: bytes | None, data: bytes) -> tuple[int, int, int, int, int, int]:
    """Check magic/version/flags/tag; return (op, status, region, offset, length, seq)."""
    if len(data) != HEADER_SIZE:
        raise FrameError(f"short header ({len(data)} bytes)")
    magic, version, op, flags, status, region, offset, length, seq, tag = HEADER.unpack(data)
    if magic != MAGIC:
        raise FrameError("bad magic")
    if version != VERSION:
        raise FrameError(f"unsupported version {version}")
    if flags != 0:
        raise FrameError("reserved flags set")
    if session_key is not None:
        if not hmac.compare_digest(tag, _mac(session_key, data[:_SIGNED])[:TAG_SIZE]):
            raise FrameError("bad frame tag")
    elif tag != _NO_TAG:
        raise FrameError("unexpected frame tag")
    return op, status, region, offset, length, seq


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (blocking socket: normally one syscall thanks
    to MSG_WAITALL, which is what makes the receive path zero-copy and cheap)."""
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if r == 0:
            raise ConnectionError("peer closed the connection")
        got += r


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


# -- handshake ---------------------------------------------------------------

def _key(token: str) -> bytes | None:
    return token.encode() if token else None


def client_handshake(sock: socket.socket, token: str) -> tuple[bytes | None, str]:
    """Run the client side; return (session key or None, server's segment name)."""
    key = _key(token)
    cn = os.urandom(16)
    sock.sendall(HELLO.pack(HELLO_MAGIC, VERSION, cn))
    magic, version, name_len, sn, proof = WELCOME.unpack(recv_bytes(sock, WELCOME.size))
    if magic != HELLO_MAGIC or version != VERSION or name_len > MAX_NAME:
        raise FrameError("bad handshake reply")
    name = recv_bytes(sock, name_len)
    if key is not None:
        if not hmac.compare_digest(proof, _mac(key, b"srv" + cn + sn + name)):
            raise FrameError("server failed authentication (auth_token mismatch?)")
        sock.sendall(_mac(key, b"cli" + cn + sn))
        return _mac(key, b"ses" + cn + sn), name.decode()
    sock.sendall(bytes(PROOF_SIZE))
    return None, name.decode()


def server_handshake(sock: socket.socket, token: str, segment_name: str) -> bytes | None:
    """Run the server side; return the session key (None without a token)."""
    key = _key(token)
    magic, version, cn = HELLO.unpack(recv_bytes(sock, HELLO.size))
    if magic != HELLO_MAGIC or version != VERSION:
        raise FrameError("bad hello")
    sn = os.urandom(16)
    name = segment_name.encode()
    proof = _mac(key, b"srv" + cn + sn + name) if key is not None else bytes(PROOF_SIZE)
    sock.sendall(WELCOME.pack(HELLO_MAGIC, VERSION, len(name), sn, proof) + name)
    reply = recv_bytes(sock, PROOF_SIZE)
    if key is not None:
        if not hmac.compare_digest(reply, _mac(key, b"cli" + cn + sn)):
            raise FrameError("client failed authentication")
        return _mac(key, b"ses" + cn + sn)
    return None
