"""Soak: replay a trace at a sustainable rate for a long time and watch every node.

    .venv/bin/python benchmarks/soak.py [--duration-s 1800] [--sample-s 10] [--rate 0.5]
        [--trace ../shared/traces/synthetic_trace.jsonl] [--prefill 2 --decode 1]
        [--url http://127.0.0.1:8000] [--json out.json]

Without ``--url`` it starts the same local cluster as ``mooncaked up --prefill P
--decode D`` (tiny model, small store); with it, it soaks a running cluster whose
nodes are on this machine (their PIDs come from each node's ``/admin/status``).
The requests are the trace's, one every 1/rate s, cycling through the trace,
streamed by the ``bench serve`` replayer.  Every ``--sample-s`` seconds, per node:
RSS (VmRSS of /proc/PID/status), open fds (/proc/PID/fd), and the
``collections`` object of ``/admin/status`` (asyncio tasks, threads, and the
daemon's long-lived collections).  The report (JSON on stdout): per node the RSS
slope (least squares over the samples after ``--warmup-s``, KiB/min), RSS, fds,
tasks and every collection at start and end (and their maximum), plus how the
requests ended.  A leak shows as a steady RSS slope or a collection that only
grows; a bounded daemon's collections come back to their start values when idle.

Not a test (it takes half an hour by default): docs/soak.md has the figures.
Without the trace file it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mooncaked.benchserve.replay import ReplayConfig, Replayer  # noqa: E402
from mooncaked.benchserve.workload import ReplayRequest, WorkloadConfig, build_workload  # noqa: E402
from mooncaked.local_cluster import LocalCluster  # noqa: E402

DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "synthetic_trace.jsonl"
CLUSTER = ["store.capacity_bytes=67108864", "store.block_size=16", "model.prefill_chunk=64",
           "model.torch_threads=1"]


def proc_sample(pid: int) -> dict[str, int]:
    """RSS (KiB) and open fds of a live process."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
                break
    return {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def slope_per_min(ts: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over ts (seconds), per minute."""
    n = len(ts)
    if n < 2:
        return None
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return None
    return 60.0 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var


async def node_status(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/admin/status") as resp:
        return await resp.json()


async def discover(http: aiohttp.ClientSession, conductor: str) -> dict[str, tuple[str, int]]:
    """node id -> (url, pid), the conductor included."""
    top = await node_status(http, conductor)
    nodes = {top["node_id"]: (conductor, top["pid"])}
    for peer in top.get("peers", []):
        st = await node_status(http, peer["url"])
        nodes[st["node_id"]] = (peer["url"], st["pid"])
    return nodes


async def sampler(conductor: str, every_s: float, stop: asyncio.Event,
                  samples: dict[str, list[dict[str, Any]]], t0: float) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        nodes = await discover(http, conductor)
        while True:
            t = time.monotonic() - t0
            for node_id, (url, pid) in nodes.items():
                row: dict[str, Any] = {"t_s": round(t, 2)}
                try:
                    row.update(proc_sample(pid))
                    row["collections"] = (await node_status(http, url)).get("collections", {})
                except (OSError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"
                samples.setdefault(node_id, []).append(row)
            try:
                await asyncio.wait_for(stop.wait(), every_s)
                return
            except asyncio.TimeoutError:
                pass


def node_report(rows: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    good = [r for r in rows if "error" not in r]
    if not good:
        return {"error": rows[-1].get("error") if rows else "no samples"}
    fit = [r for r in good if r["t_s"] >= warmup_s] or good
    first, last = good[0], good[-1]
    names = sorted({k for r in good for k in r["collections"]})
    return {
        "samples": len(good), "errors": len(rows) - len(good),
        "rss_slope_kib_per_min": _round(slope_per_min([r["t_s"] for r in fit],
                                                      [r["rss_kib"] for r in fit])),
        "rss_slope_fit_from_s": fit[0]["t_s"],
        "rss_kib": {"start": first["rss_kib"], "end": last["rss_kib"],
                    "max": max(r["rss_kib"] for r in good)},
        "fds": {"start": first["fds"], "end": last["fds"], "max": max(r["fds"] for r in good)},
        "collections": {n: {"start": first["collections"].get(n), "end": last["collections"].get(n),
                            "max": max(r["collections"].get(n, 0) for r in good)} for n in names},
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def workload(trace: Path, rate: float, duration_s: float, length_scale: float,
             max_output: int) -> list[ReplayRequest]:
    """One request every 1/rate s for the whole run, cycling through the trace."""
    base = build_workload(WorkloadConfig(trace=str(trace), arrival="rate", rate=rate,
                                         length_scale=length_scale, max_output_tokens=max_output))
    need = int(duration_s * rate) + 1
    return [dataclasses.replace(base[i % len(base)], index=i, arrival_s=i / rate)
            for i in range(need)]


async def soak(url: str, reqs: list[ReplayRequest], args: argparse.Namespace) -> dict[str, Any]:
    samples: dict[str, list[dict[str, Any]]] = {}
    stop = asyncio.Event()
    t0 = time.monotonic()
    watch = asyncio.create_task(sampler(url, args.sample_s, stop, samples, t0))
    replayer = Replayer(ReplayConfig(url=url, max_duration_s=args.duration_s,
                                     request_timeout_s=120, server_traces=False))
    results = await replayer.run(reqs)
    # Idle for two samples so that the end values are those of a quiet daemon.
    await asyncio.sleep(2 * args.sample_s)
    stop.set()
    await watch
    ended = Counter(r.status for r in results if r.status != "not_sent")
    return {
        "benchmark": "soak", "duration_s": args.duration_s, "sample_s": args.sample_s,
        "rate_per_s": args.rate, "warmup_s": args.warmup_s,
        "requests": dict(ended), "http_errors": dict(Counter(r.http_status for r in results
                                                           if r.status not in ("ok", "not_sent"))),
        "nodes": {n: node_report(rows, args.warmup_s) for n, rows in samples.items()},
        "note": "shared 2-core machine: other work ran beside the cluster",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--duration-s", type=float, default=1800.0)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=60.0,
                    help="samples before this are left out of the RSS slope (allocator warm-up)")
    ap.add_argument("--rate", type=float, default=0.5, help="requests per second")
    ap.add_argument("--length-scale", type=float, default=0.01,
                    help="prompt lengths times this (the tiny model is small)")
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--url", default="", help="soak this running cluster instead of starting one")
    ap.add_argument("--json", default="", help="also write the report here")
    args = ap.parse_args(argv)
    if not args.trace.is_file():
        print(f"soak: skipped: no trace at {args.trace} (pass --trace)", file=sys.stderr)
        return 0
    reqs = workload(args.trace, args.rate, args.duration_s, args.length_scale, args.max_output)
    cluster = None
    url = args.url
    if not url:
        log_dir = Path(tempfile.mkdtemp(prefix="mooncaked-soak-"))
        cluster = LocalCluster(prefill=args.prefill, decode=args.decode, model="tiny",
                               overrides=CLUSTER, log_dir=log_dir)
        print(f"soak: starting a local cluster (logs in {log_dir})", file=sys.stderr)
        cluster.start(timeout_s=120)
        url = cluster.url
    try:
        print(f"soak: {len(reqs)} requests over {args.duration_s:.0f} s against {url}",
              file=sys.stderr)
        report = asyncio.run(soak(url, reqs, args))
    finally:
        if cluster is not None:
            cluster.stop()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
