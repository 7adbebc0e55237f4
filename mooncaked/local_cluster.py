"""A whole cluster of this binary's node processes on this machine.

``LocalCluster`` starts one conductor (or several, with ``--etcd``), then the
prefill and decode (or colocated) nodes on free loopback ports, waits until
every node is ready and registered, and supervises them like systemd's
``Restart=on-failure``: a node that dies is started again with back-off on the
same port with the same arguments and node id (workers re-register by
themselves; a new conductor gets every worker back and rebuilds its cache
index from their snapshots) while the others keep serving; it gives up only
when a node crash-loops (``supervisor.py``).  ``stop`` tears the cluster down
(workers first, then the conductor; SIGKILL after a grace period).  Children
also get PR_SET_PDEATHSIG (armed by the child itself, ``process_setup.py``), so
a parent killed with -9 does not leave orphans behind.

``mooncaked up`` (``launcher.py``) is its command line; tests and benchmarks
start clusters and single nodes with the same ``LocalCluster``, ``spawn`` and
``Child``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import typer

from mooncaked import process_setup
from mooncaked.etcd_process import EtcdProcess
from mooncaked.placement import CONDUCTOR, DECODE, PREFILL, NodePlacement, Placement
from mooncaked.supervisor import CrashLoop, RestartPolicy, RestartTracker


# Every port free_port has handed out in this process.  The kernel gives a
# port that is free now: the child it is meant for binds it only once started,
# so the next call may be given the same one (seen: decode-0 and prefill-1 of
# one `up` both told to listen on one port, and the second never came up).
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()
FREE_PORT_TRIES = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now and never handed out before by this process."""
    with _handed_out_lock:
        for _ in range(FREE_PORT_TRIES):
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
            if port not in _handed_out:
                break
        # (Had every try offered a port handed out before, the last offer
        # stands: a clash is then reported by the node that cannot bind.)
        _handed_out.add(port)
        return port


def http_json(url: str, body: dict | None = None, headers: dict | None = None,
              timeout: float = 2.0) -> tuple[int, dict]:
    """GET ``url`` (POST ``body`` as JSON when given): (status, JSON body).

    An HTTP error still answers: its status, and its JSON error body if it
    has one (``{}`` otherwise)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw.startswith(b"{") else {}


def mooncaked_cmd(*args: str) -> list[str]:
    """The command line that runs this same program with ``args``."""
    return [sys.executable, "-m", "mooncaked.cli", *args]


@dataclass
class Child:
    name: str
    role: str
    port: int
    log_path: Path
    proc: subprocess.Popen
    # How it was started (``spawn``'s arguments), so ``respawn`` can do it again.
    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    cwd: Path | None = None
    cpus: frozenset[int] | None = None   # CPU affinity (mooncaked.placement); None: any
    idle_priority: bool = False          # SCHED_IDLE once started (a prefill node borrowing decode CPUs)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 5) -> str:
        """The last ``lines`` lines of its log, indented, for an error message."""
        return "\n  ".join(["", *self.output().strip().splitlines()[-lines:]])

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise RuntimeError(f"{self.name} exited with code {code} during start-up:{self.tail()}")

    def ready(self, timeout_s: float = 1.0) -> bool:
        """``/readyz`` answers 200 (a worker is ready only once registered)."""
        try:
            return http_json(self.url + "/readyz", timeout=timeout_s)[0] == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until ``/readyz`` answers 200; RuntimeError if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            if self.ready():
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready in time (log: {self.log_path})")

    def respawn(self) -> Child:
        """The same node started again: same command line (port, node id), same log."""
        return spawn(self.name, self.role, self.port, self.args, self.log_path, self.env, self.cwd,
                     self.cpus, self.idle_priority)

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM (a graceful stop) and wait: the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def spawn(name: str, role: str, port: int, args: list[str], log_path: Path,
          env: dict[str, str] | None = None, cwd: Path | None = None,
          cpus: frozenset[int] | None = None, idle_priority: bool = False) -> Child:
    """Start ``mooncaked <args>`` with its output appended to ``log_path``,
    pinned to ``cpus`` when given; with ``idle_priority`` the node drops
    every thread but its event loop to SCHED_IDLE once its start-up is done
    (``node.idle_after_start``): started at idle priority beside a busy
    process, a borrower got no CPU to import torch and `up` timed out
    waiting for it."""

    # Oversubscribed OpenMP threads that spin while waiting steal the cores
    # the other nodes compute on: make idle ones sleep instead.
    full_env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                **(env or {})}
    with open(log_path, "ab") as log:
        # No preexec_fn: the settings are applied by the child itself
        # (process_setup says why running code between fork and exec crashes).
        node_args = [*args, "--set", "node.idle_after_start=true"] if idle_priority else args
        cmd = process_setup.command(mooncaked_cmd(*node_args), parent=os.getpid(), cpus=cpus)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return Child(name, role, port, log_path, proc, list(args), env, cwd, cpus, idle_priority)


def log_to_stderr(line: str) -> None:
    typer.echo(f"mooncaked up: {line}", err=True)


class NodeExited(RuntimeError):
    """A node exited while restarting is off (``up --no-restart``)."""


@dataclass
class LocalCluster:
    prefill: int = 2
    decode: int = 1
    model: Optional[str] = None
    config: Optional[str] = None
    overrides: list[str] = field(default_factory=list)
    port: int = 0
    log_dir: Optional[Path] = None
    role_of_workers: tuple[str, str] = ("prefill", "decode")
    # Nodes in one Chunked Pipeline Parallelism prefill group (0 = none).
    cpp_group: int = 0
    # --etcd: an etcd of our own, node records and leader election in it,
    # ``conductors`` conductors (one leads, the others stand by and forward).
    etcd: bool = False
    conductors: int = 1
    etcd_process: Optional[EtcdProcess] = None
    # Extra command-line arguments of the conductor(s) (``up --engine``).
    conductor_args: list[str] = field(default_factory=list)
    # How ``poll_restarts`` treats a node that died; None: any exit is fatal.
    restart_policy: Optional[RestartPolicy] = field(default_factory=RestartPolicy)
    # CPU sets and torch threads per node (mooncaked.placement); None: every
    # node may run anywhere, with an equal share of threads.
    placement: Optional[Placement] = None
    children: list[Child] = field(default_factory=list)
    _trackers: dict[str, RestartTracker] = field(default_factory=dict, init=False, repr=False)
    # Nodes that exited 0 (stopped on purpose): not restarted, as on-failure.
    _stopped_cleanly: set[str] = field(default_factory=set, init=False, repr=False)
    # Held while the children are changed, so stop() never races a restart.
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _stopping: bool = field(default=False, init=False, repr=False)

    @property
    def conductor(self) -> Child:
        return self.children[0]

    @property
    def url(self) -> str:
        return self.conductor.url

    @property
    def conductor_children(self) -> list[Child]:
        return self.children[:self.conductors]

    @property
    def workers(self) -> list[Child]:
        return self.children[self.conductors:]

    def leader_url(self) -> str:
        """The conductor that leads (etcd): the one whose status says so."""
        if not self.etcd:
            return self.url
        for child in self.conductor_children:
            try:
                _, status = http_json(child.url + "/admin/status", timeout=1.0)
            except (urllib.error.URLError, OSError):
                continue
            if status.get("election", {}).get("role") == "leader":
                return child.url
        raise RuntimeError("no conductor leads")

    def threads_per_worker(self) -> int:
        workers = max(1, self.prefill + self.decode + self.cpp_group)
        return max(1, (os.cpu_count() or 1) // workers)

    def _placed(self, role: str, index: int) -> NodePlacement | None:
        return self.placement.of(role, index) if self.placement is not None else None

    def _spawn(self, name: str, role: str, extra: list[str], port: int = 0,
               placed: NodePlacement | None = None) -> Child:
        assert self.log_dir is not None
        port = port or free_port()
        cmd = ["--role", role, "--host", "127.0.0.1", "--port", str(port), "--node-id", name]
        if self.model:
            cmd += ["--model", self.model]
        if self.config:
            cmd += ["--config", self.config]
        # The nodes share this machine's cores: by default each worker gets an
        # equal share of torch threads (an explicit --set comes later and wins).
        threads = placed.threads if placed is not None else self.threads_per_worker()
        cmd += ["--set", f"model.torch_threads={threads}"]
        if self.etcd_process is not None:
            cmd += ["--set", f"etcd.endpoints={self.etcd_process.endpoint}"]
        for item in self.overrides:
            cmd += ["--set", item]
        cmd += extra
        child = spawn(name, role, port, cmd, self.log_dir / f"{name}.log",
                      cpus=placed.cpus if placed is not None else None,
                      idle_priority=placed is not None and placed.idle_priority)
        self.children.append(child)
        return self._started(child, time.monotonic())

    def _tracker(self, name: str) -> RestartTracker:
        policy = self.restart_policy or RestartPolicy()
        return self._trackers.setdefault(name, RestartTracker(policy))

    def _started(self, child: Child, now: float) -> Child:
        self._tracker(child.name).on_start(now)
        return child

    def _respawn(self, child: Child, now: float) -> Child:
        """Start a dead node again in its place (same port, arguments, node id)."""
        new = child.respawn()
        self.children[next(i for i, c in enumerate(self.children) if c is child)] = new
        return self._started(new, now)

    def start(self, timeout_s: float = 120.0) -> None:
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="mooncaked-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.etcd:
            self._start_etcd()
        self._spawn("conductor", "conductor", list(self.conductor_args), port=self.port,
                    placed=self._placed(CONDUCTOR, 0))
        for i in range(1, self.conductors):
            self._spawn(f"conductor-{i}", "conductor", list(self.conductor_args),
                        placed=self._placed(CONDUCTOR, 0))
        deadline = time.monotonic() + timeout_s
        for child in self.conductor_children:
            self._wait_ready(child, deadline)
        worker_roles: list[tuple[str, str, list[str], NodePlacement | None]] = []
        for i in range(self.prefill):
            worker_roles.append((f"{self.role_of_workers[0]}-{i}", self.role_of_workers[0], [],
                                 self._placed(PREFILL, i)))
        for i in range(self.decode):
            worker_roles.append((f"decode-{i}", "decode", [], self._placed(DECODE, i)))
        for stage in range(self.cpp_group):
            worker_roles.append((f"cpp0-s{stage}", "prefill", [
                "--set", "prefill.cpp_group=cpp0", "--set", f"prefill.cpp_stage={stage}",
                "--set", f"prefill.cpp_stages={self.cpp_group}"],
                self._placed(PREFILL, self.prefill + stage)))
        for b in (self.placement.borrowers if self.placement is not None else ()):
            # It runs on the decode nodes' CPUs (place() gives it their set).
            decode_ids = ",".join(f"decode-{i}" for i in range(self.decode))
            worker_roles.append((f"{self.role_of_workers[0]}-{b.index}", self.role_of_workers[0],
                                 ["--set", f"prefill.yields_to={decode_ids}"], b))
        for name, role, extra, placed in worker_roles:
            # With etcd the workers find the leading conductor there.
            self._spawn(name, role, ([] if self.etcd else ["--conductor", self.url]) + extra,
                        placed=placed)
        for child in self.workers:
            self._wait_ready(child, deadline)
        self._wait_registered(deadline)

    def _start_etcd(self) -> None:
        """Our own single-member etcd, its data in the cluster's log dir."""
        assert self.log_dir is not None
        self.etcd_process = EtcdProcess(self.log_dir / "etcd-data", self.log_dir / "etcd.log")
        self.etcd_process.start()

    def _wait_ready(self, child: Child, deadline: float) -> None:
        child.wait_ready(deadline - time.monotonic())

    def _wait_registered(self, deadline: float) -> None:
        expected = {c.name for c in self.workers}
        while time.monotonic() < deadline:
            try:
                url = self.leader_url()
            except RuntimeError:
                time.sleep(0.1)
                continue
            _, status = http_json(url + "/admin/status")
            if expected <= {p["node_id"] for p in status.get("peers", [])}:
                return
            time.sleep(0.1)
        raise RuntimeError("not every node registered with the conductor in time")

    def restart_conductor(self, timeout_s: float = 30.0) -> None:
        """Start a new conductor on the same port after the old one died (the
        workers re-register by themselves)."""
        with self._lock:
            if self.conductor.proc.poll() is None:
                raise RuntimeError("the conductor is still running")
            new = self._respawn(self.conductor, time.monotonic())
        self._wait_ready(new, time.monotonic() + timeout_s)

    def poll_restarts(self, now: float, log: Callable[[str], None] = log_to_stderr) -> None:
        """One supervision step at ``now`` (``time.monotonic()``): notice the
        nodes that exited, start again those whose back-off is over, and say
        when a restarted one is ready (a worker: registered) again.

        Raises CrashLoop when a node keeps dying (the caller stops the
        cluster), NodeExited on any exit when ``restart_policy`` is None."""
        with self._lock:
            if self._stopping:
                return
            for child in list(self.children):
                if child.name in self._stopped_cleanly:
                    continue
                tracker = self._tracker(child.name)
                if tracker.restart_at is not None:  # waiting out its back-off
                    if tracker.due(now):
                        new = self._respawn(child, now)
                        log(f"{child.name} started again on port {child.port} (pid {new.proc.pid})")
                elif (code := child.proc.poll()) is not None:
                    self._on_exit(child, code, now, log)
                elif tracker.down_since is not None and child.ready(timeout_s=0.5):
                    log(f"{child.name} is back: ready {tracker.on_ready(now):.1f}s after it died")

    def _on_exit(self, child: Child, code: int, now: float, log: Callable[[str], None]) -> None:
        where = f"log {child.log_path}:{child.tail()}"
        if self.restart_policy is None:
            raise NodeExited(f"{child.name} exited with code {code}; {where}")
        if not self.restart_policy.restarts_after(code):
            self._stopped_cleanly.add(child.name)
            log(f"{child.name} exited cleanly (code 0): not restarting it")
            return
        tracker = self._tracker(child.name)
        try:
            backoff = tracker.on_exit(now)
        except CrashLoop as exc:
            raise CrashLoop(f"{child.name} is crash-looping ({exc}, the last with code {code}); "
                            f"giving up; {where}") from None
        log(f"{child.name} exited with code {code}; restarting it in {backoff:g}s "
            f"(restart {tracker.restarts}); {where}")

    def supervise(self, stop: threading.Event | None = None,
                  log: Callable[[str], None] = log_to_stderr, interval_s: float = 0.2) -> None:
        """``poll_restarts`` every ``interval_s`` until ``stop`` is set or the
        cluster is stopped; raises what it raises."""
        stop = stop or threading.Event()
        while not stop.wait(interval_s) and not self._stopping:
            self.poll_restarts(time.monotonic(), log)

    def stop(self, grace_s: float = 15.0) -> None:
        """Workers first (they deregister), then the conductor; SIGKILL stragglers."""
        with self._lock:  # no restart from here on
            self._stopping = True
        for group in (self.workers, self.conductor_children):
            for child in group:
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for child in group:
                try:
                    child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
        if self.etcd_process is not None:  # last: the conductors revoke their leases in it
            self.etcd_process.stop()
