"""Cluster membership: which prefill/decode nodes exist and whether they live.

``NodeRegistry`` is the conductor's bookkeeping.  It does no I/O and never
reads the clock: callers pass ``now`` (seconds, any monotonic origin), so the
HTTP conductor and the simulator can share it.

``MembershipClient`` is the node side: register at start-up (retrying until
the conductor answers or a deadline passes), heartbeat with a load report,
re-register when the conductor has forgotten us (it restarted), deregister on
a graceful exit.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
from mooncaked.node.tasks import cancel_and_wait

log = logging.getLogger("mooncaked.membership")


@dataclass
class NodeRecord:
    node_id: str
    role: str
    url: str                      # base URL of the node's HTTP server
    capacity: dict[str, Any]      # e.g. store pages, max batch
    transfer: dict[str, Any]      # transfer-engine segment descriptor
    registered_at: float
    last_seen: float
    load: dict[str, Any] = field(default_factory=dict)
    alive: bool = True

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "node_id": self.node_id, "role": self.role, "url": self.url,
            "alive": self.alive, "capacity": self.capacity, "load": self.load,
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

    def register(self, info: dict[str, Any], now: float) -> NodeRecord:
        for key in ("node_id", "role", "url"):
            if not isinstance(info.get(key), str) or not info[key]:
                raise ValueError(f"registration needs a non-empty string {key!r}")
        if info["role"] not in ("prefill", "decode", "colocated"):
            raise ValueError(f"cannot register a node of role {info['role']!r}")
        record = NodeRecord(
            node_id=info["node_id"], role=info["role"], url=info["url"].rstrip("/"),
            capacity=dict(info.get("capacity") or {}), transfer=dict(info.get("transfer") or {}),
            registered_at=now, last_seen=now, load=dict(info.get("load") or {}))
        previous = self._nodes.get(record.node_id)
        self._nodes[record.node_id] = record
        if previous is not None and previous.alive:
            # Same name re-registering (restarted process): treat the old
            # incarnation as gone so its cached blocks are forgotten.
            self._emit("left", previous)
        self._emit("joined", record)
        return record

    def heartbeat(self, node_id: str, load: dict[str, Any], now: float) -> bool:
        """False when the node is unknown or was declared dead: it must re-register."""
        record = self._nodes.get(node_id)
        if record is None or not record.alive:
            return False
        record.last_seen = now
        record.load = dict(load)
        self._emit("heartbeat", record)
        return True

    def deregister(self, node_id: str) -> bool:
        record = self._nodes.pop(node_id, None)
        if record is None:
            return False
        if record.alive:
            self._emit("left", record)
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


class MembershipClient:
    """Registers this node with the conductor and keeps it alive there."""

    def __init__(self, *, conductor_url: str, info_fn: Callable[[], dict[str, Any]],
                 load_fn: Callable[[], dict[str, Any]], interval_s: float,
                 connect_timeout_s: float, token: str = "") -> None:
        self.conductor_url = conductor_url.rstrip("/")
        self.info_fn = info_fn
        self.load_fn = load_fn
        self.interval_s = interval_s
        self.connect_timeout_s = connect_timeout_s
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self.registered = False

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        assert self._session is not None
        async with self._session.post(self.conductor_url + path, json=body,
                                      headers=self.headers) as resp:
            try:
                data = await resp.json(content_type=None)
            except ValueError:
                data = {}
            return resp.status, data if isinstance(data, dict) else {}

    async def _register_once(self) -> None:
        status, data = await self._post("/internal/nodes/register", self.info_fn())
        if status != 200:
            raise ConductorUnreachable(
                f"conductor at {self.conductor_url} refused registration "
                f"(HTTP {status}: {data.get('error', {}).get('message', data)})")
        self.registered = True

    async def start(self) -> None:
        """Register, retrying until ``connect_timeout_s``; then heartbeat in the background."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout_s
        last_error: Exception | None = None
        while loop.time() < deadline:
            try:
                await self._register_once()
                break
            except ConductorUnreachable:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last_error = exc
                await asyncio.sleep(min(0.25, max(0.0, deadline - loop.time())))
        else:
            raise ConductorUnreachable(
                f"cannot reach conductor at {self.conductor_url} within "
                f"{self.connect_timeout_s:g}s ({type(last_error).__name__}: {last_error})")
        log.info("registered with conductor %s", self.conductor_url)
        self._task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")

    async def _heartbeat_loop(self) -> None:
        failures = 0
        node_id = self.info_fn()["node_id"]
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                status, _ = await self._post("/internal/nodes/heartbeat",
                                             {"node_id": node_id, "load": self.load_fn()})
                if status == 404:
                    log.warning("conductor forgot this node; registering again")
                    await self._register_once()
                if failures:
                    log.info("conductor reachable again after %d failed heartbeats", failures)
                failures = 0
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ConductorUnreachable) as exc:
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    log.warning("heartbeat to %s failed (%d in a row): %s",
                                self.conductor_url, failures, exc)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        if self._session is not None:
            if self.registered:
                try:
                    await self._post("/internal/nodes/deregister",
                                     {"node_id": self.info_fn()["node_id"]})
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    pass  # conductor gone: it will time us out
            await self._session.close()
