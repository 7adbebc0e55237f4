"""TransferEngine: the public batch API over pooled, multipath, failure-tolerant endpoints.

Flow of one request: resolve the target segment (directory.py: cache,
else the pluggable resolver) -> check bounds against its descriptor ->
cut into slices -> each slice picks the least-loaded usable path
(slices.py), takes an endpoint from the pool (connections.py, connecting
lazily), posts, and on failure is re-posted on another path up to
``max_retries`` times (execution.py). The batch API around that lives in
batches.py; our own regions, listeners and descriptor in local_segment.py.

This class only composes those parts and keeps the public surface in one
place. Everything here is transport-neutral; tcp.py and verbs.py only
provide a listener (target side) and an endpoint (endpoint.py) with
``post()`` returning a future.
"""

from __future__ import annotations

import asyncio

from .batches import Batches
from .config import TransferConfig
from .connections import Connections, EpKey
from .descriptors import SegmentDescriptor
from .directory import Resolver, SegmentDirectory
from .endpoint import Endpoint
from .endpoint_pool import SievePool
from .execution import RequestRunner
from .local_segment import LocalSegment
from .slices import PathTable
from .topology import Topology
from .types import BatchId, Region, TransferRequest, TransferStatus, WriteGuard


class TransferEngine:
    def __init__(self, config: TransferConfig, segment_name: str) -> None:
        if not segment_name:
            raise ValueError("segment_name must be non-empty")
        self.config = config
        self.name = segment_name
        self._local = LocalSegment(config, segment_name)
        # A peer in use holds an endpoint, and the pool keeps max_endpoints:
        # caching more resolved descriptors than that would only save a
        # lookup before a connect.
        self._directory = SegmentDirectory(config.max_endpoints)
        self._connections = Connections(config, self._directory)
        self._runner = RequestRunner(config, self._local, self._directory, self._connections)
        self._batches = Batches(self._local.regions, self._runner.run)

    # -- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._batches.started = True
        self._local.start(loop)
        self._runner.start()
        self._connections.start(loop, self._local.verbs)

    async def close(self) -> None:
        self._batches.cancel_all()
        self._connections.close()
        await self._local.close()

    async def __aenter__(self) -> "TransferEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- memory and segments --------------------------------------------
    def register_local_memory(self, buffer, location: str = "cpu:0",
                              write_guard: WriteGuard | None = None) -> Region:
        """Expose ``buffer`` to peers as region ``Region.id`` of this segment.
        The caller keeps the buffer alive and must not resize it.  With a
        ``write_guard`` a peer's WRITE lands only if the guard admits its
        capability and range (tcp; see types.WriteGuard); READs are never guarded."""
        return self._local.register(buffer, location, write_guard)

    def set_write_guard(self, region_id: int, guard: WriteGuard | None) -> None:
        """Install (None: remove) the write guard of a registered region; it
        applies to every WRITE frame from the next one on.  KeyError if unknown."""
        self._local.set_write_guard(region_id, guard)

    def write_local(self, region_id: int, offset: int, data, capability: int = 0) -> bool:
        """Copy ``data`` into our own region at ``offset`` (a transfer to our own
        segment without the network: a colocated node's KV "stream"), through
        the region's write guard like a peer's WRITE; False, counted in
        ``stats()["refused_writes"]``, when the guard refuses."""
        return self._local.write_local(region_id, offset, data, capability)

    def unregister_local_memory(self, region_id: int) -> None:
        self._local.unregister(region_id)

    def descriptor(self) -> SegmentDescriptor:
        """What peers need to reach our regions."""
        return self._local.descriptor()

    def segment_descriptor(self) -> dict:
        """``descriptor()`` in its JSON-serialisable wire form."""
        return self.descriptor().to_wire()

    def add_segment(self, desc: dict | SegmentDescriptor) -> None:
        """Make a peer's segment known; raises ValueError naming a bad field."""
        self._directory.add(desc)

    async def resolve_segment(self, name: str) -> SegmentDescriptor | None:
        """A peer's descriptor (added, cached, or asked of the resolver); None if unknown."""
        return await self._directory.resolve(name)

    def set_resolver(self, resolver: Resolver | None) -> None:
        """``resolver(name)`` is asked for segments not added; it returns a
        wire dict (or a SegmentDescriptor), or None when the name is unknown."""
        self._directory.set_resolver(resolver)

    # -- batches ------------------------------------------------------------
    def allocate_batch(self, n: int) -> BatchId:
        return self._batches.allocate(n)

    async def submit_transfer(self, batch: BatchId, requests: list[TransferRequest]) -> None:
        """Start ``requests`` (they run concurrently); raises ValueError for
        requests that are wrong on our side (unknown local region, out of range)."""
        await self._batches.submit(batch, requests)

    def transfer_status(self, batch: BatchId, i: int) -> TransferStatus:
        return self._batches.status(batch, i)

    async def wait(self, batch: BatchId, timeout: float | None = None) -> list[TransferStatus]:
        """Wait until every submitted request of ``batch`` ended (or ``timeout``)."""
        return await self._batches.wait(batch, timeout)

    def free_batch(self, batch: BatchId) -> None:
        self._batches.free(batch)

    async def transfer(self, requests: list[TransferRequest]) -> None:
        """Run ``requests`` to completion; raise TransferError naming the first failure."""
        await self._batches.transfer(requests)

    # -- state and counters ----------------------------------------------------
    @property
    def transport(self) -> str:
        """The transport in use: "tcp" or "rdma" once started, "" before."""
        return self._local.transport

    @property
    def regions(self) -> dict[int, Region]:
        return self._local.regions

    @property
    def topology(self) -> Topology:
        return self._local.topology

    @property
    def slice_bytes(self) -> int:
        return self._runner.slice_bytes

    @property
    def paths(self) -> PathTable:
        return self._connections.paths

    @property
    def nic_bytes(self) -> dict[str, int]:
        return self._runner.nic_bytes

    @property
    def path_bytes(self) -> dict[str, int]:
        return self._runner.path_bytes

    @property
    def retries(self) -> int:
        return self._runner.retries

    @property
    def path_failures(self) -> int:
        return self._connections.path_failures

    @property
    def _pool(self) -> SievePool[EpKey, Endpoint]:
        return self._connections.pool

    def stats(self) -> dict:
        return {
            "transport": self.transport,
            "nic_bytes": dict(self.nic_bytes),
            "path_bytes": dict(self.path_bytes),
            "endpoints": len(self._pool),
            "evictions": self._pool.evictions,
            "retries": self.retries,
            "path_failures": self.path_failures,
            "refused_connections": self._local.refused,
            "refused_writes": self._local.refused_writes,
            "bad_payloads": self._local.bad_payloads,
            "batches": len(self._batches),
        }
