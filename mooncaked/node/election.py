"""Conductor leader election on etcd: a lease, and a transaction on the leader key.

Each conductor holds one lease (``etcd.lease_ttl_s``), renewed every third of
its TTL, and keeps ``conductors/<id>`` under it.  Whenever the leader key is
absent it tries to create it, holding its own record, under that lease
(create-if-absent in one transaction: at most one wins).  The leader key
therefore lives exactly as long as the leader keeps renewing; when the leader
dies the key expires with its lease and every standby, woken by its watch on
the key, campaigns at once.

Invariants:
  * ``is_leader`` is True only while the leader key holds our own record
    (``incarnation`` included) and our last successful renewal is younger
    than the TTL: once etcd has been unreachable for a TTL another conductor
    may already lead, so we stop claiming it;
  * ``reachable`` is False from the first failed etcd call until the next
    successful round;
  * ``current`` is True while the last successful round began less than a
    TTL ago: what it learnt (who leads) still holds, since no conductor can
    take the lead before the leader's lease runs out.  A request arriving
    while it is False waits up to a TTL for it (``wait_current``) and is
    refused only then, so an etcd blip (a member lost, even etcd's raft
    leader, which takes etcd a second or two to replace) refuses nothing.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, Awaitable, Callable

from mooncaked.node.etcd_store import (ConductorRecord, EtcdStore, EtcdUnavailable,
                                       decode_conductor, encode)
from mooncaked.node.tasks import cancel_and_wait, wait_woken

log = logging.getLogger("mooncaked.election")

# Called on each round while leading: True on the first round after winning
# (the new leader's catch-up), False afterwards.  It may raise EtcdUnavailable.
LeaderDuty = Callable[[bool], Awaitable[None]]


def new_incarnation() -> str:
    return secrets.token_hex(8)


class LeaderElection:
    def __init__(self, store: EtcdStore, me: ConductorRecord, ttl_s: int,
                 leader_duty: LeaderDuty | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.me = me
        self.ttl_s = ttl_s
        self.leader_duty = leader_duty
        self.clock = clock
        self._claims_leadership = False
        self.reachable = False
        self.leader: ConductorRecord | None = None
        self.last_error = "not connected to etcd yet"  # until the first round ends
        self.elected_at: float | None = None
        self._lease: int | None = None
        self._renewed_at: float | None = None
        self._round_ok_at: float | None = None  # when the last successful round began
        self._duty_done = False      # the catch-up after winning has run
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @property
    def is_leader(self) -> bool:
        """We hold the leader key and renewed our lease less than a TTL ago.

        The age is checked here, on every read, not only when a round fails:
        a round stuck in a call to an etcd that accepts connections but does
        not answer would otherwise keep a conductor leading after its lease
        (and so the leader key) may have expired and another won."""
        return self._claims_leadership and self._renewed_at is not None \
            and self.clock() - self._renewed_at < self.ttl_s

    @is_leader.setter
    def is_leader(self, value: bool) -> None:
        self._claims_leadership = value

    @property
    def round_s(self) -> float:
        return self.ttl_s / 3

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._campaign_loop(), name="election"),
                       asyncio.create_task(self._watch_loop(), name="election-watch")]

    async def close(self) -> None:
        """Stop campaigning; a leader revokes its lease so that a standby takes
        over at once instead of a TTL later."""
        for task in self._tasks:
            await cancel_and_wait(task)
        was_leader, self.is_leader = self.is_leader, False
        if self._lease is not None:
            try:
                await self.store.revoke(self._lease)
                if was_leader:
                    log.info("stepped down: lease revoked, a standby takes over")
            except EtcdUnavailable as exc:
                log.warning("could not revoke the election lease (%s): it expires in %ds",
                            exc, self.ttl_s)
        await self.store.close()

    @property
    def current(self) -> bool:
        """The last successful round began less than a TTL ago (module docstring)."""
        return self._round_ok_at is not None and self.clock() - self._round_ok_at < self.ttl_s

    async def wait_current(self, timeout_s: float) -> bool:
        """Whether ``current`` holds within ``timeout_s`` (at once if it does)."""
        deadline = self.clock() + timeout_s
        while not self.current:
            if self.clock() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    @property
    def role(self) -> str:
        """leader | standby (another leads) | campaigning (no leader known) | etcd_unreachable"""
        if self.is_leader:
            return "leader"
        if self._round_ok_at is None and self.last_error.startswith("not connected"):
            return "campaigning"  # the first round has not ended yet
        if not self.reachable:
            return "etcd_unreachable"
        return "standby" if self.leader is not None and self.leader != self.me else "campaigning"

    def status(self) -> dict[str, Any]:
        return {"conductor_id": self.me.conductor_id,
                "role": self.role,
                "etcd_reachable": self.reachable,
                "leader": None if self.leader is None else self.leader.to_wire(),
                "lease_ttl_s": self.ttl_s,
                "last_error": None if self.reachable else self.last_error}

    async def _campaign_loop(self) -> None:
        while True:
            try:
                began = self.clock()
                await self._round()
                self._round_ok_at = began
                if not self.reachable:
                    log.info("etcd reachable again (%s)", self.store.endpoint)
                self.reachable = True
            except EtcdUnavailable as exc:
                if self.reachable or self.last_error.startswith("not connected"):
                    log.warning("etcd unreachable: refusing new requests until it is back (%s)", exc)
                self.reachable = False
                self.last_error = str(exc)
                self._expire_if_stale()
            except Exception as exc:  # noqa: BLE001 - a bug must not end the campaign for good
                log.exception("election round failed")
                self.reachable = False
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._expire_if_stale()
            self._wake.clear()
            await wait_woken(self._wake, self._next_round_in())

    def _next_round_in(self) -> float:
        """A round after a success; a quarter of that after a failure, so that the
        next endpoint is tried (and the lease renewed through the members still
        up) well within the TTL."""
        return self.round_s if self.reachable else self.round_s / 4

    def _expire_if_stale(self) -> None:
        """Without a renewal for a TTL our lease may be gone and another leader elected."""
        if self._claims_leadership and (self._renewed_at is None
                                        or self.clock() - self._renewed_at >= self.ttl_s):
            log.warning("no lease renewal for %ds: no longer claiming leadership", self.ttl_s)
            self._set_leader(None)

    async def _round(self) -> None:
        keys = self.store.keys
        if self._lease is None:
            self._lease = await self.store.grant(self.ttl_s)
            self._renewed_at = self.clock()
            await self.store.put(keys.conductor(self.me.conductor_id), encode(self.me), self._lease)
        else:
            renewed_at = self.clock()
            if not await self.store.refresh(self._lease):
                log.warning("election lease %x expired", self._lease)
                self._lease = None
                self._set_leader(None)
                self._wake.set()  # grant a new one at once
                return
            self._renewed_at = renewed_at
        raw = await self.store.get(keys.leader)
        if raw is None and await self.store.create(keys.leader, encode(self.me), self._lease):
            log.info("won the election: %s leads at %s", self.me.conductor_id, self.me.url)
            raw = encode(self.me)
        elif raw is None:
            raw = await self.store.get(keys.leader)  # lost the race: who won?
        self._set_leader(decode_conductor(raw) if raw is not None else None)
        if self.leader == self.me and self.leader_duty is not None:
            await self.leader_duty(not self._duty_done)
            self._duty_done = True
        # Leading only once the duty (the catch-up) has run at least once.
        self.is_leader = self.leader == self.me and (self._duty_done or self.leader_duty is None)
        if self.is_leader and self.elected_at is None:
            self.elected_at = self.clock()

    def _set_leader(self, leader: ConductorRecord | None) -> None:
        if leader != self.leader:
            if leader is None:
                log.info("no conductor leads right now")
            elif leader != self.me:
                log.info("conductor %s at %s leads; this one (%s) stands by",
                         leader.conductor_id, leader.url, self.me.conductor_id)
        self.leader = leader
        if leader != self.me:
            if self.is_leader:
                log.warning("%s is no longer the leader", self.me.conductor_id)
            self.is_leader = False
            self._duty_done = False
            self.elected_at = None

    async def _watch_loop(self) -> None:
        """Wake the campaign as soon as the leader key changes (a dead leader's
        key expiring); a broken watch is opened again after a round."""
        await self.store.wake_on_changes(self.store.keys.leader, self._wake, self.round_s)
