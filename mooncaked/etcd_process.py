"""A single-member etcd of our own, for ``mooncaked up --etcd`` and the tests.

The ``etcd`` binary is found on PATH (Debian: ``apt-get install etcd-server``),
listens on two free loopback ports and keeps its data in ``data_dir`` so that
it can be stopped and started again with its keys and leases (the tests do).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

MISSING_ETCD = ("etcd not found on PATH: install it (Debian/Ubuntu: apt-get install etcd-server) "
                "or run without --etcd")


def find_etcd() -> str | None:
    return shutil.which("etcd")


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class EtcdProcess:
    data_dir: Path
    log_path: Path
    client_port: int = 0
    peer_port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 20.0) -> None:
        """Start etcd (again, on the same ports and data) and wait until it is healthy."""
        binary = find_etcd()
        if binary is None:
            raise RuntimeError(MISSING_ETCD)
        self.client_port = self.client_port or _free_port()
        self.peer_port = self.peer_port or _free_port()
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [binary, "--name", "mooncaked", "--data-dir", str(self.data_dir),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"mooncaked={peer}", "--logger", "zap"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.proc.returncode} at start-up "
                                   f"(log: {self.log_path})")
            if self.healthy():
                return
            time.sleep(0.1)
        raise RuntimeError(f"etcd not healthy within {timeout_s:g}s (log: {self.log_path})")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1.0) as resp:
                return resp.status == 200 and b"true" in resp.read()
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """kill -9 (the data dir survives: ``start`` brings it back)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
