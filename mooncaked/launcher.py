"""``mooncaked up``: a whole cluster on this machine, one process per node.

Starts one conductor, then N prefill and M decode nodes of this same binary on
free loopback ports, forwards ``--model``/``--config``/``--set`` to each, waits
until every node is ready and registered and prints the API URL.  Then it
supervises them like systemd's ``Restart=on-failure``: a node that dies is
started again with back-off on the same port with the same arguments and node
id (workers re-register by themselves; a new conductor gets every worker back
and rebuilds its cache index from their snapshots) while the others keep
serving; ``up`` gives up only when a node crash-loops (``supervisor.py``).
Ctrl-C/SIGTERM tears the cluster down (workers first, then the conductor;
SIGKILL after a grace period).  Children also get PR_SET_PDEATHSIG (armed by
the child itself, ``process_setup.py``), so a launcher killed with -9 does not
leave orphans behind.
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

from mooncaked import layout as lay
from mooncaked import process_setup
from mooncaked.etcd_process import EtcdProcess
from mooncaked.placement import (CONDUCTOR, DECODE, DEFAULT_PREFILL_NODES, PREFILL, NodePlacement,
                                 Placement, default_prefill_nodes, parse_cpus, place)
from mooncaked.store_memory import (DEFAULT_STORE_MEMORY, StoreMemoryError, available_bytes,
                                    bytes_per_shard, parse_store_memory)
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
    to SCHED_IDLE once its start-up is done (``node.idle_after_start``):
    started at idle priority beside a busy process, a borrower got no CPU
    to import torch and `up` timed out waiting for it."""

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
        self._spawn("conductor", "conductor", [], port=self.port,
                    placed=self._placed(CONDUCTOR, 0))
        for i in range(1, self.conductors):
            self._spawn(f"conductor-{i}", "conductor", [], placed=self._placed(CONDUCTOR, 0))
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


DEFAULT_RESTART_POLICY = RestartPolicy()


def _restart_help(p: RestartPolicy) -> str:
    return (f"Restart a node that dies, like systemd's Restart=on-failure: on the same port and "
            f"node id, after a back-off of {p.backoff_initial_s:g} s doubling up to "
            f"{p.backoff_max_s:g} s, each restart logged on stderr; exit 1 when one node exits "
            f"{p.crash_loop_restarts} times within {p.crash_loop_window_s:g} s. "
            "--no-restart: the first exit of any node stops the cluster.")


def _placement(mode: str, cluster: LocalCluster, cpus_prefill: frozenset[int] | None,
               cpus_decode: frozenset[int] | None, borrow: bool = False) -> Placement | None:
    """``up``'s CPU placement: None leaves every node unpinned."""
    if mode not in ("auto", "none"):
        raise ValueError(f"--placement: expected auto or none, got {mode!r}")
    if mode == "none":
        if cpus_prefill or cpus_decode:
            raise ValueError("--cpus-prefill/--cpus-decode need --placement auto")
        return None
    # Colocated nodes (cluster.decode == 0) run both roles in one process:
    # nothing to separate, each may use every core.
    return place(os.sched_getaffinity(0), cluster.prefill + cluster.cpp_group, cluster.decode,
                 cpus_prefill, cpus_decode,
                 borrow=borrow and cluster.decode > 0 and cluster.prefill > 0)


def _default_prefill(mode: str, decode: int, colocated: int,
                     cpus_prefill: frozenset[int] | None,
                     cpus_decode: frozenset[int] | None) -> int:
    """``--prefill`` when not given: as many nodes (up to 2) as the placement
    gives a prefill core each; 2 when nodes are not pinned."""
    if colocated or mode != "auto":
        return DEFAULT_PREFILL_NODES
    try:
        n = default_prefill_nodes(os.sched_getaffinity(0), decode, cpus_prefill, cpus_decode)
    except ValueError:
        return DEFAULT_PREFILL_NODES  # _placement reports the error
    if n < DEFAULT_PREFILL_NODES:
        typer.echo(f"--prefill not given: {n} prefill node, since the placement leaves prefill "
                   f"{n} CPU (--prefill {DEFAULT_PREFILL_NODES} runs {DEFAULT_PREFILL_NODES} "
                   "nodes sharing it)", err=True)
    return n


# The TTFT SLO of `up --demo` unless --ttft-slo-s is given.
DEMO_TTFT_SLO_S = 30.0


LAYOUTS = ("auto", "disaggregated", "colocated")


@dataclass
class LayoutDecision:
    """The node counts and CPUs ``--layout`` settles on (None: not decided here)."""

    prefill: Optional[int]
    decode: int
    colocated: int
    borrow: bool
    cpus_decode: Optional[frozenset[int]] = None


def _auto_layout(model: Optional[str], config: Optional[str], overrides: list[str],
                 slo_overrides: list[str]) -> Optional[lay.Choice]:
    """``--layout auto``: the measured choice (mooncaked.layout), or None when
    the machine cannot be measured (then the disaggregated default)."""
    from mooncaked.layout_measure import cached_or_measure
    from mooncaked.node.config import ConfigError, load_config
    try:
        cfg = load_config(config_file=config, overrides=[*slo_overrides, *overrides],
                          flags={"model.model": model})
    except ConfigError:
        return None  # the nodes report the bad configuration
    cpus = sorted(os.sched_getaffinity(0))
    slo = lay.Slo(cfg.conductor.ttft_slo_s, cfg.conductor.tbt_slo_ms / 1e3)
    mix = lay.RequestMix()
    try:
        measured, source = cached_or_measure(cfg.model.model, len(cpus), mix,
                                             cfg.model.prefill_chunk)
    except RuntimeError as exc:
        typer.echo(f"--layout auto: {exc}; running the disaggregated layout", err=True)
        return None
    choice = lay.choose(cpus, measured, mix, slo)
    typer.echo(f"{choice.describe()}\n  (measurements of {cfg.model.model}: {source}; delete "
               "the file to measure again)", err=True)
    return choice


def _resolve_layout(mode: str, prefill: Optional[int], decode: Optional[int], colocated: int,
                    borrow: Optional[bool], user_layout: list[str], model: Optional[str],
                    config: Optional[str], overrides: list[str],
                    slo_overrides: list[str]) -> LayoutDecision:
    """``--layout``: auto measures and chooses unless ``user_layout`` names
    flags that set the layout by hand; disaggregated is the layout of
    --prefill/--decode/--borrow's defaults; colocated runs --colocated nodes
    (1 on every core unless given).  ValueError on contradicting flags."""
    if mode not in LAYOUTS:
        raise ValueError(f"--layout: expected one of {', '.join(LAYOUTS)}, got {mode!r}")
    if mode == "colocated" and (prefill is not None or decode is not None):
        raise ValueError("--layout colocated runs colocated nodes (--colocated N): "
                         "--prefill/--decode are for the disaggregated layout")
    if mode == "disaggregated" and colocated:
        raise ValueError("--layout disaggregated and --colocated contradict each other")
    own = LayoutDecision(prefill, 1 if decode is None else decode, colocated,
                         True if borrow is None else borrow)
    if mode == "colocated":
        own.colocated = colocated or 1
        return own
    if mode == "disaggregated" or user_layout:
        if mode == "auto":
            typer.echo(f"--layout auto: {', '.join(user_layout)} given: the layout as asked",
                       err=True)
        return own
    choice = _auto_layout(model, config, overrides, slo_overrides)
    if choice is None:
        return own
    chosen = choice.best.layout
    if chosen.kind == lay.COLOCATED:
        return LayoutDecision(None, 0, chosen.nodes, False)
    placed = choice.best.placement
    return LayoutDecision(chosen.nodes, chosen.decode, 0,
                          chosen.borrow if borrow is None else borrow,
                          placed.cpus_of(DECODE))


def _sets_store_capacity(config: Optional[str], overrides: list[str]) -> bool:
    """Whether the user sized the shards themselves (--set or --config)."""
    if any(o.split("=", 1)[0].strip() == "store.capacity_bytes" for o in overrides):
        return True
    if config:
        import tomllib
        try:
            with open(config, "rb") as f:
                return "capacity_bytes" in tomllib.load(f).get("store", {})
        except (OSError, tomllib.TOMLDecodeError):
            return False  # the nodes report the bad file
    return False


def _store_overrides(store_memory: Optional[str], cluster: "LocalCluster",
                     config: Optional[str], overrides: list[str]) -> list[str]:
    """``store.capacity_bytes`` for every node: --store-memory (or its
    default share) split over the nodes that hold a shard; nothing when the
    user set the capacity in --config or --set."""
    if _sets_store_capacity(config, overrides):
        if store_memory is not None:
            typer.echo("--store-memory ignored: store.capacity_bytes is set in --config/--set",
                       err=True)
        return []
    spec = parse_store_memory(store_memory if store_memory is not None else DEFAULT_STORE_MEMORY)
    borrowers = len(cluster.placement.borrowers) if cluster.placement is not None else 0
    shards = cluster.prefill + cluster.decode + cluster.cpp_group + borrowers
    available = available_bytes()
    per = bytes_per_shard(spec, shards, available)
    typer.echo(f"store: {spec.describe()} ({available / (1 << 30):.1f} GiB available): "
               f"{per / (1 << 30):.2f} GiB on each of {shards} nodes (--store-memory)", err=True)
    return [f"store.capacity_bytes={per}"]


def register(app: typer.Typer) -> None:
    @app.command("up")
    def up(
        prefill: Optional[int] = typer.Option(
            None, "--prefill", min=0,
            help="Number of prefill nodes (default: as --layout auto chooses; with --layout "
                 "disaggregated 2, or 1 where --placement auto leaves "
                 "prefill a single core: two nodes on one core would each run at half speed "
                 "while the other is busy, which the scheduler cannot see)."),
        decode: Optional[int] = typer.Option(
            None, "--decode", min=0,
            help="Number of decode nodes (default: as --layout auto chooses; otherwise 1)."),
        colocated: int = typer.Option(0, "--colocated", min=0,
                                      help="Run N colocated nodes (prefill+decode in one) instead."),
        cpp_group: int = typer.Option(0, "--cpp-group", min=0,
                                      help="Add a Chunked Pipeline Parallelism prefill group of X nodes "
                                           "(layers split into X stages) beside the --prefill nodes."),
        model: Optional[str] = typer.Option(None, "--model", help="dummy (default), a named dummy config or a checkpoint dir."),
        config: Optional[str] = typer.Option(None, "--config", "-c", help="TOML config passed to every node."),
        overrides: list[str] = typer.Option([], "--set", help="Config override passed to every node (repeatable)."),
        port: int = typer.Option(0, "--port", help="Conductor API port (0 = any free port)."),
        log_dir: Optional[Path] = typer.Option(None, "--log-dir", help="Where node logs go (default: a temp dir)."),
        demo: bool = typer.Option(False, "--demo", help="Send demo requests sharing prefixes, print TTFT with and without reuse, then exit."),
        served_model_name: Optional[str] = typer.Option(
            None, "--served-model-name",
            help="Model id the OpenAI API answers to, as vLLM spells it (default: --model)."),
        restart: bool = typer.Option(
            True, "--restart/--no-restart",
            help=_restart_help(DEFAULT_RESTART_POLICY)),
        etcd: bool = typer.Option(
            False, "--etcd",
            help="Keep the cluster's metadata in an etcd of its own (the `etcd` binary on PATH; "
                 "Debian package etcd-server), data in the log dir: node records under leases, "
                 "conductor leader election; workers find the leader in etcd (docs/etcd.md)."),
        conductors: int = typer.Option(
            1, "--conductors", min=1,
            help="Number of conductors (more than one needs --etcd): one leads, the others stand "
                 "by and forward the API to it; if the leader dies a standby takes over within "
                 "about etcd.lease_ttl_s. Every conductor's API URL is printed."),
        placement: str = typer.Option(
            "auto", "--placement",
            help="auto: prefill and decode nodes on disjoint CPU sets of this machine (CPU "
                 "affinity, torch threads to match), as separate hosts would be; the conductor "
                 "on the decode set. none: every node may use every core. The placement is "
                 "printed at start; --set model.torch_threads=N still wins for threads."),
        cpus_prefill: Optional[str] = typer.Option(
            None, "--cpus-prefill", help="CPUs for the prefill nodes, e.g. 0-5 (default: by "
                                         "--placement; with only this, decode gets the rest)."),
        cpus_decode: Optional[str] = typer.Option(
            None, "--cpus-decode", help="CPUs for the decode nodes and the conductor, e.g. 6,7."),
        ttft_slo_s: Optional[float] = typer.Option(
            None, "--ttft-slo-s", min=0.001,
            help="Time-to-first-token SLO in seconds (default 1: an interactive service). The "
                 "conductor predicts each request's TTFT and answers 429, naming the limit, "
                 "when the prediction misses it, instead of queueing work that would be late "
                 "[conductor.ttft_slo_s]."),
        tbt_slo_ms: Optional[float] = typer.Option(
            None, "--tbt-slo-ms", min=0.001,
            help="Time-between-tokens SLO in ms (default 100): a request's mean interval "
                 "between tokens (its inter-token latency), checked the same way against the "
                 "predicted decode step of the node the request would join "
                 "[conductor.tbt_slo_ms]."),
        store_memory: Optional[str] = typer.Option(
            None, "--store-memory",
            help="DRAM the KV store shards of this machine take together, split evenly over "
                 "the nodes started: a fraction of available memory or bytes (2GiB, 512M). "
                 f"Default {DEFAULT_STORE_MEMORY}: prefixes are reused only while they stay "
                 "cached. Refused when the machine cannot give it; store.capacity_bytes set "
                 "in --config or --set wins."),
        borrow: Optional[bool] = typer.Option(
            None, "--borrow/--no-borrow",
            help="With --placement auto (the default): one more prefill node on the decode CPUs "
                 "at idle priority (SCHED_IDLE, its autogroup at nice 19, from the end of its "
                 "start-up on, so a busy core cannot keep it from starting), computing in the gaps "
                 "between decode steps; the kernel preempts it whenever decode or the conductor "
                 "wants the core, so token spacing does not grow. The conductor fits each "
                 "prefill node's speed on its own prefills and gives the borrower only requests "
                 "no other prefill node can serve within the TTFT SLO (its speed hangs on decode "
                 "work still to come; --set conductor.borrowed_prefill=always chooses it like "
                 "any node). A borrower killed on a busy "
                 "core may close its connections only after the heartbeat timeout "
                 "(node.heartbeat_timeout_s). --no-borrow keeps the decode CPUs to decode "
                 "and the conductor. Default: on, unless --layout auto measures that it adds "
                 "nothing."),
        layout: str = typer.Option(
            "auto", "--layout",
            help="auto: time this machine's prefill and decode of the model (a few seconds, "
                 "cached under ~/.cache/mooncaked) and run the layout that serves the most "
                 "requests within the TTFT and TBT SLOs (colocated nodes, or prefill and decode "
                 "nodes on disjoint CPU sets, with or without a borrower), printing the figures "
                 "and why; --prefill/--decode/--colocated/--cpp-group/--cpus-*/--placement none "
                 "set it by hand instead. disaggregated: prefill and decode nodes as "
                 "--prefill/--decode/--borrow say. colocated: --colocated nodes (default 1, "
                 "on every core)."),
    ) -> None:
        """Run a local cluster: one conductor plus prefill and decode nodes on loopback,
        restarting a node that dies."""
        try:
            prefill_cpus = parse_cpus(cpus_prefill) if cpus_prefill else None
            decode_cpus = parse_cpus(cpus_decode) if cpus_decode else None
            if store_memory is not None:
                parse_store_memory(store_memory)
        except ValueError as exc:
            typer.echo(f"mooncaked up: {exc}", err=True)
            raise typer.Exit(2) from None
        user_layout = [flag for flag, given in (
            ("--prefill", prefill is not None), ("--decode", decode is not None),
            ("--colocated", colocated > 0), ("--cpp-group", cpp_group > 0),
            ("--cpus-prefill", prefill_cpus is not None),
            ("--cpus-decode", decode_cpus is not None),
            ("--placement none", placement == "none")) if given]
        layout_ttft = ttft_slo_s if ttft_slo_s is not None else (DEMO_TTFT_SLO_S if demo else None)
        try:
            chosen = _resolve_layout(
                layout, prefill, decode, colocated, borrow, user_layout, model, config,
                list(overrides),
                ([f"conductor.ttft_slo_s={layout_ttft}"] if layout_ttft is not None else [])
                + ([f"conductor.tbt_slo_ms={tbt_slo_ms}"] if tbt_slo_ms is not None else []))
        except ValueError as exc:
            typer.echo(f"mooncaked up: {exc}", err=True)
            raise typer.Exit(2) from None
        prefill, decode, colocated, borrow = (chosen.prefill, chosen.decode, chosen.colocated,
                                              chosen.borrow)
        if chosen.cpus_decode is not None:
            decode_cpus = chosen.cpus_decode
        if prefill is None:
            prefill = _default_prefill(placement, decode, colocated, prefill_cpus, decode_cpus)
        cluster = LocalCluster(prefill=prefill if not colocated else colocated,
                               decode=decode if not colocated else 0, model=model, config=config,
                               overrides=list(overrides) + (
                                   [f"conductor.served_model_name={served_model_name}"]
                                   if served_model_name else []),
                               port=port, log_dir=log_dir, cpp_group=cpp_group,
                               restart_policy=DEFAULT_RESTART_POLICY if restart else None,
                               etcd=etcd, conductors=conductors)
        if conductors > 1 and not etcd:
            typer.echo("mooncaked up: --conductors above 1 needs --etcd (the conductors elect "
                       "their leader in etcd)", err=True)
            raise typer.Exit(2)
        if etcd:
            from mooncaked.etcd_process import MISSING_ETCD, find_etcd
            if find_etcd() is None:
                typer.echo(f"mooncaked up: {MISSING_ETCD}", err=True)
                raise typer.Exit(2)
        if colocated:
            cluster.role_of_workers = ("colocated", "decode")
        try:
            cluster.placement = _placement(placement, cluster, prefill_cpus, decode_cpus,
                                           borrow=borrow and not colocated)
        except ValueError as exc:
            typer.echo(f"mooncaked up: {exc}", err=True)
            raise typer.Exit(2) from None
        if cluster.placement is not None:
            typer.echo(cluster.placement.describe({PREFILL: "colocated"} if colocated else None),
                       err=True)
        if demo and ttft_slo_s is None:
            # The demo's cold request prefills a long prompt on purpose; at
            # the interactive default it would be refused, not measured.
            ttft_slo_s = DEMO_TTFT_SLO_S
            typer.echo(f"--demo: TTFT SLO {DEMO_TTFT_SLO_S:g} s, so that its cold long-prompt "
                       "request is served and timed", err=True)
        slo = [f"conductor.ttft_slo_s={ttft_slo_s}"] if ttft_slo_s is not None else []
        slo += [f"conductor.tbt_slo_ms={tbt_slo_ms}"] if tbt_slo_ms is not None else []
        try:
            store = _store_overrides(store_memory, cluster, config, overrides)
        except StoreMemoryError as exc:
            typer.echo(f"mooncaked up: {exc}", err=True)
            raise typer.Exit(2) from None
        # Before the user's --set, which wins.
        cluster.overrides = store + slo + cluster.overrides
        stop_requested = []

        def on_signal(signum, frame):  # noqa: ARG001
            stop_requested.append(signum)
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, on_signal)
        # A shell without job control starts a background job with SIGINT
        # ignored, and Python keeps an inherited SIG_IGN: `kill -INT` (and
        # Ctrl-C after `fg`) must still stop the cluster.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        code = 0
        try:
            typer.echo(f"starting local cluster (logs in {cluster.log_dir or 'a temp dir'}) ...", err=True)
            cluster.start()
            typer.echo(f"cluster ready: {len(cluster.workers)} nodes, logs in {cluster.log_dir}", err=True)
            for child in cluster.conductor_children:
                typer.echo(f"API: {child.url}")
            sys.stdout.flush()
            if demo:
                from mooncaked.demo import run_demo
                run_demo(cluster.url)
            else:
                cluster.supervise()
        except KeyboardInterrupt:
            typer.echo("stopping cluster ...", err=True)
        except (RuntimeError, CrashLoop) as exc:
            typer.echo(f"mooncaked up: {exc}", err=True)
            code = 1
        finally:
            cluster.stop()
        typer.echo("cluster stopped", err=True)
        raise typer.Exit(code)
