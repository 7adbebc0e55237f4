"""Helpers for end-to-end tests against a real local cluster (`mooncaked up` code)."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kvstore.layout import PageLayout
from model.config import RuntimeConfig, page_layout
from model.runner import DecodeSeq, ModelRunner, kv_pages_view
from model.weights import load_weights
from mooncaked.local_cluster import LocalCluster
from tests.nodes import get_json, post_json

TINY = ["store.capacity_bytes=16777216", "store.block_size=16", "model.prefill_chunk=32",
        "node.heartbeat_interval_s=0.2", "node.heartbeat_timeout_s=1.5",
        "node.admin_token=test-token", "decode.reservation_timeout_s=5"]
ADMIN = {"Authorization": "Bearer test-token"}


def start_cluster(tmp: Path, prefill: int = 2, decode: int = 1, model: str = "tiny",
                  extra: list[str] | None = None, colocated: int = 0,
                  cpp_group: int = 0) -> LocalCluster:
    cluster = LocalCluster(prefill=prefill if not colocated else colocated,
                           decode=decode if not colocated else 0, model=model,
                           overrides=TINY + (extra or []), log_dir=tmp, cpp_group=cpp_group)
    if colocated:
        cluster.role_of_workers = ("colocated", "decode")
    try:
        cluster.start(timeout_s=90)
    except Exception:
        cluster.stop()
        raise
    return cluster


@contextmanager
def running_cluster(tmp: Path, **kw) -> Iterator[LocalCluster]:
    """``start_cluster(tmp, **kw)``, stopped on leaving the block (module fixtures)."""
    cluster = start_cluster(tmp, **kw)
    try:
        yield cluster
    finally:
        cluster.stop()


def tokens(n: int, seed: int) -> list[int]:
    """A reproducible prompt of ``n`` byte tokens."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def reference_greedy(model: str, prompt: list[int], max_tokens: int, block_size: int = 16) -> list[int]:
    """Single-process oracle: the same weights, one request, no cache, no cluster."""
    runtime = RuntimeConfig(model=model)
    weights = load_weights(runtime)
    layout: PageLayout = page_layout(weights.config, block_size, runtime.dtype)
    pages = -(-(len(prompt) + max_tokens) // block_size)
    buffer = bytearray(pages * layout.page_bytes)
    runner = ModelRunner(weights, kv_pages_view(buffer, layout))
    table = list(range(pages))
    logits = runner.prefill(prompt, table, 0)
    out = [int(torch.argmax(logits))]
    while len(out) < max_tokens:
        pos = len(prompt) + len(out) - 1
        logits = runner.decode_step([DecodeSeq(out[-1], pos, table)])
        out.append(int(torch.argmax(logits[0])))
    return out


def complete(url: str, prompt, max_tokens: int = 8, **extra) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    return post_json(url + "/v1/completions", body, timeout=120)


def trace_of(url: str, body: dict) -> dict:
    _, trace = get_json(f"{url}/admin/requests/{body['id']}-0?tokens=1")
    return trace


def node_status(cluster: LocalCluster) -> dict[str, dict]:
    return {c.name: get_json(c.url + "/admin/status")[1] for c in cluster.children[1:]
            if c.proc.poll() is None}


def leaked(cluster: LocalCluster) -> dict[str, dict]:
    """Pages still pinned, private or reserved on any live worker (should be none)."""
    out = {}
    for name, status in node_status(cluster).items():
        store = status["store"]
        problem = {"pinned_blocks": store["pinned_blocks"], "private_pages": store["private_pages"]}
        if "decode" in status:
            problem["reservations"] = status["decode"]["reservations"]
        if any(problem.values()):
            out[name] = problem
    return out


def stream_lines(url: str, body: dict, timeout: float = 60):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    return urllib.request.urlopen(req, timeout=timeout)
