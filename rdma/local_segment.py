"""Our own segment: transport choice, registered regions, listeners, and the descriptor peers reach them by."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from . import verbs
from .config import TransferConfig
from .descriptors import NicDescriptor, RdmaKey, RegionDescriptor, SegmentDescriptor
from .tcp import TcpListener
from .topology import Topology, discover_matrix
from .types import Region, WriteGuard

log = logging.getLogger(__name__)


def _as_view(buffer) -> memoryview:
    view = memoryview(buffer)
    if view.readonly:
        raise ValueError("buffer must be writable (bytearray, mmap, numpy array, torch tensor...)")
    if not view.contiguous:
        raise ValueError("buffer must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class LocalSegment:
    """The target side of this process.

    Invariant: ``regions`` is one dict for the segment's whole life; the
    listeners hold it and read it from their threads without locks (dict
    lookups are atomic and a Region is never mutated: a new write guard is a
    new Region under the same id), so it is updated in place, never replaced. With rdma every region is registered on every
    device as soon as both exist, whichever came first.
    """

    def __init__(self, config: TransferConfig, name: str) -> None:
        self.config = config
        self.name = name
        self.transport = ""  # "tcp" or "rdma" once started
        self.regions: dict[int, Region] = {}
        self._next_region = 0
        self.listeners: list[TcpListener] = []
        self.topology = Topology({})
        self.verbs: verbs.VerbsTransport | None = None
        self._rdma_keys: dict[int, dict[str, RdmaKey]] = {}  # region id -> device -> its MR
        self.refused_local_writes = 0  # write_local calls a write guard refused

    @property
    def nic_names(self) -> list[str]:
        """Local NICs as paths name them: rdma devices, else tcp addresses."""
        return list(self.verbs.devices) if self.verbs is not None else list(self.config.nics)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Pick the transport (rdma when asked or found, else tcp) and open a
        listener per tcp NIC; with rdma, nics[0]'s listener carries the QP exchange."""
        transport = self.config.transport
        if transport in ("auto", "rdma"):
            ok, why = verbs.probe()
            if not ok:
                if transport == "rdma":
                    raise RuntimeError(f"transport=rdma but no RDMA here: {why}")
                log.info("no RDMA here (%s); using tcp", why)
                transport = "tcp"
            else:
                self.verbs = verbs.VerbsTransport(loop, list(self.config.rdma_devices), self.config.rdma_port,
                                                  self.config.rdma_gid_index, self.config.busy_poll_budget)
                for region in self.regions.values():
                    self._register_rdma(region)
        self.transport = transport
        if transport == "rdma" and self.config.payload_auth:
            log.warning("payload_auth covers the tcp transport only: rdma payloads move by "
                        "one-sided verbs and are not tagged")
        if self.verbs is not None:
            self.topology = Topology(self.config.topology or discover_matrix(list(self.verbs.devices)))
        else:
            self.topology = Topology(self.config.topology or {"*": [list(self.config.nics), []]})
        for i, host in enumerate(self.config.nics):
            port = self.config.port + i if self.config.port else 0
            lst = TcpListener(host, port, self.name, self.regions, self.config.auth_token,
                              self.config.user_timeout_ms, self.config.max_frame_bytes,
                              qp_acceptor=self.verbs.accept_qp if self.verbs is not None else None,
                              payload_auth=self.config.payload_auth)
            lst.start()
            self.listeners.append(lst)

    async def close(self) -> None:
        for lst in self.listeners:
            await asyncio.to_thread(lst.close)
        self.listeners.clear()
        if self.verbs is not None:
            self.verbs.close()
            self.verbs = None

    @property
    def refused(self) -> int:
        """Connections our listeners closed for a bad frame or failed auth."""
        return sum(lst.refused for lst in self.listeners)

    @property
    def bad_payloads(self) -> int:
        """WRITEs whose payload tag did not match (payload_auth; connection closed)."""
        return sum(lst.bad_payloads for lst in self.listeners)

    @property
    def refused_writes(self) -> int:
        """WRITEs a region's write guard refused (peers' and local copies)."""
        return sum(lst.refused_writes for lst in self.listeners) + self.refused_local_writes

    # -- memory ---------------------------------------------------------------
    def register(self, buffer, location: str, write_guard: WriteGuard | None = None) -> Region:
        view = _as_view(buffer)
        region = Region(self._next_region, len(view), location, view, write_guard)
        self._next_region += 1
        if self.verbs is not None:
            self._register_rdma(region)
        self.regions[region.id] = region
        return region

    def _register_rdma(self, region: Region) -> None:
        assert self.verbs is not None
        keys = self.verbs.register(region)
        self._rdma_keys[region.id] = {dev: RdmaKey(k["addr"], k["rkey"]) for dev, k in keys.items()}

    def set_write_guard(self, region_id: int, guard: WriteGuard | None) -> None:
        region = self.regions.get(region_id)
        if region is None:
            raise KeyError(f"no region {region_id}")
        self.regions[region_id] = dataclasses.replace(region, write_guard=guard)

    def write_local(self, region_id: int, offset: int, data, capability: int) -> bool:
        """Copy ``data`` into our region as a peer's WRITE would land: through
        its write guard.  False (and counted) when the guard refuses."""
        region = self.regions.get(region_id)
        if region is None:
            raise KeyError(f"no region {region_id}")
        n = len(data)
        if offset > region.length or n > region.length - offset:
            raise ValueError(f"range [{offset}, +{n}) outside region {region_id} of {region.length} bytes")
        guard = region.write_guard
        if guard is not None and not guard.admit(capability, offset, n):
            self.refused_local_writes += 1
            return False
        try:
            region.view[offset:offset + n] = data
        finally:
            if guard is not None:
                guard.landed(capability)
        return True

    def unregister(self, region_id: int) -> None:
        if self.regions.pop(region_id, None) is None:
            raise KeyError(f"no region {region_id}")
        self._rdma_keys.pop(region_id, None)
        if self.verbs is not None:
            self.verbs.unregister(region_id)

    def descriptor(self) -> SegmentDescriptor:
        """How peers reach our regions (see descriptors.py for the wire form)."""
        regions = []
        for r in self.regions.values():
            # With rdma each region carries its address and rkey on every device.
            rdma = dict(self._rdma_keys.get(r.id, {})) if self.verbs is not None else None
            regions.append(RegionDescriptor(r.id, r.length, r.location, rdma))
        if self.verbs is not None:
            # Each device is a NIC reached through the control listener.
            ctl = self.listeners[0]
            nics = [NicDescriptor(d, ctl.host, ctl.port) for d in self.verbs.devices]
        else:
            nics = [NicDescriptor(lst.host, lst.host, lst.port) for lst in self.listeners]
        topology = {loc: (tuple(pref), tuple(sec)) for loc, (pref, sec) in self.topology.to_dict().items()}
        return SegmentDescriptor(self.name, self.transport, tuple(regions), tuple(nics), topology)
