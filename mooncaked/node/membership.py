"""Cluster membership: which prefill/decode nodes exist and whether they live.

``NodeRegistry`` is the conductor's bookkeeping.  It does no I/O and never
reads the clock: callers pass ``now`` (seconds, any monotonic origin), so the
HTTP conductor and the simulator can share it.

``MembershipClient`` is the node side: register at start-up (retrying until
the conductor answers or a deadline passes), heartbeat with a load report,
re-register when the conductor has forgotten us (it restarted), deregister on
a graceful exit.  The conductor is either fixed (``node.conductor_url``) or,
with etcd, whichever conductor leads (``mooncaked.node.discovery``): the
client then moves to each new leader as it is elected.  ``ConductorLocator``
is where every part of a node reads the current conductor's URL.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from mooncaked.node.internal_client import InternalCallError, InternalClient
from mooncaked.node.messages import (Deregistration, Heartbeat, NodeCapacity, NodeLoad,
                                     NodeRegistration, Route)
from mooncaked.node.tasks import cancel_and_wait, wait_woken

if TYPE_CHECKING:
    from mooncaked.node.discovery import EtcdDiscovery
    from mooncaked.node.etcd_store import ConductorRecord

log = logging.getLogger("mooncaked.membership")


@dataclass
class NodeRecord:
    node_id: str
    role: str
    url: str                      # base URL of the node's HTTP server
    capacity: NodeCapacity        # e.g. store pages, max batch
    transfer: dict[str, Any]      # transfer-engine segment descriptor (wire form)
    registered_at: float
    last_seen: float
    load: NodeLoad = field(default_factory=NodeLoad)
    alive: bool = True

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "node_id": self.node_id, "role": self.role, "url": self.url,
            "alive": self.alive, "capacity": self.capacity.to_wire(), "load": self.load.to_wire(),
            "seconds_since_heartbeat": round(now - self.last_seen, 3),
            "transfer_endpoints": [f"{n.get('host')}:{n.get('port')}"
                                   for n in self.transfer.get("nics", [])],
        }


class NodeRegistry:
    """Alive/dead bookkeeping. Invariant: a node is alive iff it registered and
    its last heartbeat is younger than ``timeout_s`` (checked by ``sweep``)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._nodes: dict[str, NodeRecord] = {}
        self._listeners: list[Callable[[str, NodeRecord], None]] = []

    def subscribe(self, listener: Callable[[str, NodeRecord], None]) -> None:
        """``listener(event, record)``, event in {"joined", "left", "dead", "heartbeat"}."""
        self._listeners.append(listener)

    def _emit(self, event: str, record: NodeRecord) -> None:
        for listener in self._listeners:
            listener(event, record)

    def register(self, info: NodeRegistration | Mapping[str, Any], now: float) -> NodeRecord:
        """(Re-)register a node.  ``info`` as it came off the wire is decoded
        here (a bad one raises MessageError, a ValueError, and changes nothing)."""
        if not isinstance(info, NodeRegistration):
            info = NodeRegistration.from_wire(info)
        record = NodeRecord(
            node_id=info.node_id, role=info.role, url=info.url.rstrip("/"),
            capacity=info.capacity, transfer=dict(info.transfer),
            registered_at=now, last_seen=now, load=info.load)
        previous = self._nodes.get(record.node_id)
        self._nodes[record.node_id] = record
        if previous is not None and previous.alive:
            # Same name re-registering (restarted process): treat the old
            # incarnation as gone so its cached blocks are forgotten.
            self._emit("left", previous)
        self._emit("joined", record)
        return record

    def heartbeat(self, node_id: str, load: NodeLoad | Mapping[str, Any], now: float) -> bool:
        """False when the node is unknown or was declared dead: it must re-register.
        ``load`` as it came off the wire is decoded here (a bad one raises
        MessageError and changes nothing)."""
        if not isinstance(load, NodeLoad):
            load = NodeLoad.from_wire(load)
        record = self._nodes.get(node_id)
        if record is None or not record.alive:
            return False
        record.last_seen = now
        record.load = load
        self._emit("heartbeat", record)
        return True

    def deregister(self, node_id: str) -> bool:
        record = self._nodes.pop(node_id, None)
        if record is None:
            return False
        if record.alive:
            self._emit("left", record)
        return True

    def declare_dead(self, node_id: str) -> bool:
        """Mark a node dead before its heartbeats time out (a caller could not
        connect to it at all).  A node that is in fact alive is refused at its
        next heartbeat and registers again."""
        record = self._nodes.get(node_id)
        if record is None or not record.alive:
            return False
        record.alive = False
        self._emit("dead", record)
        return True

    def sweep(self, now: float) -> list[NodeRecord]:
        """Mark nodes dead whose heartbeats stopped; returns the newly dead."""
        dead = []
        for record in self._nodes.values():
            if record.alive and now - record.last_seen > self.timeout_s:
                record.alive = False
                dead.append(record)
                self._emit("dead", record)
        return dead

    def get(self, node_id: str) -> NodeRecord | None:
        return self._nodes.get(node_id)

    def alive(self, role: str | None = None) -> list[NodeRecord]:
        return [r for r in self._nodes.values() if r.alive and (role is None or r.role == role)]

    def dead(self) -> list[NodeRecord]:
        return [r for r in self._nodes.values() if not r.alive]


class ConductorUnreachable(Exception):
    pass


class ConductorLocator:
    """The URL of the conductor this node works for, read at each call (with
    etcd it moves to each new leader).  Calling it gives the URL."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def __call__(self) -> str:
        return self.url


class MembershipClient:
    """Registers this node with the conductor and keeps it alive there."""

    def __init__(self, *, conductor_url: str | ConductorLocator,
                 info_fn: Callable[[], NodeRegistration],
                 load_fn: Callable[[], NodeLoad], interval_s: float,
                 connect_timeout_s: float, token: str = "",
                 discovery: Callable[[Callable[[ConductorRecord], None]], EtcdDiscovery]
                 | None = None) -> None:
        self.locator = (conductor_url if isinstance(conductor_url, ConductorLocator)
                        else ConductorLocator(conductor_url))
        # discovery(on_change) -> EtcdDiscovery: the leader comes from etcd.
        self._make_discovery = discovery
        self.discovery: EtcdDiscovery | None = None
        self._leader_changed = asyncio.Event()
        self.info_fn = info_fn
        self.load_fn = load_fn
        self.interval_s = interval_s
        self.connect_timeout_s = connect_timeout_s
        self.token = token
        self._client: InternalClient | None = None
        self._task: asyncio.Task | None = None
        self.registered = False

    @property
    def conductor_url(self) -> str:
        return self.locator.url

    async def _register_once(self) -> None:
        assert self._client is not None
        try:
            await self._client.send(self.conductor_url + Route.NODE_REGISTER, self.info_fn(),
                                    what="registration")
        except InternalCallError as exc:
            if exc.status is None:
                raise  # unreachable: the caller retries
            raise ConductorUnreachable(
                f"conductor at {self.conductor_url} refused registration "
                f"(HTTP {exc.status}: {exc.detail})") from None
        self.registered = True

    async def start(self) -> None:
        """Register, retrying until ``connect_timeout_s``; then heartbeat in the background."""
        self._client = InternalClient.open(self.token)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout_s
        if self._make_discovery is not None:
            await self._discover_leader()
        last_error: Exception | None = None
        while loop.time() < deadline:
            try:
                await self._register_once()
                break
            except InternalCallError as exc:
                last_error = exc
                await asyncio.sleep(min(0.25, max(0.0, deadline - loop.time())))
        else:
            raise ConductorUnreachable(
                f"cannot reach conductor at {self.conductor_url} within "
                f"{self.connect_timeout_s:g}s ({type(last_error).__name__}: {last_error})")
        log.info("registered with conductor %s", self.conductor_url)
        self._task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")

    async def _discover_leader(self) -> None:
        from mooncaked.node.etcd_store import EtcdUnavailable

        self.discovery = self._make_discovery(self._on_new_leader)
        try:
            leader = await self.discovery.start(self.connect_timeout_s)
        except EtcdUnavailable as exc:
            raise ConductorUnreachable(str(exc)) from None
        self.locator.url = leader.url.rstrip("/")
        log.info("etcd names %s at %s as the conductor leader", leader.conductor_id, leader.url)

    def _on_new_leader(self, leader: ConductorRecord) -> None:
        self.locator.url = leader.url.rstrip("/")
        self._leader_changed.set()  # the heartbeat loop registers with it at once

    async def _heartbeat(self, node_id: str) -> None:
        assert self._client is not None
        try:
            await self._client.send(self.conductor_url + Route.NODE_HEARTBEAT,
                                    Heartbeat(node_id=node_id, load=self.load_fn()),
                                    what="heartbeat")
        except InternalCallError as exc:
            if exc.status != 404:
                raise
            log.warning("conductor forgot this node; registering again")
            await self._register_once()

    async def _heartbeat_loop(self) -> None:
        failures = 0
        node_id = self.info_fn().node_id
        while True:
            await wait_woken(self._leader_changed, self.interval_s)
            try:
                if self._leader_changed.is_set():
                    self._leader_changed.clear()
                    log.info("registering with the new conductor leader %s", self.conductor_url)
                    await self._register_once()
                    failures = 0
                    continue
                await self._heartbeat(node_id)
                if failures:
                    log.info("conductor reachable again after %d failed heartbeats", failures)
                failures = 0
            except (InternalCallError, ConductorUnreachable) as exc:
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    log.warning("heartbeat to %s failed (%d in a row): %s",
                                self.conductor_url, failures, exc)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        if self._client is not None:
            if self.registered:
                try:
                    await self._client.send(self.conductor_url + Route.NODE_DEREGISTER,
                                            Deregistration(node_id=self.info_fn().node_id),
                                            what="deregistration", check_status=False)
                except InternalCallError:
                    pass  # conductor gone: it will time us out
            await self._client.close()
        if self.discovery is not None:
            await self.discovery.close()
