"""Unit tests: SIEVE pool, slicing, path choice and back-off, frames, config, topology."""

from __future__ import annotations

import os
import time

import pytest

from rdma import frames, verbs
from rdma.config import TransferConfig
from rdma.endpoint_pool import SievePool
from rdma.slices import PathTable, cut, plan_paths
from rdma.topology import Topology, build_matrix, discover_matrix, discover_rdma_devices


# -- SIEVE ------------------------------------------------------------------

def test_sieve_bound_and_fifo_without_hits():
    evicted = []
    pool = SievePool(3, lambda k, v: evicted.append(k))
    for k in "abcd":
        pool.put(k, k.upper())
    assert len(pool) == 3 and evicted == ["a"]
    assert pool.keys() == ["d", "c", "b"]


def test_sieve_visited_entries_survive():
    pool: SievePool[str, int] = SievePool(3)
    for i, k in enumerate("abc"):
        pool.put(k, i)
    assert pool.get("a") == 0  # a is oldest but visited
    out = pool.put("d", 3)
    assert out == [("b", 1)]
    assert "a" in pool and "b" not in pool
    # The hand resumes just above the victim, walking towards the head (c,
    # then d), and only wraps to the tail at the head: a, whose bit was
    # cleared, survives until the hand comes round again.
    assert pool.put("e", 4) == [("c", 2)]
    assert pool.put("f", 5) == [("d", 3)]
    assert "a" in pool


def test_sieve_hand_resumes_and_remove():
    pool: SievePool[int, int] = SievePool(4)
    for i in range(4):
        pool.put(i, i)
    pool.get(0)
    pool.get(1)
    assert pool.put(4, 4) == [(2, 2)]
    assert pool.remove(3) == 3 and pool.remove(3) is None
    pool.put(5, 5)
    assert len(pool) == 4
    # Everything visited: one full sweep clears bits, then the oldest goes.
    for k in pool.keys():
        pool.get(k)
    assert len(pool.put(6, 6)) == 1 and len(pool) == 4


def test_sieve_classic_sequence():
    """One-hit wonders are evicted before a repeatedly used key."""
    pool: SievePool[str, None] = SievePool(2)
    pool.put("hot", None)
    for i in range(20):
        pool.get("hot")
        pool.put(f"cold{i}", None)
        assert "hot" in pool
    assert pool.evictions == 19


def test_sieve_capacity_validated():
    with pytest.raises(ValueError, match="capacity"):
        SievePool(0)


# -- slicing and paths ----------------------------------------------------------

@pytest.mark.parametrize("length,slice_bytes", [(0, 4), (1, 4), (4, 4), (9, 4), (1000, 7)])
def test_cut_covers_exactly(length, slice_bytes):
    parts = cut(10, 20, length, slice_bytes)
    assert sum(p.length for p in parts) == length
    pos = 0
    for p in parts:
        assert p.local_offset == 10 + pos and p.remote_offset == 20 + pos and 0 < p.length <= slice_bytes
        pos += p.length
    with pytest.raises(ValueError):
        cut(0, 0, 1, 0)


def test_plan_paths_rail_aligned_then_fallback():
    local = Topology({"cpu:0": [["a0", "a1"], ["a2"]]})
    remote = Topology({"*": [["b0", "b1"], []]})
    primary, fallback = plan_paths(local, "cpu:0", remote, "cpu:0")
    assert primary == [("a0", "b0"), ("a1", "b1")]
    assert ("a0", "b1") in fallback and ("a2", "b0") in fallback and ("a0", "b0") not in fallback


def test_path_table_backoff_probe_and_recovery():
    t = PathTable(backoff_s=0.05, backoff_max_s=0.2)
    prim = [("a", "x"), ("b", "y")]
    t.add_inflight("s", ("a", "x"), 100)
    assert t.choose("s", prim, []) == ("b", "y")  # least loaded
    t.add_inflight("s", ("a", "x"), -100)
    t.failure("s", ("a", "x"), "down")
    t.failure("s", ("a", "x"), "down again")  # same outage: no escalation
    assert t.health[("s", ("a", "x"))].failures == 1
    for _ in range(5):
        assert t.choose("s", prim, []) == ("b", "y")
    time.sleep(0.06)
    t.add_inflight("s", ("b", "y"), 10)
    assert t.choose("s", prim, []) == ("a", "x")  # probe
    assert t.is_probe("s", ("a", "x"))
    assert t.choose("s", prim, []) == ("b", "y")  # only one probe at a time
    t.failure("s", ("a", "x"), "probe failed")
    assert t.health[("s", ("a", "x"))].failures == 2
    time.sleep(0.11)
    assert t.choose("s", prim, []) == ("a", "x")
    t.success("s", ("a", "x"))
    assert ("s", ("a", "x")) not in t.health


def test_no_usable_path():
    t = PathTable(backoff_s=10, backoff_max_s=10)
    t.failure("s", ("a", "x"), "x")
    assert t.choose("s", [("a", "x")], []) is None
    assert t.next_usable_at("s", [("a", "x")]) > time.monotonic()


# -- frames -----------------------------------------------------------------

def test_header_roundtrip_and_tamper():
    key = b"k" * 32
    h = frames.pack_header(key, frames.OP_WRITE, 3, 1 << 33, 4096, 7)
    assert len(h) == frames.HEADER_SIZE == 56
    assert frames.unpack_header(key, h) == (frames.OP_WRITE, 0, 3, 1 << 33, 4096, 7)
    bad = bytearray(h)
    bad[16] ^= 1  # offset bit flipped in transit / by an attacker
    with pytest.raises(frames.FrameError, match="tag"):
        frames.unpack_header(key, bytes(bad))
    with pytest.raises(frames.FrameError, match="tag"):
        frames.unpack_header(b"other", h)
    with pytest.raises(frames.FrameError, match="magic"):
        frames.unpack_header(None, b"XXXX" + frames.pack_header(None, 1, 0, 0, 0, 1)[4:])
    with pytest.raises(frames.FrameError, match="unexpected frame tag"):
        frames.unpack_header(None, h)


def test_handshake_over_socketpair():
    import socket
    import threading
    a, b = socket.socketpair()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("srv", frames.server_handshake(b, "tok", "seg")))
    t.start()
    key, name = frames.client_handshake(a, "tok")
    t.join()
    assert name == "seg" and key == out["srv"] and len(key) == 32
    a.close()
    b.close()


# -- config -----------------------------------------------------------------

@pytest.mark.parametrize("kw,field", [
    ({"transport": "udp"}, "transport"), ({"nics": []}, "nics"), ({"nics": ["a", "a"]}, "nics"),
    ({"port": 70000}, "port"), ({"connections_per_peer": 0}, "connections_per_peer"),
    ({"max_endpoints": 0}, "max_endpoints"), ({"request_timeout_s": 0}, "request_timeout_s"),
    ({"max_retries": -1}, "max_retries"), ({"slice_bytes": -1}, "slice_bytes"),
    ({"topology": {"*": [["nope"], []]}}, "topology"), ({"topology": {"*": [[]]}}, "topology"),
])
def test_config_validation_names_field(kw, field):
    with pytest.raises(ValueError, match=field):
        TransferConfig(**kw)


def test_config_defaults():
    c = TransferConfig()
    assert c.transport == "auto" and c.nics == ["127.0.0.1"]
    assert c.effective_slice_bytes("tcp") == 1 << 20 and c.effective_slice_bytes("rdma") == 64 << 10


# -- topology -----------------------------------------------------------------

def test_matrix_from_fake_sysfs(tmp_path):
    for dev, node in (("mlx5_0", 0), ("mlx5_1", 1), ("mlx5_2", 0)):
        d = tmp_path / "class" / "infiniband" / dev / "device"
        (d / "net" / f"eth_{dev}").mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    devs = discover_rdma_devices(str(tmp_path))
    assert [(d["name"], d["numa"]) for d in devs] == [("mlx5_0", 0), ("mlx5_1", 1), ("mlx5_2", 0)]
    m = discover_matrix(["mlx5_0", "mlx5_1", "mlx5_2"], str(tmp_path))
    assert m["cpu:0"] == [["mlx5_0", "mlx5_2"], ["mlx5_1"]]
    assert m["cpu:1"] == [["mlx5_1"], ["mlx5_0", "mlx5_2"]]
    topo = Topology(m)
    assert topo.lists("cpu:1") == (["mlx5_1"], ["mlx5_0", "mlx5_2"])
    assert topo.lists("cuda:3")[0] == ["mlx5_0", "mlx5_1", "mlx5_2"]  # falls back to "*"


def test_matrix_real_host_does_not_crash():
    m = discover_matrix(["127.0.0.1"])
    assert m["*"] == [["127.0.0.1"], []]
    assert build_matrix(["x"], {"x": -1}) == {"*": [["x"], []]}


def test_verbs_probe_reports_reason():
    ok, why = verbs.probe()
    if ok:
        pytest.skip(f"RDMA device present ({why}); the no-device path is not exercised here")
    assert why  # e.g. "PyverbsRDMAError: Failed to get devices list"


@pytest.mark.skipif(not os.path.isdir("/sys/class/infiniband"), reason="no RDMA device: /sys/class/infiniband absent")
def test_verbs_device_smoke():
    ok, why = verbs.probe()
    assert ok, why
