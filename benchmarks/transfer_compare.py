"""One run, three systems, same loopback: iperf3 single stream, our engine, Mooncake TCP.

    .venv/bin/python benchmarks/transfer_compare.py [--mooncake-python /tmp/mcvenv/bin/python]
                                                     [--rounds 3] [--json out.json]

Workload for both transfer engines: 1 GiB of WRITEs in 4 MiB requests
between two processes. Ours is reported twice: best of concurrency 1/4/8
with the default 2 connections per path, and held to one connection and
one request at a time (the like-for-like match for iperf3's one stream).
Mooncake is reported at the better of batch 1 and batch 8. Each system is measured ``rounds`` times,
interleaved (so background load hits all alike), and the best and median
rounds are reported. Needs ``iperf3`` (apt) and a Python with
``mooncake-transfer-engine-non-cuda`` (pip; a separate venv is fine);
a missing one is reported as such, not guessed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from rdma import bench  # noqa: E402

TOTAL, REQ = 1 << 30, 4 << 20


def iperf3_single_stream(seconds: int = 3) -> float:
    port = "5399"
    srv = subprocess.Popen(["iperf3", "-s", "-1", "-p", port], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", port, "-t", str(seconds), "-J"],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8e9
    finally:
        srv.wait(10)


def ours(concurrency: list[int], config: dict | None = None) -> dict:
    res = bench.run({"sizes": [REQ], "concurrency": concurrency, "op": "write", "total": TOTAL,
                     "config": config or {}})
    best = max(res["results"], key=lambda r: r["GBps"])
    return {"GBps": best["GBps"], "concurrency": best["concurrency"], "all": res["results"]}


def mooncake(py: str, batch: int) -> float:
    out = subprocess.run([py, os.path.join(HERE, "transfer_mooncake.py"), "--total", str(TOTAL), "--req", str(REQ),
                          "--batch", str(batch)], capture_output=True, text=True, timeout=300, cwd="/tmp")
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])["GBps"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mooncake-python", default="/tmp/mcvenv/bin/python")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--mooncake-batch", default="1,8")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    conc = [int(x) for x in a.concurrency.split(",")]
    mbatch = [int(x) for x in a.mooncake_batch.split(",")]
    have_iperf = shutil.which("iperf3") is not None
    have_mc = os.path.exists(a.mooncake_python)
    rounds: list[dict] = []
    for _ in range(a.rounds):
        r: dict = {}
        r["iperf3_single_stream_GBps"] = round(iperf3_single_stream(), 3) if have_iperf else None
        o = ours(conc)
        r["mooncaked_GBps"], r["mooncaked_concurrency"] = o["GBps"], o["concurrency"]
        # Same engine held to ONE tcp connection and one request at a time:
        # the like-for-like figure against iperf3's single stream.
        r["mooncaked_one_connection_GBps"] = ours([1], {"connections_per_peer": 1})["GBps"]
        if have_mc:
            per = {b: round(mooncake(a.mooncake_python, b), 3) for b in mbatch}
            best_b = max(per, key=per.get)
            r["mooncake_tcp_GBps"], r["mooncake_batch"] = per[best_b], best_b
        rounds.append(r)
        print(json.dumps(r), file=sys.stderr)

    def summary(key: str) -> dict | None:
        xs = [r[key] for r in rounds if r.get(key) is not None]
        return {"best": max(xs), "median": round(statistics.median(xs), 3)} if xs else None

    out = {
        "workload": "1 GiB of WRITEs in 4 MiB requests, two processes, loopback",
        "note": bench.NOTE,
        "iperf3_single_stream": summary("iperf3_single_stream_GBps") or "iperf3 not installed",
        "mooncaked": summary("mooncaked_GBps"),
        "mooncaked_one_connection": summary("mooncaked_one_connection_GBps"),
        "mooncake_te_tcp": summary("mooncake_tcp_GBps") or f"no mooncake python at {a.mooncake_python}",
        "rounds": rounds,
    }
    if out["mooncaked"] and isinstance(out["iperf3_single_stream"], dict):
        out["ratio_vs_iperf3_median"] = round(out["mooncaked"]["median"] / out["iperf3_single_stream"]["median"], 3)
        out["ratio_one_connection_vs_iperf3_median"] = round(
            out["mooncaked_one_connection"]["median"] / out["iperf3_single_stream"]["median"], 3)
    if out["mooncaked"] and isinstance(out["mooncake_te_tcp"], dict):
        out["speedup_vs_mooncake_tcp_median"] = round(out["mooncaked"]["median"] / out["mooncake_te_tcp"]["median"], 2)
    bench.emit_json(out, a.json)


if __name__ == "__main__":
    main()
