"""RDMA transport: the parts testable without a device, and a device test that skips.

The QP exchange rides on the tcp listener (OP_QP_CONNECT); we check that
path with a stand-in acceptor, including the "dropped on both sides" rule:
closing the control connection runs the target's QP cleanup.
"""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from rdma import frames, verbs
from rdma.config import TransferConfig
from rdma.engine import TransferEngine
from rdma.tcp import TcpListener
from rdma.types import Region


def _listener(acceptor):
    regions = {0: Region(0, 16, "cpu:0", memoryview(bytearray(16)))}
    lst = TcpListener("127.0.0.1", 0, "seg", regions, "tok", 1000, 1 << 20, qp_acceptor=acceptor)
    lst.start()
    return lst


def _qp_connect(lst, body: bytes):
    s = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
    key, _ = frames.client_handshake(s, "tok")
    s.sendall(frames.pack_header(key, frames.OP_QP_CONNECT, 0, 0, len(body), 1) + body)
    return s, key


def _assert_dropped(s: socket.socket) -> None:
    """The listener closed the connection (EOF or reset), then we close ours."""
    s.settimeout(5)
    try:
        assert s.recv(1) == b""
    except ConnectionResetError:
        pass
    s.close()


def test_qp_exchange_and_cleanup_on_close():
    seen, cleaned = [], []

    def acceptor(req):
        seen.append(req)
        return {"qpn": 77, "lid": 1, "gid": "::", "psn": 5, "mtu": 3}, lambda: cleaned.append(True)

    lst = _listener(acceptor)
    try:
        s, key = _qp_connect(lst, json.dumps({"dev": "mlx5_0", "info": {"qpn": 9}}).encode())
        op, status, _, _, length, seq = frames.unpack_header(key, frames.recv_bytes(s, frames.HEADER_SIZE))
        assert (op, status, seq) == (frames.OP_QP_REPLY, 0, 1)
        assert json.loads(frames.recv_bytes(s, length))["qpn"] == 77
        assert seen == [{"dev": "mlx5_0", "info": {"qpn": 9}}]
        assert not cleaned
        s.close()
        deadline = time.monotonic() + 5
        while not cleaned and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cleaned == [True]
    finally:
        lst.close()


@pytest.mark.parametrize("body", [b"{not json", b"x" * (frames.MAX_QP_INFO + 1)])
def test_qp_exchange_rejects_garbage(body):
    lst = _listener(lambda req: ({}, lambda: None))
    try:
        s, _ = _qp_connect(lst, body)
        _assert_dropped(s)
        assert lst.refused == 1
    finally:
        lst.close()


def test_qp_connect_refused_on_tcp_only_listener():
    lst = _listener(None)
    try:
        s, _ = _qp_connect(lst, b"{}")
        _assert_dropped(s)
    finally:
        lst.close()


def test_buffer_address_matches_numpy():
    buf = bytearray(4096)
    assert verbs.buffer_address(memoryview(buf)) == np.frombuffer(buf, dtype=np.uint8).ctypes.data


async def test_auto_falls_back_to_tcp_without_device(caplog):
    ok, why = verbs.probe()
    if ok:
        pytest.skip(f"an RDMA device is present ({why})")
    caplog.set_level("INFO")
    async with TransferEngine(TransferConfig(), "auto") as eng:
        assert eng.transport == "tcp"
    assert sum("no RDMA here" in r.message for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="no RDMA here"):
        await TransferEngine(TransferConfig(transport="rdma"), "x").start()


async def test_rdma_loopback_write_read():
    ok, why = verbs.probe()
    if not ok:
        pytest.skip(f"needs an RDMA device: {why}")
    cfg = TransferConfig(transport="rdma")
    async with TransferEngine(cfg, "A") as a, TransferEngine(cfg, "B") as b:
        src = bytearray(np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
        dst = bytearray(1 << 20)
        ra = a.register_local_memory(src)
        b.register_local_memory(dst)
        a.add_segment(b.segment_descriptor())
        from rdma.types import READ, WRITE, TransferRequest
        await a.transfer([TransferRequest(WRITE, ra.id, 0, 1 << 20, "B", 0)])
        assert dst == src
        back = bytearray(1 << 20)
        rb = a.register_local_memory(back)
        await a.transfer([TransferRequest(READ, rb.id, 0, 1 << 20, "B", 0)])
        assert back == src
