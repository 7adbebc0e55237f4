"""Test helpers: run real mooncaked node processes on loopback ports."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Fast membership so death is noticed quickly in tests.
FAST = ["--set", "node.heartbeat_interval_s=0.2", "--set", "node.heartbeat_timeout_s=1.0"]
# Small, quick nodes: tiny model, small store.
SMALL = ["--model", "tiny", "--set", "store.capacity_bytes=16777216", "--set", "store.block_size=16"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        return exc.code, json.loads(body) if body.startswith(b"{") else {}


def post_json(url: str, body: dict, headers: dict | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        return exc.code, json.loads(body) if body.startswith(b"{") else {}


@dataclass
class Node:
    role: str
    port: int
    proc: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.role} exited {self.proc.returncode}:\n{self.output()}")
            try:
                if get_json(self.url + "/readyz", timeout=1.0)[0] == 200:
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"{self.role} not ready in {timeout}s:\n{self.output()}")

    def terminate(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def mooncaked_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mooncaked.cli", *args]


def start_node(tmp_path: Path, role: str, *args: str, conductor: str | None = None,
               env: dict | None = None) -> Node:
    port = free_port()
    cmd = mooncaked_cmd("--role", role, "--port", str(port), *args)
    if conductor:
        cmd += ["--conductor", conductor]
    log = tmp_path / f"{role}-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, **(env or {})})
    return Node(role, port, proc, log)


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def peers(conductor: Node) -> set[str]:
    return {p["node_id"] for p in get_json(conductor.url + "/admin/status")[1].get("peers", [])}
