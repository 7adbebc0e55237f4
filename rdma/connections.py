"""Connection management: pooled endpoints per path, lazy connects, path health on failure, the stall watchdog."""

from __future__ import annotations

import asyncio
import logging
import time

from .config import TransferConfig
from .descriptors import SegmentDescriptor
from .directory import SegmentDirectory
from .endpoint import Endpoint, EndpointError
from .endpoint_pool import SievePool
from .slices import Path, PathTable
from .tcp import TcpEndpoint
from .verbs import RdmaEndpoint, VerbsTransport

log = logging.getLogger(__name__)

EpKey = tuple[str, Path, int]  # (segment, path, connection index)


class _ConnectAbandoned(Exception):
    """A shared connect whose requester was cancelled: a waiter connects anew."""


class Connections:
    """Up to ``connections_per_peer`` endpoints per (segment, path), in a
    SIEVE pool bounded by ``max_endpoints`` (evicted ones retire: they close
    once idle).

    Invariants: at most one connect runs per key (later askers await the
    first); a failed endpoint leaves the pool at once, so the next use of
    its key reconnects; every failure that had work on it is charged to
    the path in ``paths``, which is what steers slices elsewhere.
    """

    def __init__(self, config: TransferConfig, directory: SegmentDirectory) -> None:
        self.config = config
        self.directory = directory
        self.pool: SievePool[EpKey, Endpoint] = SievePool(config.max_endpoints, self._evicted)
        self.paths = PathTable(config.nic_backoff_s, config.nic_backoff_max_s)
        self.path_failures = 0
        self._connecting: dict[EpKey, tuple[SegmentDescriptor, asyncio.Future]] = {}
        self._slots: dict[tuple[str, Path], asyncio.Semaphore] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._verbs: VerbsTransport | None = None
        self._watchdog: asyncio.Task | None = None

    def start(self, loop: asyncio.AbstractEventLoop, verbs: VerbsTransport | None) -> None:
        """Connect over rdma when ``verbs`` is given, else tcp; start the watchdog."""
        self._loop, self._verbs = loop, verbs
        self._watchdog = asyncio.create_task(self._watch())

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for ep in self.pool.values():
            ep.close()

    def slots(self, seg: str, path: Path) -> asyncio.Semaphore:
        """Bounds the slices in flight on a path to what its connections can
        pipeline (connections_per_peer x max_inflight_per_endpoint)."""
        slots = self._slots.get((seg, path))
        if slots is None:
            slots = self._slots[(seg, path)] = asyncio.Semaphore(
                self.config.connections_per_peer * self.config.max_inflight_per_endpoint)
        return slots

    async def endpoint(self, desc: SegmentDescriptor, path: Path) -> Endpoint:
        """Least-busy live connection of ``path``; opens another one (up to
        connections_per_peer) when all existing ones are busy.

        A connection serves only callers of the descriptor it was opened for:
        a peer that registered again (restarted on new ports) is reached
        through new connections, and a caller still holding the descriptor
        the directory replaced gets EndpointError at once (its request looks
        the peer up afresh) instead of a connect to the old address."""
        seg = desc.name
        while True:
            best: Endpoint | None = None
            free_idx = None
            for idx in range(self.config.connections_per_peer):
                key = (seg, path, idx)
                ep = self.pool.get(key)
                if ep is not None and ep.failed is None and ep.descriptor != desc:
                    if self.directory.holds(ep.descriptor):
                        raise EndpointError(f"segment {seg!r} registered again since this request "
                                            f"looked it up (new address)")
                    self.pool.remove(key)  # opened for a registration the peer has left
                    ep.retire()
                    ep = None
                if ep is None or ep.failed is not None:
                    if ep is not None:
                        self.pool.remove(key)
                    if free_idx is None:
                        free_idx = idx
                    continue
                if best is None or len(ep.pending) < len(best.pending):
                    best = ep
            if best is not None and (not best.pending or free_idx is None):
                return best
            if free_idx is None:
                assert best is not None
                return best
            key = (seg, path, free_idx)
            other = self._connecting.get(key)
            if other is not None and other[0] != desc:
                # A connect for another registration holds the slot: let it end
                # (it fails, or pools an endpoint the loop above judges).
                await asyncio.wait([other[1]])
                continue
            return await self._connect(key, desc, path)

    async def _connect(self, key: EpKey, desc: SegmentDescriptor, path: Path) -> Endpoint:
        """Open the endpoint for ``key``; concurrent askers with the same
        descriptor share one connect."""
        pending = self._connecting.get(key)
        if pending is not None:
            try:
                return await asyncio.shield(pending[1])
            except _ConnectAbandoned:
                # Its requester was cancelled, not this one: connect anew.
                return await self._connect(key, desc, path)
        assert self._loop is not None, "connections not started"
        fut = self._loop.create_future()
        self._connecting[key] = (desc, fut)
        try:
            ep = self._new_endpoint(desc, path)
            ep.pool_key, ep.descriptor = key, desc
            try:
                await ep.connect()
            except EndpointError as e:
                self.path_failures += 1
                if self.directory.holds(desc):
                    # Charged to the path only while ``desc`` is the peer's
                    # registration: once a lookup found it elsewhere (it
                    # restarted), a refused connect to its old address says
                    # nothing of the path to the new one.
                    self.paths.failure(key[0], path, str(e))
                # The peer may have restarted elsewhere; look it up again next time.
                self.directory.invalidate(desc)
                raise
            self.pool.put(key, ep)
            fut.set_result(ep)
            return ep
        except asyncio.CancelledError:
            # The requester that opened the connect was cancelled (its
            # deadline, its caller): the requests sharing it were not.
            fut.set_exception(_ConnectAbandoned(f"connect to {desc.name!r} abandoned"))
            fut.exception()
            raise
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # mark retrieved; waiters re-raise it
            raise
        finally:
            del self._connecting[key]

    def _new_endpoint(self, desc: SegmentDescriptor, path: Path) -> Endpoint:
        assert self._loop is not None
        nic = desc.nic(path[1])
        if nic is None:
            raise EndpointError(f"segment {desc.name!r} has no nic {path[1]!r}")
        if self._verbs is not None:
            if desc.transport != "rdma":
                raise EndpointError(f"segment {desc.name!r} speaks {desc.transport}, not rdma")
            return RdmaEndpoint(self._loop, self._verbs, path[0], path[1], nic.host, nic.port,
                                self.config.auth_token, desc, self.config.user_timeout_ms,
                                self.config.connect_timeout_s, on_fail=self._endpoint_failed)
        return TcpEndpoint(self._loop, path[0], nic.host, nic.port, self.config.auth_token,
                           desc.name, self.config.user_timeout_ms, self.config.connect_timeout_s,
                           on_fail=self._endpoint_failed, payload_auth=self.config.payload_auth)

    def _endpoint_failed(self, ep: Endpoint, reason: str, penalize: bool = True) -> None:
        key = ep.pool_key
        if self.pool.get(key) is ep:
            self.pool.remove(key)
        if penalize:
            self.path_failures += 1
            self.paths.failure(key[0], key[1], reason)
            log.warning("endpoint %s -> %s failed: %s", key[1][0], key[1][1], reason)

    def _evicted(self, key: EpKey, ep: Endpoint) -> None:
        ep.retire()

    async def _watch(self) -> None:
        """Declare endpoints dead when they have work but make no progress;
        forget the state of paths nothing uses any more."""
        period = min(self.config.stall_timeout_s / 4, 0.5)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for ep in self.pool.values():
                if ep.pending and now - ep.last_progress > self.config.stall_timeout_s:
                    ep.abort(f"no progress for stall_timeout_s={self.config.stall_timeout_s}s")
            self.forget_idle(now)

    def forget_idle(self, now: float) -> None:
        """Bound the per-path tables by the paths in use, not every path ever
        used: a path with nothing in flight has no slice holding or awaiting
        its semaphore (a slice counts its bytes before it queues for a slot
        and uncounts them after it gave the slot back)."""
        self.paths.forget_idle(now)
        for key in [k for k in self._slots if k not in self.paths.inflight]:
            del self._slots[key]
