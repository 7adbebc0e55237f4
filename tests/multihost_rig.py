"""The multi-host rig: an etcd-backed cluster laid out as on separate hosts.

Every process gets a network namespace of its own on one bridge
(``tests.fault_rig.NetnsRig``: a veth each to a bridge in a hub namespace):

    etcd-1 etcd-2 etcd-3            a 3-member etcd cluster, one member per "host"
    conductor-1 conductor-2         one leads, the other stands by and forwards
    prefill-01 prefill-02 decode-01 workers; KV moves between their addresses
    client                          where the test's HTTP calls come from

so every HTTP call, etcd call and KV transfer crosses namespaces, each node
advertises its own address (``node.host``, ``transfer.nics``) and peers
authenticate with the cluster and transfer tokens, as on a real deployment.
A failure is a real one: ``kill -9`` of a process, or ``ip link set down`` on
a host's veth (its peers see no FIN, no RST).

Every process starts from the deployment files of docs/DEPLOY.md
(``etc/deploy/``, see ``Deployment``) the way the guide installs them: the
shared ``mooncaked.toml`` as ``--config``, the role's env file, the secrets
file filled in, Debian's etcd reading its member's env file.  What differs
per host replaces the guide's example host in those files (address, node id,
transfer NIC), and the etcd endpoints are the rig's.  What a test run needs
smaller than a real cluster (the ``tiny`` model, a small store, one torch
thread) is the ``scale`` list of ``--set`` items, kept apart so that what
the guide says (ports, lease TTL, heartbeats, transport, policy) is what runs.

The test thread talks to the cluster through ``call``/``submit``: a pool of
threads that entered the client namespace (``setns`` is per thread).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from secrets import token_hex
from typing import Any
from urllib.parse import urlsplit

from mooncaked.etcd_process import find_etcd
from mooncaked.local_cluster import http_json, mooncaked_cmd
from tests.fault_rig import (Host, NetnsRig, NsChild, enter_netns, netns_unusable,
                             wait_nothing_left, wait_ns_ready)
from tests.paths import REPO

DEPLOY = REPO / "etc" / "deploy"
ROLES = ("conductor", "prefill", "decode")


def multihost_unusable() -> str | None:
    """None when the rig can run here, else why not."""
    why = netns_unusable()
    if why:
        return why
    if find_etcd() is None:
        return "etcd not found on PATH (Debian: apt-get install etcd-server)"
    try:
        import aetcd
    except ImportError:
        return "the etcd client (aetcd) is not installed"
    del aetcd
    return None


# -- the deployment files -------------------------------------------------------------

def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines as systemd's ``EnvironmentFile=`` reads them
    (comments and blank lines skipped, optional quotes removed)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{path}: not KEY=VALUE: {line!r}")
        value = value.strip()
        env[key.strip()] = shlex.split(value)[0] if value else ""
    return env


@dataclass
class Deployment:
    """The files of docs/DEPLOY.md (etc/deploy/), read as a host would:

    - ``mooncaked.toml``: the cluster's config, the same on every node;
    - ``<role>.env``: one host's part (address, node id, transfer NICs);
    - ``secrets.env.example``: the token names, each filled in with a fresh
      random value (as the guide says to) shared by every node;
    - ``etcd-<n>.env``: member n's settings for Debian's etcd.service."""
    config: Path
    settings: dict[str, Any]
    role_env: dict[str, dict[str, str]]
    secrets: dict[str, str]
    etcd_env: list[dict[str, str]]

    @classmethod
    def from_files(cls, where: Path = DEPLOY) -> Deployment:
        config = where / "mooncaked.toml"
        missing = [p.name for p in (config, *(where / f"{r}.env" for r in ROLES),
                                    where / "secrets.env.example") if not p.exists()]
        etcd_files = sorted(where.glob("etcd-*.env"))
        if missing or len(etcd_files) != 3:
            raise FileNotFoundError(f"the deployment files of docs/DEPLOY.md are incomplete in "
                                    f"{where}: missing {missing or 'a 3rd etcd-<n>.env'}")
        secrets = {key: value or token_hex(16)
                   for key, value in read_env_file(where / "secrets.env.example").items()}
        return cls(config, tomllib.loads(config.read_text()),
                   {role: read_env_file(where / f"{role}.env") for role in ROLES},
                   secrets, [read_env_file(p) for p in etcd_files])

    def setting(self, section: str, key: str, default: Any = None) -> Any:
        return self.settings.get(section, {}).get(key, default)

    @property
    def admin_token(self) -> str:
        return self.secrets.get("MOONCAKED_NODE__ADMIN_TOKEN", "")

    def node_env(self, role: str, ip: str, node_id: str, etcd_endpoints: str) -> dict[str, str]:
        """A node's environment: the secrets, its role's env file with this
        host's values in place of the guide's example host, and the rig's etcd
        endpoints (the one cluster-wide value that differs from the file)."""
        env = {**self.secrets, **self.role_env[role],
               "MOONCAKED_NODE__HOST": ip, "MOONCAKED_NODE__NODE_ID": node_id,
               "MOONCAKED_ETCD__ENDPOINTS": etcd_endpoints}
        if role != "conductor":  # one NIC per rig host: its address (the guide has two rails)
            env["MOONCAKED_TRANSFER__NICS"] = ip
        return env

    def etcd_member_env(self, index: int, ips: list[str], data_dir: Path) -> dict[str, str]:
        """Member ``index``'s env file with the rig's addresses in place of the
        guide's (the three files differ only in the name and the address)."""
        guide_ips = [urlsplit(e["ETCD_INITIAL_ADVERTISE_PEER_URLS"]).hostname
                     for e in self.etcd_env]
        env = {}
        for key, value in self.etcd_env[index].items():
            for guide_ip, ip in zip(guide_ips, ips):
                value = value.replace(f"//{guide_ip}:", f"//{ip}:")
            env[key] = value
        env["ETCD_DATA_DIR"] = str(data_dir)
        return env


# -- etcd members ---------------------------------------------------------------------

@dataclass
class EtcdMember:
    """One member of the rig's etcd cluster in its own namespace, configured
    (as Debian's etcd.service does it) by the environment of its env file."""
    name: str
    host: Host
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        """host:port of its client URL (what ``etcd.endpoints`` lists)."""
        return urlsplit(self.env["ETCD_ADVERTISE_CLIENT_URLS"].split(",")[0]).netloc

    def start(self) -> None:
        # With a data dir from an earlier run etcd ignores ETCD_INITIAL_* and
        # rejoins as the member it was: the same command restarts it.
        Path(self.env["ETCD_DATA_DIR"]).mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.host.ns, find_etcd() or "etcd"], stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env}, start_new_session=True)

    def kill(self) -> None:
        """kill -9; the data dir survives, so ``start`` brings the member back."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


# -- the cluster ----------------------------------------------------------------------

@dataclass
class Answer:
    """One client request's outcome: HTTP status (0: no answer), headers and body."""
    status: int
    headers: dict[str, str]
    body: dict
    seconds: float

    @property
    def error_code(self) -> str | None:
        error = self.body.get("error")
        return error.get("code") if isinstance(error, dict) else None


def post(url: str, body: dict, timeout: float = 60.0) -> Answer:
    """POST JSON; any answer (or none) comes back as an ``Answer``, never raised."""
    t0 = time.monotonic()
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, headers, raw = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        status, headers, raw = exc.code, dict(exc.headers), exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return Answer(0, {}, {"error": {"code": "no_answer", "message": str(exc)}},
                      time.monotonic() - t0)
    try:
        payload = json.loads(raw or b"{}")
    except ValueError:
        payload = {"error": {"code": "not_json", "message": raw[:200].decode(errors="replace")}}
    return Answer(status, headers, payload if isinstance(payload, dict) else {},
                  time.monotonic() - t0)


def figure(row: str, **figures: Any) -> None:
    """One line of measured figures for docs/DEPLOY.md (shown with ``-s``)."""
    shown = ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in figures.items())
    print(f"\nMULTIHOST {row}: {shown}", flush=True)


@dataclass(repr=False)
class MultiHostCluster:
    """The layout in the module docstring, started by ``start`` and torn down by
    ``stop`` (``rig.close`` then removes every namespace).  Names follow
    docs/DEPLOY.md: etcd-1..3, conductor-1..2, prefill-01.., decode-01..

    ``scale``: ``--set`` items that shrink the guide's cluster to a test run
    (the model, store size, threads); they override the files."""
    rig: NetnsRig
    log_dir: Path
    model: str
    scale: list[str]
    conductors: int = 2
    prefill: int = 2
    decode: int = 1
    deployment: Deployment = field(default_factory=Deployment.from_files)

    def __post_init__(self) -> None:
        self.client_host = self.rig.add("client")
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="mhclient",
                                       initializer=enter_netns, initargs=(self.client_host.ns,))
        self.etcd: list[EtcdMember] = []
        self.nodes: dict[str, NsChild] = {}
        self.node_env: dict[str, dict[str, str]] = {}
        self.port = int(self.deployment.setting("node", "port", 8000))
        # What clients pass as "model": the guide's served name when it sets one.
        self.served_model = self.deployment.setting("conductor", "served_model_name") or self.model
        self.admin = {"Authorization": f"Bearer {self.deployment.admin_token}"}

    def __repr__(self) -> str:
        return f"MultiHostCluster({', '.join(self.nodes)}; etcd {self.etcd_endpoints})"

    # -- start and stop

    def start(self, timeout_s: float = 150.0) -> float:
        """etcd, then every node at once; seconds until all are ready and registered."""
        t0 = time.monotonic()
        names = [env["ETCD_NAME"] for env in self.deployment.etcd_env]
        hosts = [self.rig.add(name) for name in names]
        for i, (name, host) in enumerate(zip(names, hosts)):
            env = self.deployment.etcd_member_env(i, [h.ip for h in hosts],
                                                  self.log_dir / f"{name}-data")
            member = EtcdMember(name, host, env, self.log_dir / f"{name}.log")
            member.start()
            self.etcd.append(member)
        for i in range(1, self.conductors + 1):
            self._spawn(f"conductor-{i}", "conductor")
        for i in range(1, self.prefill + 1):
            self._spawn(f"prefill-{i:02d}", "prefill")
        for i in range(1, self.decode + 1):
            self._spawn(f"decode-{i:02d}", "decode")
        deadline = t0 + timeout_s
        self.wait_etcd_healthy(deadline - time.monotonic())
        for child in self.nodes.values():
            self.wait_ready(child, deadline - time.monotonic())
        self.wait_workers_registered(deadline - time.monotonic())
        return time.monotonic() - t0

    @property
    def etcd_endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.etcd)

    @property
    def lease_ttl_s(self) -> int:
        return int(self.deployment.setting("etcd", "lease_ttl_s", 3))

    def _spawn(self, name: str, role: str) -> NsChild:
        host = self.rig.add(name)
        env = self.deployment.node_env(role, host.ip, name, self.etcd_endpoints)
        cmd = ["--config", str(self.deployment.config), "--role", role, "--model", self.model]
        for item in self.scale:
            cmd += ["--set", item]
        self.node_env[name] = env
        log_path = self.log_dir / f"{name}.log"
        child = NsChild(name, role, self.port, log_path, self._popen(host, cmd, env, log_path), cmd)
        child.host = host.ip
        self.nodes[name] = child
        return child

    def _popen(self, host: Host, cmd: list[str], env: dict[str, str],
               log_path: Path) -> subprocess.Popen:
        full_env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **env}
        with open(log_path, "ab") as log:
            # `ip netns exec` execs in place: the pid is the node's own.
            return subprocess.Popen(["ip", "netns", "exec", host.ns, *mooncaked_cmd(*cmd)],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=REPO, env=full_env, start_new_session=True)

    def restart(self, name: str, timeout_s: float = 90.0) -> float:
        """Start a stopped node again (same host, command and env); seconds until ready."""
        old = self.nodes[name]
        assert old.proc.poll() is not None, f"{name} is still running"
        t0 = time.monotonic()
        old.proc = self._popen(self.rig.hosts[name], old.args, self.node_env[name], old.log_path)
        self.wait_ready(old, timeout_s)
        return time.monotonic() - t0

    def stop(self, grace_s: float = 25.0) -> list[str]:
        """SIGTERM to every node at once, SIGKILL to those still running after
        ``grace_s`` (above the guide's node.shutdown_timeout_s), then etcd; the
        names of the nodes that needed the SIGKILL (a graceful stop should not)."""
        for child in self.nodes.values():
            if child.proc.poll() is None:
                child.proc.terminate()
        deadline = time.monotonic() + grace_s
        killed = []
        for child in self.nodes.values():
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
                killed.append(child.name)
        if killed:
            print(f"\nMULTIHOST stop: {', '.join(killed)} still running {grace_s:g}s after "
                  "SIGTERM: killed", flush=True)
        for member in self.etcd:
            member.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        return killed

    def heal(self, timeout_s: float = 90.0) -> float:
        """Back to the healthy layout after a test's fault: every link up, every
        etcd member and node running, a leader that knows every worker, every
        worker taking work, nothing left behind; seconds it took."""
        t0 = time.monotonic()
        for name in self.rig.hosts:
            self.rig.link(name, up=True)
        for member in self.etcd:
            if member.proc is None or member.proc.poll() is not None:
                member.start()
        self.wait_etcd_healthy(timeout_s)
        for name, child in self.nodes.items():
            if child.proc.poll() is not None:
                self.restart(name, timeout_s)
            if child.role != "conductor" and self.status(name).get("draining"):
                self.admin_post(name, "/admin/undrain")
        leader = self.wait_leader(timeout_s)
        self.wait_workers_registered(timeout_s)
        deadline = time.monotonic() + timeout_s
        while not all(self.accepting(leader, p) for p in self.names("prefill")):
            assert time.monotonic() < deadline, "a prefill node still not accepting work"
            time.sleep(0.2)
        self.wait_nothing_left(timeout_s)
        return time.monotonic() - t0

    # -- talking to it from the client namespace

    def submit(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Future:
        return self.pool.submit(fn, *args, **kw)

    def call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return self.submit(fn, *args, **kw).result()

    def get(self, url: str, timeout: float = 5.0) -> tuple[int, dict]:
        return self.call(http_json, url, timeout=timeout)

    def status(self, name: str) -> dict:
        return self.get(self.nodes[name].url + "/admin/status")[1]

    def post(self, url: str, body: dict, timeout: float = 60.0) -> Answer:
        return self.call(post, url, body, timeout)

    def admin_post(self, name: str, path: str) -> tuple[int, dict]:
        """POST an admin endpoint with the deployment's admin token."""
        return self.call(http_json, self.nodes[name].url + path, {}, self.admin, timeout=10)

    def wait_ready(self, child: NsChild, timeout_s: float) -> None:
        wait_ns_ready(self.get, child, timeout_s)

    def etcd_healthy(self, member: EtcdMember) -> bool:
        try:
            code, body = self.get(f"http://{member.endpoint}/health", timeout=1.0)
        except (urllib.error.URLError, OSError):
            return False
        return code == 200 and body.get("health") in ("true", True)

    def wait_etcd_healthy(self, timeout_s: float, members: list[EtcdMember] | None = None) -> float:
        t0 = time.monotonic()
        for member in members or self.etcd:
            while not self.etcd_healthy(member):
                if member.proc is not None and member.proc.poll() is not None:
                    raise RuntimeError(f"{member.name} exited ({member.log_path})")
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"{member.name} not healthy in {timeout_s:.0f}s "
                                       f"({member.log_path})")
                time.sleep(0.2)
        return time.monotonic() - t0

    def etcd_raft_leader(self) -> EtcdMember | None:
        """The member that leads etcd's raft (from its gRPC gateway), None if unknown."""
        for member in self.etcd:
            try:
                code, body = self.call(http_json,
                                       f"http://{member.endpoint}/v3/maintenance/status", {},
                                       timeout=1.0)
            except (urllib.error.URLError, OSError):
                continue
            leader, me = body.get("leader"), body.get("header", {}).get("member_id")
            if code == 200 and leader and leader == me:
                return member
        return None

    # -- the cluster's state

    @property
    def conductor_names(self) -> list[str]:
        return [n for n, c in self.nodes.items() if c.role == "conductor"]

    @property
    def worker_names(self) -> list[str]:
        return [n for n, c in self.nodes.items() if c.role != "conductor"]

    def names(self, role: str) -> list[str]:
        return [n for n, c in self.nodes.items() if c.role == role]

    def url(self, name: str) -> str:
        return self.nodes[name].url

    def election(self, name: str) -> dict:
        try:
            return self.status(name).get("election", {})
        except (urllib.error.URLError, OSError):
            return {}

    def leader(self) -> str | None:
        """The conductor whose own status says it leads (None during a failover)."""
        for name in self.conductor_names:
            if self.nodes[name].proc.poll() is None and self.election(name).get("role") == "leader":
                return name
        return None

    def wait_leader(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            leader = self.leader()
            if leader:
                return leader
            time.sleep(0.1)
        raise AssertionError(f"no conductor leads after {timeout_s}s: "
                             f"{ {n: self.election(n) for n in self.conductor_names} }")

    def alive_peers(self, conductor: str) -> set[str]:
        return {p["node_id"] for p in self.status(conductor).get("peers", [])
                if p.get("alive", True)}

    def wait_workers_registered(self, timeout_s: float, expected: set[str] | None = None) -> float:
        """Seconds until the leading conductor knows exactly ``expected`` (default:
        every running worker) as alive."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        want = expected if expected is not None else {
            n for n in self.worker_names if self.nodes[n].proc.poll() is None}
        seen: set[str] = set()
        while time.monotonic() < deadline:
            leader = self.leader()
            if leader is not None:
                seen = self.alive_peers(leader)
                if seen == want:
                    return time.monotonic() - t0
            time.sleep(0.2)
        raise AssertionError(f"leader knows {seen}, expected {want} after {timeout_s}s")

    def accepting(self, conductor: str, prefill: str) -> bool | None:
        sched = self.status(conductor).get("scheduler", {}).get("prefill", {})
        return sched.get(prefill, {}).get("accepting")

    def worker_urls(self) -> dict[str, str]:
        return {n: self.nodes[n].url for n in self.worker_names}

    def wait_nothing_left(self, timeout_s: float) -> float:
        """Seconds until no worker has a pinned block, private page, reservation or
        fenced page (``/admin/status``); AssertionError naming them after the wait."""
        return wait_nothing_left(self.worker_urls(), timeout_s, get=self.get)

    # -- requests

    def completion(self, conductor: str, prompt: list[int], max_tokens: int = 6,
                   timeout: float = 60.0) -> Answer:
        return self.post(self.url(conductor) + "/v1/completions",
                         {"model": self.served_model, "prompt": prompt, "max_tokens": max_tokens,
                          "temperature": 0, "ignore_eos": True}, timeout)

    def output_tokens(self, served_by: str, answer: Answer) -> list[int]:
        """The token ids of a served completion, from the trace on the conductor
        that served it (the leader)."""
        code, trace = self.get(
            f"{self.url(served_by)}/admin/requests/{answer.body['id']}-0?tokens=1")
        assert code == 200, trace
        return trace["output_token_ids"]

    def prefill_node_of(self, served_by: str, answer: Answer) -> str:
        code, trace = self.get(f"{self.url(served_by)}/admin/requests/{answer.body['id']}-0")
        assert code == 200, trace
        return trace["prefill_node"]


@contextmanager
def multihost_cluster(log_dir: Path, model: str, scale: list[str], tag: str = "",
                      **layout: int) -> Iterator[MultiHostCluster]:
    """A started ``MultiHostCluster`` in a ``NetnsRig`` of its own, torn down on
    exit; AssertionError then if a node did not stop gracefully on SIGTERM."""
    rig = NetnsRig(net="10.234.0", tag=tag or f"h{os.getpid() % 100000}")
    try:
        cluster = MultiHostCluster(rig, log_dir, model, scale, **layout)
        try:
            started = cluster.start()
            where = cluster.deployment.config.parent.relative_to(REPO)
            print(f"\nMULTIHOST started in {started:.1f}s from {where}/", flush=True)
            yield cluster
        finally:
            killed = cluster.stop()
    finally:
        rig.close()
    assert not killed, f"{killed} ignored SIGTERM (logs in {log_dir})"


class Stream:
    """One streamed completion through ``conductor``, read in the client
    namespace: ``first`` is set at its first event, ``result()`` gives every
    ``data:`` payload up to ``[DONE]`` and ``ended_at`` when that came."""

    def __init__(self, cluster: MultiHostCluster, conductor: str, prompt: list[int],
                 max_tokens: int, timeout_s: float = 60.0) -> None:
        self.body = {"model": cluster.served_model, "prompt": prompt, "max_tokens": max_tokens,
                     "temperature": 0, "ignore_eos": True, "stream": True}
        self.first = threading.Event()
        self.events: list[str] = []
        self.ended_at: float | None = None
        req = urllib.request.Request(cluster.url(conductor) + "/v1/completions",
                                     data=json.dumps(self.body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        self._future = cluster.submit(self._read, req, timeout_s)

    def _read(self, req: urllib.request.Request, timeout_s: float) -> list[str]:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.first.set()
                    if line == "data: [DONE]":
                        self.ended_at = time.monotonic()
                        break
        return self.events

    def result(self, timeout_s: float = 60.0) -> list[str]:
        return self._future.result(timeout=timeout_s)

    def errors(self) -> list[dict]:
        return [json.loads(e)["error"] for e in self.events
                if e.startswith("{") and '"error"' in e]

    @property
    def request_id(self) -> str:
        return json.loads(self.events[0])["id"]


@dataclass(repr=False)
class LoadLoop:
    """A bounded client loop: ``requests`` completions, one after another (each
    with a new prompt), from the client namespace; every answer kept."""
    cluster: MultiHostCluster
    conductor: Callable[[int], str]  # the conductor request i goes to
    requests: int
    prompt: Callable[[int], list[int]]
    max_tokens: int = 4
    pause_s: float = 0.05
    answers: list[tuple[str, Answer]] = field(default_factory=list)
    _future: Future | None = None
    _stop: bool = False

    def start(self) -> LoadLoop:
        self._future = self.cluster.submit(self._run)
        return self

    def _run(self) -> None:
        for i in range(self.requests):
            if self._stop:
                return
            target = self.conductor(i)
            self.answers.append((target, post(
                self.cluster.url(target) + "/v1/completions",
                {"model": self.cluster.served_model, "prompt": self.prompt(i),
                 "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}, 60)))
            time.sleep(self.pause_s)

    def finish(self, timeout_s: float = 300.0) -> list[tuple[str, Answer]]:
        """Stop after the request in flight and wait for it."""
        self._stop = True
        assert self._future is not None
        self._future.result(timeout=timeout_s)
        return self.answers

    def __repr__(self) -> str:
        return f"LoadLoop({len(self.answers)} answers, {len(self.failed())} failed)"

    def failed(self) -> list[tuple[str, int, Any]]:
        return [(target, a.status, a.body.get("error")) for target, a in self.answers
                if a.status != 200]
