"""Multi-NIC test: two network namespaces joined by two veth pairs.

    ns A  10.231.1.1 --veth-- 10.231.1.2  ns B     (link 1)
          10.231.2.1 --veth-- 10.231.2.2           (link 2)

Each namespace runs an engine with two "NICs" (its two addresses). Links
are shaped to 1 Gbit/s each so transfers last long enough to pull a link
mid-way. The initiator runs as a driver process inside ns A (this file,
``__main__``); it reports engine counters as JSON and the test checks them.
Needs root and ``ip netns``; skipped otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

# Root, `ip netns` and processes in namespaces: netns, and slow like every
# multi-process test (the fast lane is `-m "not slow"`).
pytestmark = [pytest.mark.netns, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NET = "10.231"  # private range, only configured inside the test namespaces
TOKEN = "netns-secret"


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


def _netns_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    probe = f"mcprobe{os.getpid()}"
    try:
        r = _sh("ip", "netns", "add", probe, check=False)
        if r.returncode:
            return f"ip netns add failed: {r.stderr.strip()}"
        _sh("ip", "netns", "del", probe, check=False)
    except FileNotFoundError:
        return "iproute2 not installed"
    return None


@pytest.fixture
def two_hosts():
    why = _netns_usable()
    if why:
        pytest.skip(f"netns test skipped: {why}")
    tag = f"{os.getpid() % 100000}"
    ns_a, ns_b = f"mcA{tag}", f"mcB{tag}"
    links = [(f"mc{tag}a1", f"mc{tag}b1", 1), (f"mc{tag}a2", f"mc{tag}b2", 2)]
    try:
        _sh("ip", "netns", "add", ns_a)
        _sh("ip", "netns", "add", ns_b)
        for ns in (ns_a, ns_b):
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        for a, b, k in links:
            _sh("ip", "link", "add", a, "netns", ns_a, "type", "veth", "peer", "name", b, "netns", ns_b)
            _sh("ip", "-n", ns_a, "addr", "add", f"{NET}.{k}.1/24", "dev", a)
            _sh("ip", "-n", ns_b, "addr", "add", f"{NET}.{k}.2/24", "dev", b)
            for ns, dev in ((ns_a, a), (ns_b, b)):
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", "1gbit", "burst", "256kb", "latency", "100ms", check=False)
        yield ns_a, ns_b, [a for a, _, _ in links]
    finally:
        for ns in (ns_a, ns_b):  # deleting a namespace deletes its veth ends
            _sh("ip", "netns", "del", ns, check=False)


def test_two_links_failover_and_recovery(two_hosts):
    ns_a, ns_b, devs_a = two_hosts
    size = 48 << 20
    env = dict(os.environ, PYTHONPATH=ROOT)
    peer = subprocess.Popen(
        ["ip", "netns", "exec", ns_b, sys.executable, "-m", "rdma.peer", "--name", "B", "--size", str(size),
         "--nics", f"{NET}.1.2,{NET}.2.2", "--token", TOKEN, "--set", "user_timeout_ms=1000"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        desc = peer.stdout.readline()
        assert desc, "peer did not start"
        out = subprocess.run(
            ["ip", "netns", "exec", ns_a, sys.executable, os.path.abspath(__file__), "driver", desc.strip(),
             devs_a[0], str(size)],
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=90)
        assert out.returncode == 0, out.stderr[-3000:]
        res = json.loads(out.stdout.strip().splitlines()[-1])
        peer.stdin.write(f"sha 0 {size}\n")
        peer.stdin.flush()
        remote_sha = json.loads(peer.stdout.readline())["sha"]
    finally:
        peer.stdin.close()
        peer.wait(10)
    print(json.dumps(res))
    p1, p2 = f"{NET}.1.1->{NET}.1.2", f"{NET}.2.1->{NET}.2.2"
    # 1. Both links carried slices of one transfer.
    assert res["phase1"][p1] > 0 and res["phase1"][p2] > 0, res
    # 2. Link 1 pulled mid-transfer: everything still completed, data intact.
    assert res["phase2_states"] == ["completed"] * len(res["phase2_states"]), res
    assert res["phase2"][p2] > res["phase1"][p2], res
    assert res["path_failures"] >= 1, res
    assert remote_sha == res["src_sha"]
    # 3. Link 1 back up: used again.
    assert res["phase3"].get(p1, 0) > res["phase2"].get(p1, 0), res
    assert res["read_back_ok"]


# -- driver, run inside namespace A -------------------------------------------

async def _drive(desc_json: str, dev: str, size: int) -> dict:
    import hashlib
    import time

    from rdma.config import TransferConfig
    from rdma.engine import TransferEngine
    from rdma.peer import pattern
    from rdma.types import READ, WRITE, TransferRequest

    desc = json.loads(desc_json)
    cfg = TransferConfig(transport="tcp", nics=[f"{NET}.1.1", f"{NET}.2.1"], auth_token=TOKEN,
                         slice_bytes=256 << 10, user_timeout_ms=1000, stall_timeout_s=1.0,
                         nic_backoff_s=0.3, nic_backoff_max_s=1.0, max_retries=8, request_timeout_s=40,
                         topology={"*": [[f"{NET}.1.1", f"{NET}.2.1"], []]})
    res: dict = {}
    async with TransferEngine(cfg, "A") as eng:
        eng.add_segment(desc)
        src = bytearray(pattern(42, size))
        res["src_sha"] = hashlib.sha256(src).hexdigest()
        r = eng.register_local_memory(src)
        await eng.transfer([TransferRequest(WRITE, r.id, 0, 16 << 20, "B", 0)])
        res["phase1"] = dict(eng.path_bytes)

        # Phase 2: 4 requests covering the buffer; pull link 1 once ~15% moved.
        quarter = size // 4
        bid = eng.allocate_batch(4)
        await eng.submit_transfer(bid, [TransferRequest(WRITE, r.id, i * quarter, quarter, "B", i * quarter)
                                        for i in range(4)])
        while sum(eng.transfer_status(bid, i).transferred_bytes for i in range(4)) < size * 0.15:
            await asyncio.sleep(0.005)
        proc = await asyncio.create_subprocess_exec("ip", "link", "set", "dev", dev, "down")
        await proc.wait()
        statuses = await eng.wait(bid, timeout=60)
        res["phase2_states"] = [s.state.value for s in statuses]
        res["phase2_reasons"] = [s.reason for s in statuses]
        res["phase2"] = dict(eng.path_bytes)
        res["path_failures"] = eng.path_failures
        eng.free_batch(bid)

        # Phase 3: link back; after the back-off a probe succeeds and it is used again.
        proc = await asyncio.create_subprocess_exec("ip", "link", "set", "dev", dev, "up")
        await proc.wait()
        deadline = time.monotonic() + 20
        p1 = f"{NET}.1.1->{NET}.1.2"
        while time.monotonic() < deadline and eng.path_bytes.get(p1, 0) <= res["phase2"].get(p1, 0):
            await eng.transfer([TransferRequest(WRITE, r.id, 0, 8 << 20, "B", 0)])
            await asyncio.sleep(0.2)
        res["phase3"] = dict(eng.path_bytes)
        dst = bytearray(size)
        d = eng.register_local_memory(dst)
        await eng.transfer([TransferRequest(READ, d.id, 0, size, "B", 0)])
        res["read_back_ok"] = dst == src
    return res


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "driver":
    sys.path.insert(0, ROOT)
    print(json.dumps(asyncio.run(_drive(sys.argv[2], sys.argv[3], int(sys.argv[4])))))
