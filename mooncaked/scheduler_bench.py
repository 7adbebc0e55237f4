"""Benchmark: one scheduling decision at scale, printed as JSON.

`python -m mooncaked.scheduler_bench [--blocks N] [--nodes N] [--prompt-tokens N]`

Builds a global index of `--blocks` distinct 64-bit keys spread over the
prefill nodes (plus a shared 128k-token prompt prefix held, to varying
lengths, by every node so that the lookup walks all 512 keys with all
nodes matching: the worst case), then times `Scheduler.schedule` with the
mooncake policy.
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import time

from roles.scheduling.decode_estimator import DecodeEstimator
from roles.scheduling.estimators import FlopsPrefillEstimator, ModelShape
from roles.scheduling.transfer_estimator import TransferEstimator
from roles.scheduling.scheduler import Scheduler, SchedulerConfig
from roles.scheduling.state import Decision, ScheduleRequest


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=10_000_000)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128 * 1024)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args(argv)

    rng = random.Random(0)
    shape = ModelShape()
    sched = Scheduler(SchedulerConfig(ttft_slo_s=1e9, tbt_slo_s=1e9),
                      FlopsPrefillEstimator(shape, 8 * 312e12, 0.5),
                      TransferEstimator(800e9 / 8), DecodeEstimator.from_hardware(shape, 16e12))
    nodes = [f"p{i}" for i in range(a.nodes)]
    for n in nodes:
        sched.add_prefill_node(n)
    sched.add_decode_node("d0", page_budget=10**9, page_tokens=a.block_size)
    rss0 = _rss_mib()
    t0 = time.perf_counter()
    per_node = a.blocks // a.nodes
    for n in nodes:
        sched.index.add(n, [rng.getrandbits(64) for _ in range(per_node)])
    n_keys = -(-a.prompt_tokens // a.block_size)
    prompt_keys = tuple(rng.getrandbits(64) for _ in range(n_keys))
    for i, n in enumerate(nodes):  # node i holds a prefix of length ~ i/nodes
        sched.index.add(n, prompt_keys[: max(1, n_keys * (i + 1) // a.nodes)])
    build_s = time.perf_counter() - t0
    rss1 = _rss_mib()

    lat = []
    d = None
    for r in range(a.repeats):
        req = ScheduleRequest(f"r{r}", prompt_keys, a.prompt_tokens, a.block_size, 100)
        t = time.perf_counter()
        d = sched.schedule(req, now=float(r))
        lat.append(time.perf_counter() - t)
        assert isinstance(d, Decision)
        sched.on_prefill_finished(d.prefill_node, req.request_id, float(r), 0.0)
        sched.on_decode_finished(d.decode_node, req.request_id, float(r))
    t = time.perf_counter()
    for _ in range(a.repeats):
        sched.index.longest_prefix_per_node(prompt_keys)
    lookup_ms = (time.perf_counter() - t) / a.repeats * 1e3
    lat.sort()
    out = {
        "bench": "roles.scheduling one decision",
        "note": "shared 2-core machine; Python; times are wall clock",
        "indexed_blocks": len(sched.index), "prefill_nodes": a.nodes,
        "prompt_tokens": a.prompt_tokens, "prompt_blocks": n_keys,
        "matching_nodes": a.nodes, "index_build_s": round(build_s, 2),
        "index_rss_mib": round(rss1 - rss0, 1),
        "decision_ms_p50": round(statistics.median(lat) * 1e3, 3),
        "decision_ms_p99": round(lat[int(0.99 * (len(lat) - 1))] * 1e3, 3),
        "prefix_lookup_ms": round(lookup_ms, 3),
        "last_decision": {"prefill": d.prefill_node, "prefix_tokens": d.prefix_tokens,
                          "transfer": d.transfer is not None},
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
