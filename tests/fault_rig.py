"""The fault rig: what the fault-matrix tests (tests/test_faults_*.py) share.

- ``leftovers``/``wait_nothing_left``: what is still pinned, private, reserved
  or fenced on worker nodes, read from each node's ``/admin/status``;
- ``Oracle``: the quiet reference (one process, one request, no cache) that
  every output under a fault must equal token for token;
- ``supervised``: ``LocalCluster.supervise`` in a thread, as ``mooncaked up``
  runs it;
- ``NetnsRig``/``NetnsCluster``: every node in its own network namespace,
  one veth each to a bridge in a hub namespace, so that HTTP and KV
  transfers cross namespaces (and can be cut with ``ip link set down``,
  shaped with ``tc`` or made lossy with iptables); the test talks to the
  nodes from threads that entered a client namespace (``setns`` is per
  thread);
- the reasons a test needing root, ``ip netns``, ``tc``, iptables or
  ``mount`` skips.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import threading
import time
import urllib.error
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncaked.local_cluster import Child, LocalCluster, http_json, mooncaked_cmd
from tests.paths import REPO

# What must be back to zero on every worker once a fault is over.
LEFTOVER_FIELDS = (("store", "pinned_blocks"), ("store", "private_pages"),
                   ("decode", "reservations"), ("decode", "fenced_pages"))


# -- what is left behind ---------------------------------------------------------

def leftovers_of(status: dict) -> dict[str, int]:
    """The non-zero leftover counters of one worker's ``/admin/status``."""
    found = {}
    for section, name in LEFTOVER_FIELDS:
        value = status.get(section, {}).get(name, 0)
        if value:
            found[name] = value
    return found


def leftovers(urls: dict[str, str], get: Callable[[str], tuple[int, dict]] = http_json
              ) -> dict[str, dict[str, int]]:
    """Leftovers per worker name (an unreachable node counts as one)."""
    out: dict[str, dict[str, int]] = {}
    for name, url in urls.items():
        try:
            code, status = get(url + "/admin/status")
        except (urllib.error.URLError, OSError) as exc:
            out[name] = {"unreachable": 1, "error": str(exc)}  # type: ignore[dict-item]
            continue
        found = leftovers_of(status) if code == 200 else {"status": code}
        if found:
            out[name] = found
    return out


def worker_urls(cluster: LocalCluster) -> dict[str, str]:
    return {c.name: c.url for c in cluster.children[1:]}


def wait_nothing_left(urls: dict[str, str], timeout: float,
                      get: Callable[[str], tuple[int, dict]] = http_json) -> float:
    """Seconds until no worker has leftovers; AssertionError naming them after ``timeout``."""
    t0 = time.monotonic()
    found: dict = {}
    while time.monotonic() - t0 < timeout:
        found = leftovers(urls, get)
        if not found:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"still left behind after {timeout}s: {found}")


def report(row: str, **figures: Any) -> None:
    """One line of measured figures for docs/RELIABILITY.md (shown with ``-s``)."""
    shown = ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in figures.items())
    print(f"\nFAULT {row}: {shown}", flush=True)


# -- a loopback cluster with per-node settings ---------------------------------------

def start_nodes(tmp: Path, conductor: list[str], workers: list[tuple[str, str, list[str]]],
                common: list[str], timeout_s: float = 90.0) -> LocalCluster:
    """A conductor and ``workers`` ((name, role, --set items)) on loopback, each
    with ``common`` and its own settings (``LocalCluster`` gives every node
    the same ones); ready and registered.  ``stop()`` it when done."""
    from tests.nodes import start_node

    def sets(items: list[str]) -> list[str]:
        return [a for item in items for a in ("--set", item)]

    cluster = LocalCluster(children=[], log_dir=tmp)
    try:
        cluster.children.append(start_node(tmp, "conductor", *sets(common + conductor)))
        cluster.conductor.wait_ready(timeout_s)
        for name, role, own in workers:
            child = start_node(tmp, role, "--node-id", name, "--set", "model.torch_threads=1",
                               *sets(common + own), conductor=cluster.url)
            child.name = name
            cluster.children.append(child)
        for child in cluster.children[1:]:
            child.wait_ready(timeout_s)
        cluster._wait_registered(time.monotonic() + timeout_s)
    except BaseException:
        cluster.stop()
        raise
    return cluster


# -- the quiet reference -----------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _reference(model: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    from tests.cluster_helpers import reference_greedy
    return tuple(reference_greedy(model, list(prompt), max_tokens))


def reference(model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of ``prompt`` alone in one process (cached per prompt)."""
    return list(_reference(model, tuple(prompt), max_tokens))


# -- supervision as `mooncaked up` does it ------------------------------------------

@contextmanager
def supervised(cluster: LocalCluster) -> Iterator[list[str]]:
    """``cluster.supervise`` in a thread while the block runs: the lines it logs."""
    lines: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def run() -> None:
        try:
            cluster.supervise(stop, log=lines.append, interval_s=0.1)
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield lines
    finally:
        stop.set()
        thread.join(timeout=10)
    if errors:
        raise errors[0]


def node_pid(up: subprocess.Popen, name: str) -> int | None:
    """The pid of ``up``'s node ``name`` (from the children's command lines)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(up.pid)],
                         capture_output=True, text=True).stdout
    for pid in map(int, out.split()):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"--node-id" in args and args[args.index(b"--node-id") + 1] == name.encode():
            return pid
    return None


# -- why a test cannot run here -----------------------------------------------------

def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


def netns_unusable() -> str | None:
    """None when network namespaces work here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) not installed"
    probe = f"mcfp{os.getpid()}"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode:
        return f"ip netns add failed: {r.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def qdisc_unusable(*spec: str) -> str | None:
    """None when ``tc qdisc add ... root <spec>`` works in a namespace here, else why not
    (e.g. a kernel built without sch_netem)."""
    why = netns_unusable()
    if why:
        return why
    if shutil.which("tc") is None:
        return "tc not installed"
    probe = f"mcfq{os.getpid()}"
    _run("ip", "netns", "add", probe)
    try:
        _run("ip", "-n", probe, "link", "set", "lo", "up")
        r = _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", *spec,
                 check=False)
        if r.returncode:
            return f"`tc qdisc add ... {' '.join(spec)}` fails here: {r.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def iptables_unusable() -> str | None:
    """None when an iptables ``statistic`` DROP rule can be added in a namespace
    here (the loss row without ``sch_netem``), else why not."""
    why = netns_unusable()
    if why:
        return why
    if shutil.which("iptables") is None:
        return "iptables not installed (apt-get install iptables)"
    probe = f"mcfi{os.getpid()}"
    _run("ip", "netns", "add", probe)
    try:
        r = _run("ip", "netns", "exec", probe, "iptables", "-A", "OUTPUT", "-p", "tcp",
                 "-m", "statistic", "--mode", "random", "--probability", "0.05", "-j", "DROP",
                 check=False)
        if r.returncode:
            return f"`iptables -m statistic ... -j DROP` fails here: {r.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def tmpfs_unusable(where: Path) -> str | None:
    """None when a tmpfs can be mounted at ``where`` (then unmounted), else why not."""
    if os.geteuid() != 0:
        return "needs root"
    where.mkdir(parents=True, exist_ok=True)
    r = _run("mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where), check=False)
    if r.returncode:
        return f"mount -t tmpfs failed: {r.stderr.strip()}"
    _run("umount", str(where), check=False)
    return None


@contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` for the block (a disk that fills up)."""
    where.mkdir(parents=True, exist_ok=True)
    _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where))
    try:
        yield where
    finally:
        _run("umount", "-l", str(where), check=False)


# -- network namespaces ---------------------------------------------------------------

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def enter_netns(ns: str) -> None:
    """Move the calling thread (only it) into network namespace ``ns``."""
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
    finally:
        os.close(fd)


@dataclass
class Host:
    """One namespace on the bridge: its name, its veth end and its address."""
    ns: str
    dev: str
    ip: str


@dataclass
class NetnsRig:
    """Namespaces joined by veth pairs to one bridge in a hub namespace.

    Nothing outside the namespaces it creates is touched; ``close`` deletes
    them (and with them every veth and qdisc)."""
    net: str = "10.233.0"
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.hub = f"mfhub{self.tag}"
        _run("ip", "netns", "add", self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")

    def add(self, name: str) -> Host:
        i = len(self.hosts) + 1
        ns, dev, hub_end = f"mf{self.tag}{name}", f"mfv{i}", f"mfb{self.tag}{i}"
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", hub_end,
             "netns", self.hub)
        _run("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0")
        _run("ip", "-n", self.hub, "link", "set", hub_end, "up")
        host = Host(ns, dev, f"{self.net}.{i}")
        # One wire-sized packet per skb (no 64 KiB GSO/TSO super-packets), so
        # that a dropped packet (netem, iptables) is one MTU, as on a real
        # link.  Set before any socket exists: a connection keeps the limit
        # it saw when it was made.
        _run("ip", "-n", ns, "link", "set", dev, "gso_max_segs", "1")
        _run("ip", "-n", ns, "addr", "add", f"{host.ip}/24", "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")
        self.hosts[name] = host
        return host

    def link(self, name: str, up: bool) -> None:
        """``ip link set down``: the host drops off the network, no FIN sent to anyone."""
        host = self.hosts[name]
        _run("ip", "-n", host.ns, "link", "set", host.dev, "up" if up else "down")

    def shape(self, name: str, *spec: str) -> None:
        """``tc qdisc replace ... root <spec>`` on the host's egress, e.g.
        ``("netem", "loss", "5%")`` or ``("tbf", "rate", "40mbit", ...)``;
        no spec: back to the default qdisc."""
        host = self.hosts[name]
        tc = ["ip", "netns", "exec", host.ns, "tc", "qdisc"]
        if spec:
            _run(*tc, "replace", "dev", host.dev, "root", *spec)
        else:
            _run(*tc, "del", "dev", host.dev, "root", check=False)

    LOSS_CHAIN = "mfloss"

    def drop_randomly(self, name: str, probability: float, ports: list[int]) -> None:
        """Drop ``probability`` of the packets the host sends to or from TCP
        ``ports`` (iptables ``statistic``, in its namespace's OUTPUT chain, on
        its veth): loss without ``sch_netem``.  Applied on both ends of a
        connection, it drops data one way and ACKs the other."""
        host = self.hosts[name]
        ipt = ["ip", "netns", "exec", host.ns, "iptables"]
        _run(*ipt, "-N", self.LOSS_CHAIN)
        _run(*ipt, "-A", self.LOSS_CHAIN, "-p", "tcp", "-m", "multiport",
             "--ports", ",".join(map(str, ports)), "-m", "statistic", "--mode", "random",
             "--probability", f"{probability}", "-j", "DROP")
        _run(*ipt, "-A", "OUTPUT", "-o", host.dev, "-j", self.LOSS_CHAIN)

    def dropped_packets(self, name: str) -> int:
        """Packets the host's ``drop_randomly`` rule has dropped so far."""
        out = _run("ip", "netns", "exec", self.hosts[name].ns, "iptables", "-L", self.LOSS_CHAIN,
                   "-n", "-v", "-x").stdout
        # Two header lines, then one line per rule: pkts bytes target ...
        return sum(int(line.split()[0]) for line in out.splitlines()[2:] if "DROP" in line)

    def stop_dropping(self, name: str) -> None:
        host = self.hosts[name]
        ipt = ["ip", "netns", "exec", host.ns, "iptables"]
        _run(*ipt, "-D", "OUTPUT", "-o", host.dev, "-j", self.LOSS_CHAIN, check=False)
        _run(*ipt, "-F", self.LOSS_CHAIN, check=False)
        _run(*ipt, "-X", self.LOSS_CHAIN, check=False)

    def close(self) -> None:
        for host in self.hosts.values():
            _run("ip", "netns", "del", host.ns, check=False)
        _run("ip", "netns", "del", self.hub, check=False)


class NsChild(Child):
    """A node process inside a namespace, reached at its namespace address."""
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class NetnsCluster:
    """A conductor and workers, each in its own namespace of ``rig``.

    Every HTTP call of the test goes through ``self.call`` (threads inside the
    client namespace).  The cluster token authenticates /internal/ and the
    transfer frames, since no peer is on loopback."""

    PORT = 8000
    TOKEN = "faults-netns-token"

    def __init__(self, rig: NetnsRig, log_dir: Path, model: str, overrides: list[str]) -> None:
        self.rig, self.log_dir, self.model, self.overrides = rig, log_dir, model, overrides
        self.client_host = rig.add("client")
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="nsclient",
                                       initializer=enter_netns, initargs=(self.client_host.ns,))
        self.children: list[NsChild] = []

    # -- processes

    def _spawn(self, name: str, role: str, extra: list[str]) -> NsChild:
        host = self.rig.add(name)
        cmd = ["--role", role, "--host", host.ip, "--port", str(self.PORT), "--node-id", name,
               "--model", self.model, "--set", "model.torch_threads=1",
               "--set", f"node.cluster_token={self.TOKEN}", "--set", f"transfer.auth_token={self.TOKEN}",
               "--set", f'transfer.nics=["{host.ip}"]', *extra]
        for item in self.overrides:
            cmd += ["--set", item]
        log_path = self.log_dir / f"{name}.log"
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        with open(log_path, "ab") as log:
            # `ip netns exec` execs the command in place: the pid is the node's.
            proc = subprocess.Popen(["ip", "netns", "exec", host.ns, *mooncaked_cmd(*cmd)],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=REPO, env=env, start_new_session=True)
        child = NsChild(name, role, self.PORT, log_path, proc, cmd)
        child.host = host.ip
        self.children.append(child)
        return child

    def start(self, prefill: int, decode: int, timeout_s: float = 120.0) -> None:
        conductor = self._spawn("conductor", "conductor", [])
        self.wait_ready(conductor, timeout_s)
        for i in range(prefill):
            self._spawn(f"prefill-{i}", "prefill", ["--conductor", conductor.url])
        for i in range(decode):
            self._spawn(f"decode-{i}", "decode", ["--conductor", conductor.url])
        for child in self.children[1:]:
            self.wait_ready(child, timeout_s)
        self.wait_peers({c.name for c in self.children[1:]}, timeout_s)

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.terminate()
        for child in self.children:
            try:
                child.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- talking to it from the client namespace

    @property
    def url(self) -> str:
        return self.children[0].url

    def node(self, name: str) -> NsChild:
        return next(c for c in self.children if c.name == name)

    def submit(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Future:
        return self.pool.submit(fn, *args, **kw)

    def call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return self.submit(fn, *args, **kw).result()

    def get(self, url: str, timeout: float = 5.0) -> tuple[int, dict]:
        return self.call(http_json, url, timeout=timeout)

    def wait_ready(self, child: NsChild, timeout_s: float) -> None:
        wait_ns_ready(self.get, child, timeout_s)

    def peers(self) -> set[str]:
        return {p["node_id"] for p in self.get(self.url + "/admin/status")[1].get("peers", [])}

    def wait_peers(self, expected: set[str], timeout_s: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.peers() == expected:
                return time.monotonic() - t0
            time.sleep(0.1)
        raise AssertionError(f"peers {self.peers()} != {expected} after {timeout_s}s")

    def worker_urls(self) -> dict[str, str]:
        return {c.name: c.url for c in self.children[1:]}

    def wait_nothing_left(self, timeout: float) -> float:
        return wait_nothing_left(self.worker_urls(), timeout, get=self.get)


def wait_ns_ready(get: Callable[..., tuple[int, dict]], child: NsChild, timeout_s: float) -> None:
    """Until ``child`` answers /readyz 200 (``get`` reaches into its namespace);
    RuntimeError with its log's tail when it dies or does not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        child.check_alive()
        try:
            if get(child.url + "/readyz", timeout=1.0)[0] == 200:
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{child.name} not ready in {timeout_s:.0f}s:{child.tail(8)}")
