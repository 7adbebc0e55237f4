"""Wire format of the tcp transport (also the rdma control channel).

Every operation is one fixed-size header, optionally followed by payload:

    offset size field
    0      4    magic  b"MCTE"
    4      1    version
    5      1    op     (OP_* below)
    6      2    flags  (FLAG_CAPABILITY, FLAG_PAYLOAD_TAG; other bits reserved, must be 0)
    8      4    status (0 in requests; responses: STATUS_OK or STATUS_REFUSED)
    12     4    region id
    16     8    offset into the region
    24     8    length of the payload
    32     8    sequence number (per connection, starts at 1, +1 per request)
    40     16   tag    truncated HMAC-SHA256(session key, bytes 0..40 + extension)
    56     8    capability (only when flags has FLAG_CAPABILITY; never 0)

The capability extension (version 2) carries a WRITE's per-reservation
capability: a target whose region has a write guard takes the WRITE only if
the guard grants that capability every page the WRITE touches.  The tag
covers the extension, and the flag that announces it, so a capability can
be neither changed nor stripped in transit.

Payload tag (``TransferConfig.payload_auth``, off by default): the header tag
covers only the header, so a payload altered in transit would land unnoticed.
With FLAG_PAYLOAD_TAG set (and covered by the header tag) a 16-byte trailer
follows the payload: truncated HMAC-SHA256(session key, b"pay" + the header's
tag + payload), which binds the payload to that header (and so to its
connection, sequence number and target range).  A WRITE that carries it is
sent by an initiator with payload_auth on; a READ that carries it asks the
target to tag its OP_READ_RESP the same way.  The header is still checked
before any byte lands; the payload is received straight into its destination
(zero copy) and checked after, before it is acknowledged: a WRITE whose
trailer does not match gets no OP_WRITE_ACK, the connection is closed, and
the sender's slice fails and is retried (or the transfer fails), so the bytes
are never counted as written -- they lie in pages the WRITE's capability
granted, which nobody reads before the transfer reports success.  A READ
response that fails the check fails its slice the same way on the initiator.

Requests: OP_WRITE header + ``length`` payload bytes -> OP_WRITE_ACK header
(status STATUS_OK, or STATUS_REFUSED when the region's write guard refused:
the payload was read and dropped, no byte of the region touched, and the
connection stays usable); OP_READ header -> OP_READ_RESP header + ``length``
payload bytes; OP_QP_CONNECT header + JSON (rdma only) -> OP_QP_REPLY header
+ JSON, after which the connection stays open as the QP's liveness channel.
A listener that meets anything else it cannot accept (bad magic, version,
op, flags, tag, sequence, unknown region, out-of-bounds range) closes the
connection before touching memory; there is no error frame, so a malicious
peer learns nothing beyond "closed".  A refused WRITE is answered instead,
because it is routine (the late WRITEs of a cancelled prefill) and the
sender must stop at once rather than retry it as a network failure; the
answer tells only what the sender could already know: it holds no grant.

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
from typing import NamedTuple

MAGIC = b"MCTE"
HELLO_MAGIC = b"MCTH"
VERSION = 2  # 2: the capability extension; a version-1 peer fails the handshake

OP_READ = 1
OP_WRITE = 2
OP_READ_RESP = 3
OP_WRITE_ACK = 4
OP_QP_CONNECT = 5   # rdma control: JSON QP address in, OP_QP_REPLY + JSON out
OP_QP_REPLY = 6
REQUEST_OPS = (OP_READ, OP_WRITE)
MAX_QP_INFO = 4096

STATUS_OK = 0
STATUS_REFUSED = 1  # OP_WRITE_ACK: the region's write guard refused the WRITE

FLAG_CAPABILITY = 1  # the 8-byte capability extension follows the header
FLAG_PAYLOAD_TAG = 2  # a 16-byte payload tag follows the payload (see above)
_KNOWN_FLAGS = FLAG_CAPABILITY | FLAG_PAYLOAD_TAG

HEADER = struct.Struct("<4sBBHIIQQQ16s")
HEADER_SIZE = HEADER.size  # 56
_SIGNED = 40               # header bytes covered by the tag (the extension is too)
TAG_SIZE = 16
_NO_TAG = bytes(TAG_SIZE)
CAPABILITY = struct.Struct("<Q")
CAPABILITY_SIZE = CAPABILITY.size  # 8
_FLAGS = struct.Struct("<H")       # at offset 6

HELLO = struct.Struct("<4sB3x16s")           # magic, version, client nonce
WELCOME = struct.Struct("<4sBxH16s32s")      # magic, version, name len, server nonce, proof
PROOF_SIZE = 32
MAX_NAME = 1024


class FrameError(Exception):
    """The peer sent something we refuse; the connection must be closed."""


def _mac(key: bytes, msg: bytes) -> bytes:
    return hmac.digest(key, msg, hashlib.sha256)


class Frame(NamedTuple):
    """A checked header: what ``unpack_frame`` returns."""
    op: int
    status: int
    region: int
    offset: int
    length: int
    seq: int
    capability: int  # 0 = none
    # FLAG_PAYLOAD_TAG: a payload tag follows the payload (check_payload_tag).
    payload_tagged: bool = False
    # The header's own tag, which the payload tag is chained to.
    tag: bytes = _NO_TAG


def pack_header(session_key: bytes | None, op: int, region: int, offset: int, length: int,
                seq: int, status: int = 0, capability: int = 0, payload_tag: bool = False) -> bytes:
    """The header (56 bytes), plus the capability extension (8 more) when
    ``capability``.  ``payload_tag`` announces a payload tag after the payload
    (needs a session key: it is an HMAC)."""
    if payload_tag and session_key is None:
        raise ValueError("a payload tag needs a session key (transfer auth_token)")
    flags = (FLAG_CAPABILITY if capability else 0) | (FLAG_PAYLOAD_TAG if payload_tag else 0)
    ext = CAPABILITY.pack(capability) if capability else b""
    head = HEADER.pack(MAGIC, VERSION, op, flags, status, region, offset, length, seq, _NO_TAG)
    if session_key is None:
        return head + ext
    return head[:_SIGNED] + _mac(session_key, head[:_SIGNED] + ext)[:TAG_SIZE] + ext


def has_extension(head: bytes | bytearray | memoryview) -> bool:
    """Whether the 56-byte ``head`` announces a capability extension (read it
    next; ``unpack_frame`` checks everything, the flag included, by the tag)."""
    return bool(_FLAGS.unpack_from(head, 6)[0] & FLAG_CAPABILITY)


def unpack_frame(session_key: bytes | None, data: bytes) -> Frame:
    """Check magic/version/flags/tag of a header (56 bytes, or 64 with the
    capability extension); return its fields."""
    if len(data) < HEADER_SIZE:
        raise FrameError(f"short header ({len(data)} bytes)")
    magic, version, op, flags, status, region, offset, length, seq, tag = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FrameError("bad magic")
    if version != VERSION:
        raise FrameError(f"unsupported version {version}")
    if flags & ~_KNOWN_FLAGS:
        raise FrameError("reserved flags set")
    want = HEADER_SIZE + (CAPABILITY_SIZE if flags & FLAG_CAPABILITY else 0)
    if len(data) != want:
        raise FrameError(f"header of {len(data)} bytes, its flags say {want}")
    ext = data[HEADER_SIZE:]
    if session_key is not None:
        if not hmac.compare_digest(tag, _mac(session_key, data[:_SIGNED] + ext)[:TAG_SIZE]):
            raise FrameError("bad frame tag")
    elif tag != _NO_TAG:
        raise FrameError("unexpected frame tag")
    elif flags & FLAG_PAYLOAD_TAG:
        raise FrameError("payload tag announced without a session key")
    capability = CAPABILITY.unpack(ext)[0] if ext else 0
    if ext and not capability:
        raise FrameError("capability extension holding capability 0")
    return Frame(op, status, region, offset, length, seq, capability,
                 bool(flags & FLAG_PAYLOAD_TAG), tag)


def header_tag(head: bytes) -> bytes:
    """The tag field of a packed header (what a payload tag is chained to)."""
    return head[_SIGNED:_SIGNED + TAG_SIZE]


def payload_tag(session_key: bytes, head_tag: bytes, payload: memoryview | bytes) -> bytes:
    """The trailer sent after a payload whose header has FLAG_PAYLOAD_TAG."""
    mac = hmac.new(session_key, b"pay", hashlib.sha256)
    mac.update(head_tag)
    mac.update(payload)  # hashlib drops the GIL for large buffers
    return mac.digest()[:TAG_SIZE]


def check_payload_tag(session_key: bytes, frame: Frame, payload: memoryview | bytes,
                      trailer: bytes) -> None:
    """Raise FrameError unless ``trailer`` is the payload tag of ``payload``
    under ``frame``'s header."""
    if not hmac.compare_digest(trailer, payload_tag(session_key, frame.tag, payload)):
        raise FrameError("bad payload tag")


def unpack_header(session_key: bytes | None, data: bytes) -> tuple[int, int, int, int, int, int]:
    """Check magic/version/flags/tag; return (op, status, region, offset, length, seq)."""
    return tuple(unpack_frame(session_key, data)[:6])  # type: ignore[return-value]


def recv_frame(sock: socket.socket, session_key: bytes | None, buf: bytearray) -> Frame:
    """Read and check one header, with its extension if it has one; ``buf`` is
    the caller's scratch of at least HEADER_SIZE + CAPABILITY_SIZE bytes."""
    view = memoryview(buf)
    recv_exact(sock, view[:HEADER_SIZE])
    n = HEADER_SIZE
    if has_extension(view):
        recv_exact(sock, view[HEADER_SIZE:HEADER_SIZE + CAPABILITY_SIZE])
        n += CAPABILITY_SIZE
    return unpack_frame(session_key, bytes(view[:n]))


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
