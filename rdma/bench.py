"""Transfer benchmark: two processes, 1 GiB moved in requests of a given size.

    python -m rdma.bench [--sizes 131072,4194304,16777216] [--concurrency 1,8,64]
                         [--op write|read] [--total 1073741824] [--json out.json]
                         [--guard PAGE_BYTES]

For every (request size, concurrency) pair, ``concurrency`` workers issue
requests back to back through ``TransferEngine.transfer`` until ``total``
bytes moved; reports GB/s and per-request latency percentiles. The target
is a separate ``python -m rdma.peer`` process on loopback. ``run(args)``
is the same as a dict-in/dict-out function for ``mooncaked bench transfer``.
``--guard PAGE_BYTES`` puts a write guard (``PageGrants`` over pages of that
size, all granted) on the target region and sends every request with its
capability: what a decode node's KV region costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from .config import TransferConfig
from .engine import TransferEngine
from .peer import PeerProcess
from .types import READ, WRITE, TransferRequest

BUF = 256 << 20
NOTE = "figures taken on a shared 2-core machine over loopback; other work ran beside them"


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def _one(eng: TransferEngine, region: int, op, size: int, conc: int, total: int,
               capability: int = 0) -> dict:
    n = max(1, total // size)
    slots = max(1, BUF // size)
    lat: list[float] = []
    next_i = 0

    async def worker() -> None:
        nonlocal next_i
        while next_i < n:
            i = next_i
            next_i += 1
            off = (i % slots) * size
            t = time.perf_counter()
            await eng.transfer([TransferRequest(op, region, off, size, "bench-target", off,
                                                capability=capability)])
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    dt = time.perf_counter() - t0
    return {"request_bytes": size, "concurrency": conc, "requests": n, "seconds": round(dt, 4),
            "GBps": round(n * size / dt / 1e9, 3),
            "latency_ms": {p: round(_pct(lat, q) * 1e3, 3) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))}}


async def _run(args: dict) -> dict:
    cfg_kw = dict(args.get("config", {}))
    cfg_kw.setdefault("transport", "tcp")
    peer = PeerProcess("bench-target", BUF, token=cfg_kw.get("auth_token", ""),
                       settings={k: v for k, v in cfg_kw.items() if k not in ("transport", "auth_token")})
    try:
        eng = TransferEngine(TransferConfig(**cfg_kw), "bench-initiator")
        await eng.start()
        try:
            eng.add_segment(peer.descriptor)
            buf = bytearray(os.urandom(1 << 20) * (BUF >> 20))
            region = eng.register_local_memory(buf)
            op = READ if args.get("op", "write") == "read" else WRITE
            guard = int(args.get("guard", 0))
            cap = peer.cmd(f"guard {guard}")["capability"] if guard else 0
            await eng.transfer([TransferRequest(op, region.id, 0, 4 << 20, "bench-target", 0,
                                                capability=cap)])  # warm-up
            results = []
            for size in args.get("sizes", [128 << 10, 1 << 20, 4 << 20, 16 << 20]):
                for conc in args.get("concurrency", [1, 8, 64]):
                    results.append(await _one(eng, region.id, op, size, conc, args.get("total", 1 << 30),
                                              cap))
            return {"benchmark": "transfer", "transport": eng.transport, "op": op.name.lower(),
                    "write_guard_page_bytes": guard,
                    "slice_bytes": eng.slice_bytes, "total_bytes_per_point": args.get("total", 1 << 30),
                    "note": NOTE, "results": results, "engine_stats": eng.stats()}
        finally:
            await eng.close()
    finally:
        peer.close()


def run(args: dict) -> dict:
    """Entry point for ``mooncaked bench transfer``; keys: sizes, concurrency, op, total, config,
    guard (page bytes of a write guard on the target region; 0 = none)."""
    try:
        import uvloop
        return uvloop.run(_run(args))
    except ImportError:
        return asyncio.run(_run(args))


def emit_json(result: dict, path: str = "") -> None:
    """Print a benchmark's result as JSON, and write it to ``path`` too if given."""
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="131072,1048576,4194304,16777216")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--op", choices=("write", "read"), default="write")
    ap.add_argument("--total", type=int, default=1 << 30)
    ap.add_argument("--set", action="append", default=[], help="TransferConfig field=json value")
    ap.add_argument("--json", default="", help="also write the result here")
    ap.add_argument("--guard", type=int, default=0, metavar="PAGE_BYTES",
                    help="write-guard the target region in pages of this size (0 = none)")
    a = ap.parse_args(argv)
    out = run({"sizes": [int(x) for x in a.sizes.split(",")],
               "concurrency": [int(x) for x in a.concurrency.split(",")],
               "op": a.op, "total": a.total, "guard": a.guard,
               "config": {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}})
    emit_json(out, a.json)


if __name__ == "__main__":
    main()
