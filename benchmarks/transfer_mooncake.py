"""Official Mooncake transfer engine, TCP transport: 1 GiB of WRITEs in fixed-size requests.

Run with a Python that has ``mooncake-transfer-engine-non-cuda`` installed
(transfer_compare.py does this in a separate venv):

    python transfer_mooncake.py --total 1073741824 --req 4194304 --batch 8

Spawns the target as a second process (P2PHANDSHAKE metadata, no etcd),
prints one JSON line with GB/s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def target(size: int) -> None:
    from mooncake.engine import TransferEngine
    eng = TransferEngine()
    rc = eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"initialize failed: {rc}")
    addr = eng.allocate_managed_buffer(size)
    print(json.dumps({"port": eng.get_rpc_port(), "addr": addr}), flush=True)
    sys.stdin.readline()  # serve until the parent closes stdin


def initiator(a) -> dict:
    from mooncake.engine import TransferEngine
    child = subprocess.Popen([sys.executable, __file__, "--target", str(a.buf)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(child.stdout.readline())
        eng = TransferEngine()
        if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise SystemExit("initialize failed")
        src = eng.allocate_managed_buffer(a.buf)
        peer = f"127.0.0.1:{info['port']}"
        slots = a.buf // a.req
        n = a.total // a.req
        # warm-up (connection + handshake)
        if eng.batch_transfer_sync_write(peer, [src], [info["addr"]], [a.req]) != 0:
            raise SystemExit("warm-up write failed")
        t0 = time.perf_counter()
        done = 0
        while done < n:
            k = min(a.batch, n - done)
            offs = [((done + i) % slots) * a.req for i in range(k)]
            rc = eng.batch_transfer_sync_write(peer, [src + o for o in offs], [info["addr"] + o for o in offs],
                                               [a.req] * k)
            if rc != 0:
                raise SystemExit(f"batch_transfer_sync_write failed: {rc}")
            done += k
        dt = time.perf_counter() - t0
        return {"system": "mooncake-te-tcp", "total_bytes": n * a.req, "request_bytes": a.req,
                "batch": a.batch, "seconds": dt, "GBps": n * a.req / dt / 1e9}
    finally:
        child.stdin.close()
        child.wait(10)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=int, default=0)
    ap.add_argument("--total", type=int, default=1 << 30)
    ap.add_argument("--req", type=int, default=4 << 20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--buf", type=int, default=256 << 20)
    a = ap.parse_args()
    if a.target:
        target(a.target)
    else:
        print(json.dumps(initiator(a)))
