"""Test helpers: run real mooncaked node processes on loopback ports.

The processes are `mooncaked.local_cluster`'s (`spawn`/`Child`); this
module only adds the flags and waits the tests share."""

from __future__ import annotations

import time
from pathlib import Path

from mooncaked.local_cluster import Child, free_port, http_json, mooncaked_cmd, spawn
from tests.paths import REPO

__all__ = ["FAST", "REPO", "SMALL", "Child", "free_port", "get_json", "mooncaked_cmd", "peers",
           "post_json", "start_node", "wait_until"]

# Fast membership so death is noticed quickly in tests.
FAST = ["--set", "node.heartbeat_interval_s=0.2", "--set", "node.heartbeat_timeout_s=1.0"]
# Small, quick nodes: tiny model, small store.
SMALL = ["--model", "tiny", "--set", "store.capacity_bytes=16777216", "--set", "store.block_size=16"]


def get_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    return http_json(url, timeout=timeout)


def post_json(url: str, body: dict, headers: dict | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    return http_json(url, body, headers, timeout=timeout)


def start_node(tmp_path: Path, role: str, *args: str, conductor: str | None = None,
               env: dict | None = None) -> Child:
    port = free_port()
    cmd = ["--role", role, "--port", str(port), *args]
    if conductor:
        cmd += ["--conductor", conductor]
    return spawn(role, role, port, cmd, tmp_path / f"{role}-{port}.log", env=env, cwd=REPO)


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def peers(conductor: Child) -> set[str]:
    return {p["node_id"] for p in get_json(conductor.url + "/admin/status")[1].get("peers", [])}
