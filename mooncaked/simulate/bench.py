"""Simulator speed: simulated requests per wall second, printed as JSON.

`python -m mooncaked.simulate.bench --trace FILE [--nodes 16] [--scale-to N --big-nodes 512]`

The large case tiles the trace: copy i gets its hash ids offset (so copies
share nothing) and all copies overlap in time, stretched so that the total
request rate is (big nodes / nodes) x the trace's: the rate per node is
kept, giving N requests over 512 nodes.
"""
from __future__ import annotations

import argparse
import json
import time

from .config import SimConfig
from .engine import run_simulation
from .trace import TraceRequest, load_trace


def tile(trace: list[TraceRequest], n: int, rate_scale: float) -> list[TraceRequest]:
    """n requests from copies of `trace` with disjoint hash ids, at rate_scale x its rate."""
    span = max(r.hash_ids[-1] for r in trace if r.hash_ids) + 1
    out = []
    copies = -(-n // len(trace))
    # all copies overlap in time; stretch so the total rate is rate_scale x
    stretch = copies / rate_scale
    for c in range(copies):
        for r in trace:
            if len(out) >= n:
                break
            out.append(TraceRequest(len(out), r.arrival_s * stretch + c * 1e-3,
                                    r.input_length, r.output_length,
                                    tuple(h + c * span for h in r.hash_ids)))
    out.sort(key=lambda r: r.arrival_s)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="simulator speed")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--policy", default="mooncake")
    ap.add_argument("--scale-to", type=int, default=0, help="also run a tiled trace of N")
    ap.add_argument("--big-nodes", type=int, default=512)
    a = ap.parse_args(argv)
    trace = load_trace(a.trace)
    out = {"bench": "mooncaked.simulate speed",
           "note": "shared 2-core machine, one Python process", "runs": []}
    cases = [(trace, a.nodes)]
    if a.scale_to:
        cases.append((tile(trace, a.scale_to, a.big_nodes / a.nodes), a.big_nodes))
    for reqs, nodes in cases:
        cfg = SimConfig(prefill=nodes // 2, decode=nodes - nodes // 2, policy=a.policy)
        t = time.perf_counter()
        s = run_simulation(cfg, reqs).summary
        wall = time.perf_counter() - t
        out["runs"].append({"requests": len(reqs), "nodes": nodes, "policy": a.policy,
                            "wall_s": round(wall, 2),
                            "simulated_requests_per_wall_s": round(len(reqs) / wall, 1),
                            "simulated_seconds": round(s["simulated_seconds"], 1),
                            "ttft_avg_s": round(s["ttft_avg_s"], 3),
                            "hit_rate": round(s["hit_rate"], 4)})
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
