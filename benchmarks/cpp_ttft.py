"""Chunked Pipeline Parallelism: TTFT of one long prompt on 1 node vs a group.

Runs, one after the other on this machine, (a) one prefill node and (b) a
CPP group of X prefill nodes (each with one decode node), sends the same
long prompt to each (nothing cached), and prints JSON with the client-side
TTFT, the prefill time the cluster reports, and the bytes that crossed stage
boundaries next to the KV bytes a sequence-parallel scheme would move.  It
then prices the same schedule on the paper's hardware (LLaMA3-70B, 8xA800
per node) with the scheduler's own estimators (roles.scheduling).

  .venv/bin/python benchmarks/cpp_ttft.py --tokens 8192 --stages 2 --threads 1

With --threads 1 every process computes on one core, so the group can use
two cores where the single node uses one: that is the comparison CPP makes
(more nodes, same prompt).  On a 2-core machine shared with other work the
figures are noisy; run it more than once.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mooncaked.local_cluster import LocalCluster  # noqa: E402
from roles.scheduling.estimators import (FlopsPrefillEstimator, ModelShape,  # noqa: E402
                                         PipelinePrefillEstimator)
from tests.nodes import get_json, post_json  # noqa: E402


def run_one(prompt: list[int], model: str, stages: int, threads: int, chunk: int) -> dict:
    overrides = [f"model.torch_threads={threads}", f"model.prefill_chunk={chunk}",
                 "store.capacity_bytes=268435456", "store.block_size=256",
                 "conductor.max_prompt_tokens=65536"]
    cluster = LocalCluster(prefill=0 if stages > 1 else 1, decode=1, model=model,
                           overrides=overrides, cpp_group=stages if stages > 1 else 0,
                           log_dir=Path(tempfile.mkdtemp(prefix="cpp-bench-")))
    try:
        cluster.start(timeout_s=180)
        t0 = time.perf_counter()
        status, body = post_json(cluster.url + "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}, timeout=600)
        ttft = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"request failed: {status} {body}")
        _, trace = get_json(f"{cluster.url}/admin/requests/{body['id']}-0")
        _, status_body = get_json(cluster.url + "/admin/status")
        return {"stages": stages, "client_ttft_s": round(ttft, 3),
                "prefill_compute_s": trace["prefill_compute_s"], "cpp": trace.get("cpp"),
                "kv_bytes_per_token": None if not status_body["peers"] else
                status_body["peers"][0]["capacity"].get("kv_bytes_per_token")}
    finally:
        cluster.stop()


def paper_hardware(tokens: int, stages: int, chunk: int) -> dict:
    """The same schedule priced for LLaMA3-70B on 8xA800 nodes (paper's Table 1)."""
    shape = ModelShape()
    single = FlopsPrefillEstimator(shape, gpu_flops=8 * 312e12, efficiency=0.5)
    hidden_bytes = chunk * shape.d_model * shape.bytes_per_elem
    hop_s = hidden_bytes / (800e9 / 8)  # one chunk's hidden states over 800 Gbps
    group = PipelinePrefillEstimator(single, stages, chunk, hop_s=hop_s)
    return {"model": "LLaMA3-70B, 8xA800 per node, 800 Gbps", "prompt_tokens": tokens,
            "chunk_tokens": chunk, "single_node_prefill_s": round(single.seconds(tokens, 0), 2),
            f"cpp_{stages}_nodes_prefill_s": round(group.seconds(tokens, 0), 2),
            "boundary_bytes": (stages - 1) * tokens * shape.d_model * shape.bytes_per_elem,
            "sequence_parallel_kv_bytes": (stages - 1) * tokens * shape.kv_bytes_per_token}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--model", default="dummy")
    ap.add_argument("--paper-tokens", type=int, default=131072,
                    help="prompt length priced on the paper's hardware")
    ap.add_argument("--paper-chunk", type=int, default=4096)
    a = ap.parse_args()
    prompt = [random.Random(0).randrange(256) for _ in range(a.tokens)]
    single = run_one(prompt, a.model, 1, a.threads, a.chunk)
    group = run_one(prompt, a.model, a.stages, a.threads, a.chunk)
    kv = group["kv_bytes_per_token"] or 0
    out = {
        "machine": "shared 2-core CPU, loopback; every node one process",
        "prompt_tokens": a.tokens, "model": a.model, "torch_threads_per_process": a.threads,
        "single_node": single, f"cpp_group_{a.stages}": group,
        "ttft_ratio_group_vs_single": round(group["client_ttft_s"] / single["client_ttft_s"], 3),
        "boundary_bytes": group["cpp"]["boundary_bytes"] if group["cpp"] else None,
        "sequence_parallel_kv_bytes": (a.stages - 1) * a.tokens * kv,
        "paper_hardware": paper_hardware(a.paper_tokens, a.stages, a.paper_chunk),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
