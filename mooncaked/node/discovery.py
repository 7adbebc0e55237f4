"""A worker's side of etcd: its record under a lease, and which conductor leads.

The node keeps ``nodes/<node_id>`` (its NodeRegistration) under a lease it
renews every third of ``etcd.lease_ttl_s``; a node that dies or is cut off
disappears from etcd one TTL later.  It follows the leader key (a watch, and
a re-read every round in case a watch event was missed) and calls
``on_leader`` whenever the leading conductor changes; ``MembershipClient``
then registers with the new leader.  When etcd is unreachable nothing changes
for the node: it keeps its conductor and keeps serving what it was given.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from mooncaked.node.etcd_store import (ConductorRecord, EtcdStore, EtcdUnavailable,
                                       decode_conductor, encode)
from mooncaked.node.messages import NodeRegistration
from mooncaked.node.tasks import cancel_and_wait, wait_woken

log = logging.getLogger("mooncaked.discovery")


class EtcdDiscovery:
    def __init__(self, store: EtcdStore, registration: Callable[[], NodeRegistration],
                 ttl_s: int, on_leader: Callable[[ConductorRecord], None]) -> None:
        self.store = store
        self.registration = registration
        self.ttl_s = ttl_s
        self.on_leader = on_leader
        self.leader: ConductorRecord | None = None
        self.reachable = False
        self._lease: int | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @property
    def round_s(self) -> float:
        return self.ttl_s / 3

    async def start(self, timeout_s: float) -> ConductorRecord:
        """Publish our record and wait for a leader, retrying for ``timeout_s``;
        EtcdUnavailable (naming etcd and the key) when there is none by then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        problem = "no conductor has been elected"
        while True:
            try:
                await self._round()
                if self.leader is not None:
                    break
            except EtcdUnavailable as exc:
                problem = str(exc)
            if loop.time() >= deadline:
                raise EtcdUnavailable(
                    f"no conductor leader in etcd ({', '.join(self.store.section.endpoints)}, "
                    f"key {self.store.keys.leader.decode()}) within {timeout_s:g}s: {problem}")
            await asyncio.sleep(min(0.25, max(0.0, deadline - loop.time())))
        self._tasks = [asyncio.create_task(self._loop(), name="etcd-presence"),
                       asyncio.create_task(self._watch_loop(), name="etcd-leader-watch")]
        return self.leader

    async def close(self) -> None:
        """Leave etcd: revoking the lease removes our record at once."""
        for task in self._tasks:
            await cancel_and_wait(task)
        if self._lease is not None:
            try:
                await self.store.revoke(self._lease)
            except EtcdUnavailable as exc:
                log.warning("could not remove this node's etcd record (%s): it expires in %ds",
                            exc, self.ttl_s)
        await self.store.close()

    def status(self) -> dict[str, Any]:
        return {"etcd_reachable": self.reachable,
                "leader": None if self.leader is None else self.leader.to_wire()}

    async def _round(self) -> None:
        keys = self.store.keys
        if self._lease is not None and not await self.store.refresh(self._lease):
            log.warning("this node's etcd lease expired (etcd was unreachable too long?): "
                        "publishing the record again")
            self._lease = None
        if self._lease is None:
            lease = await self.store.grant(self.ttl_s)
            record = self.registration()
            await self.store.put(keys.node(record.node_id), encode(record), lease)
            self._lease = lease
        raw = await self.store.get(keys.leader)
        leader = decode_conductor(raw) if raw is not None else None
        if not self.reachable:
            log.info("etcd reachable (%s)", self.store.endpoint)
        self.reachable = True
        if leader is not None and leader != self.leader:
            previous, self.leader = self.leader, leader
            if previous is not None:
                log.info("conductor leader changed: %s at %s", leader.conductor_id, leader.url)
                self.on_leader(leader)

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            # After a failed round the next endpoint is tried soon: the lease must
            # be renewed through the members still up before its TTL runs out.
            await wait_woken(self._wake, self.round_s if self.reachable else self.round_s / 4)
            try:
                await self._round()
            except EtcdUnavailable as exc:
                if self.reachable:
                    log.warning("etcd unreachable; still serving with conductor %s (%s)",
                                self.leader.url if self.leader else "?", exc)
                self.reachable = False
            except Exception:  # noqa: BLE001 - a bug must not end the presence for good
                log.exception("etcd presence round failed")
                self.reachable = False

    async def _watch_loop(self) -> None:
        await self.store.wake_on_changes(self.store.keys.leader, self._wake, self.round_s)

