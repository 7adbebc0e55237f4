"""TransferEngine: the batch API over pooled, multipath, failure-tolerant endpoints.

Flow of one request: resolve the target segment (cache, else the pluggable
resolver) -> check bounds against its descriptor -> cut into slices ->
each slice picks the least-loaded usable path (slices.py), takes an
endpoint from the SIEVE pool (connecting lazily), posts, and on failure is
re-posted on another path up to ``max_retries`` times. The request is
COMPLETED when all its slices are; FAILED when a slice runs out of
retries; TIMEOUT when ``request_timeout_s`` passes first.

Everything here is transport-neutral; tcp.py and verbs.py only provide a
listener (target side) and an endpoint with ``post()`` returning a future.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from . import slices as slicing
from .config import TransferConfig
from .endpoint_pool import SievePool
from .slices import Path, PathTable
from .tcp import EndpointError, TcpEndpoint, TcpListener
from .topology import Topology, discover_matrix
from .verbs import RdmaEndpoint, VerbsTransport
from .types import BatchId, Region, TransferRequest, TransferState, TransferStatus, TransferError

log = logging.getLogger(__name__)

Resolver = Callable[[str], Awaitable[dict]]
EpKey = tuple[str, Path, int]  # (segment, path, connection index)
Endpoint = TcpEndpoint | RdmaEndpoint  # same duck-typed interface


class _RequestFailed(Exception):
    pass


@dataclass
class _Req:
    request: TransferRequest
    state: TransferState = TransferState.WAITING
    reason: str = ""
    transferred: int = 0
    task: asyncio.Task | None = None

    def status(self) -> TransferStatus:
        return TransferStatus(self.state, self.reason, self.transferred)


@dataclass
class _Batch:
    capacity: int
    reqs: list[_Req] = field(default_factory=list)


def _as_view(buffer) -> memoryview:
    view = memoryview(buffer)
    if view.readonly:
        raise ValueError("buffer must be writable (bytearray, mmap, numpy array, torch tensor...)")
    if not view.contiguous:
        raise ValueError("buffer must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class TransferEngine:
    def __init__(self, config: TransferConfig, segment_name: str) -> None:
        if not segment_name:
            raise ValueError("segment_name must be non-empty")
        self.config = config
        self.name = segment_name
        self.transport = ""
        self.regions: dict[int, Region] = {}
        self._next_region = 0
        self._listeners: list[TcpListener] = []
        self._segments: dict[str, dict] = {}
        self._topos: dict[str, Topology] = {}
        self._resolver: Resolver | None = None
        self._batches: dict[BatchId, _Batch] = {}
        self._next_batch = 1
        self._pool: SievePool[EpKey, Endpoint] = SievePool(config.max_endpoints, self._evicted)
        self._connecting: dict[EpKey, asyncio.Future] = {}
        self._slots: dict[tuple[str, Path], asyncio.Semaphore] = {}
        self.paths = PathTable(config.nic_backoff_s, config.nic_backoff_max_s)
        self.topology = Topology({})
        self.nic_bytes: dict[str, int] = {n: 0 for n in config.nics}
        self.path_bytes: dict[str, int] = {}
        self.retries = 0
        self.path_failures = 0
        self._watchdog: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.slice_bytes = 0
        self._verbs: VerbsTransport | None = None
        self._rdma_keys: dict[int, dict] = {}

    # -- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        transport = self.config.transport
        if transport in ("auto", "rdma"):
            from . import verbs
            ok, why = verbs.probe()
            if not ok:
                if transport == "rdma":
                    raise RuntimeError(f"transport=rdma but no RDMA here: {why}")
                log.info("no RDMA here (%s); using tcp", why)
                transport = "tcp"
            else:
                self._verbs = verbs.VerbsTransport(self._loop, list(self.config.rdma_devices),
                                                   self.config.rdma_port, self.config.rdma_gid_index,
                                                   self.config.busy_poll_budget)
                for region in self.regions.values():
                    self._rdma_keys[region.id] = self._verbs.register(region)
        self.transport = transport
        self.slice_bytes = self.config.effective_slice_bytes(transport)
        if self._verbs is not None:
            devs = list(self._verbs.devices)
            self.topology = Topology(self.config.topology or discover_matrix(devs))
            self.nic_bytes = {d: 0 for d in devs}
        else:
            self.topology = Topology(self.config.topology or {"*": [list(self.config.nics), []]})
        for i, host in enumerate(self.config.nics):
            port = self.config.port + i if self.config.port else 0
            lst = TcpListener(host, port, self.name, self.regions, self.config.auth_token,
                              self.config.user_timeout_ms, self.config.max_frame_bytes,
                              qp_acceptor=self._verbs.accept_qp if self._verbs is not None else None)
            lst.start()
            self._listeners.append(lst)
        self._watchdog = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for b in self._batches.values():
            for r in b.reqs:
                if r.task is not None and not r.task.done():
                    r.task.cancel()
        for ep in self._pool.values():
            ep.close()
        for lst in self._listeners:
            await asyncio.to_thread(lst.close)
        self._listeners.clear()
        if self._verbs is not None:
            self._verbs.close()
            self._verbs = None

    async def __aenter__(self) -> "TransferEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- memory and segments --------------------------------------------
    def register_local_memory(self, buffer, location: str = "cpu:0") -> Region:
        """Expose ``buffer`` to peers as region ``Region.id`` of this segment.
        The caller keeps the buffer alive and must not resize it."""
        view = _as_view(buffer)
        region = Region(self._next_region, len(view), location, view)
        self._next_region += 1
        if self._verbs is not None:
            self._rdma_keys[region.id] = self._verbs.register(region)
        self.regions[region.id] = region
        return region

    def unregister_local_memory(self, region_id: int) -> None:
        if self.regions.pop(region_id, None) is None:
            raise KeyError(f"no region {region_id}")
        self._rdma_keys.pop(region_id, None)
        if self._verbs is not None:
            self._verbs.unregister(region_id)

    def segment_descriptor(self) -> dict:
        """JSON-serialisable description peers need to reach our regions."""
        regions = [r.describe() for r in self.regions.values()]
        if self._verbs is not None:
            # rdma: each device is a NIC reached through the control listener;
            # each region carries its address and rkey on every device.
            ctl = self._listeners[0]
            nics = [{"name": d, "host": ctl.host, "port": ctl.port} for d in self._verbs.devices]
            for r in regions:
                r["rdma"] = self._rdma_keys.get(r["id"], {})
        else:
            nics = [{"name": lst.host, "host": lst.host, "port": lst.port} for lst in self._listeners]
        return {"name": self.name, "transport": self.transport, "regions": regions, "nics": nics,
                "topology": self.topology.to_dict()}

    def add_segment(self, desc: dict) -> None:
        for k in ("name", "regions", "nics", "topology"):
            if k not in desc:
                raise ValueError(f"segment descriptor lacks {k!r}")
        self._segments[desc["name"]] = desc
        self._topos[desc["name"]] = Topology(desc["topology"])

    def set_resolver(self, resolver: Resolver | None) -> None:
        self._resolver = resolver

    async def _resolve(self, name: str) -> dict:
        desc = self._segments.get(name)
        if desc is None and self._resolver is not None:
            desc = await self._resolver(name)
            if desc is not None:
                self.add_segment(desc)
        if desc is None:
            raise _RequestFailed(f"unknown segment {name!r}")
        return desc

    # -- batches ------------------------------------------------------------
    def allocate_batch(self, n: int) -> BatchId:
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        bid = self._next_batch
        self._next_batch += 1
        self._batches[bid] = _Batch(n)
        return bid

    def _batch(self, batch: BatchId) -> _Batch:
        b = self._batches.get(batch)
        if b is None:
            raise KeyError(f"no batch {batch}")
        return b

    async def submit_transfer(self, batch: BatchId, requests: list[TransferRequest]) -> None:
        """Start ``requests`` (they run concurrently); raises ValueError for
        requests that are wrong on our side (unknown local region, out of range)."""
        if self._loop is None:
            raise RuntimeError("engine not started")
        b = self._batch(batch)
        if len(b.reqs) + len(requests) > b.capacity:
            raise ValueError(f"batch {batch} holds {b.capacity} requests; "
                             f"{len(b.reqs)} submitted, {len(requests)} more given")
        for r in requests:
            if not isinstance(r, TransferRequest):
                raise ValueError(f"expected TransferRequest, got {type(r).__name__}")
            region = self.regions.get(r.local_region)
            if region is None:
                raise ValueError(f"local_region {r.local_region} is not registered")
            if r.local_offset + r.length > region.length:
                raise ValueError(f"local range [{r.local_offset}, +{r.length}) exceeds region "
                                 f"{r.local_region} of {region.length} bytes")
        for r in requests:
            st = _Req(r)
            st.task = asyncio.create_task(self._run_request(st))
            b.reqs.append(st)

    def transfer_status(self, batch: BatchId, i: int) -> TransferStatus:
        b = self._batch(batch)
        if not 0 <= i < len(b.reqs):
            raise IndexError(f"batch {batch} has {len(b.reqs)} submitted requests, no #{i}")
        return b.reqs[i].status()

    async def wait(self, batch: BatchId, timeout: float | None = None) -> list[TransferStatus]:
        """Wait until every submitted request of ``batch`` ended (or ``timeout``)."""
        b = self._batch(batch)
        tasks = [r.task for r in b.reqs if r.task is not None and not r.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        return [r.status() for r in b.reqs]

    def free_batch(self, batch: BatchId) -> None:
        b = self._batch(batch)
        if any(not r.state.done for r in b.reqs):
            raise RuntimeError(f"batch {batch} still has transfers in flight")
        del self._batches[batch]

    async def transfer(self, requests: list[TransferRequest]) -> None:
        """Run ``requests`` to completion; raise TransferError naming the first failure."""
        if not requests:
            return
        bid = self.allocate_batch(len(requests))
        try:
            await self.submit_transfer(bid, requests)
            statuses = await self.wait(bid)
        except BaseException:
            for r in self._batches[bid].reqs:
                if r.task is not None:
                    r.task.cancel()
            raise
        finally:
            if all(r.state.done for r in self._batches[bid].reqs):
                del self._batches[bid]
        bad = [(i, s) for i, s in enumerate(statuses) if s.state != TransferState.COMPLETED]
        if bad:
            i, s = bad[0]
            raise TransferError(f"request {i}: {s.state.value}: {s.reason} "
                                f"({len(bad)} of {len(statuses)} requests did not complete)", statuses)

    # -- request execution -------------------------------------------------
    async def _run_request(self, st: _Req) -> None:
        req = st.request
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                desc = await self._resolve(req.target_segment)
                regions = {r["id"]: r for r in desc["regions"]}
                rreg = regions.get(req.target_region)
                if rreg is None:
                    raise _RequestFailed(f"segment {req.target_segment!r} has no region {req.target_region}")
                if req.target_offset + req.length > rreg["length"]:
                    raise _RequestFailed(f"target range [{req.target_offset}, +{req.length}) exceeds region "
                                         f"{req.target_region} of {rreg['length']} bytes")
                if req.length:
                    local = self.regions.get(req.local_region)
                    if local is None:
                        raise _RequestFailed(f"local region {req.local_region} was unregistered")
                    primary, fallback = slicing.plan_paths(self.topology, local.location,
                                                           self._topos[desc["name"]], rreg["location"])
                    st.state = TransferState.PENDING
                    parts = slicing.cut(req.local_offset, req.target_offset, req.length, self.slice_bytes)
                    try:
                        async with asyncio.TaskGroup() as tg:
                            for s in parts:
                                tg.create_task(self._run_slice(st, desc, local, s, primary, fallback))
                    except ExceptionGroup as eg:
                        # The first failing slice cancelled its siblings; report it.
                        first = next((e for e in eg.exceptions if isinstance(e, _RequestFailed)), None)
                        if first is None:
                            raise
                        raise first from None
            st.state = TransferState.COMPLETED
        except TimeoutError:
            st.state = TransferState.TIMEOUT
            st.reason = (f"not done after request_timeout_s={self.config.request_timeout_s}s "
                         f"({st.transferred} of {req.length} bytes moved)")
        except _RequestFailed as e:
            st.state = TransferState.FAILED
            st.reason = str(e)
        except asyncio.CancelledError:
            st.state = TransferState.FAILED
            st.reason = "cancelled"
            raise

    async def _run_slice(self, st: _Req, desc: dict, local: Region, s: slicing.Slice,
                         primary: list[Path], fallback: list[Path]) -> None:
        seg = desc["name"]
        req = st.request
        view = local.view[s.local_offset:s.local_offset + s.length]
        last, avoid = "no usable path", None
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                self.retries += 1
            path = self.paths.choose(seg, primary, fallback, avoid)
            if path is None:
                # Every path is backing off: wait for the first to reopen
                # (the request deadline still bounds the total wait).
                delay = self.paths.next_usable_at(seg, primary + fallback) - time.monotonic()
                await asyncio.sleep(max(delay, 0.005))
                path = self.paths.choose(seg, primary, fallback, avoid)
                if path is None:
                    continue
            probe = self.paths.is_probe(seg, path)
            slots = self._slots.get((seg, path))
            if slots is None:
                slots = self._slots[(seg, path)] = asyncio.Semaphore(
                    self.config.connections_per_peer * self.config.max_inflight_per_endpoint)
            self.paths.add_inflight(seg, path, s.length)
            fut = ep = None
            try:
                async with slots:
                    if not probe and not self.paths.usable(seg, path, time.monotonic()):
                        # The path failed while we queued for it: go elsewhere.
                        raise EndpointError(self.paths.health[(seg, path)].last_reason or "path backing off")
                    ep = await self._endpoint(seg, desc, path)
                    fut = ep.post(req.op, req.target_region, s.remote_offset, view, local.id, s.local_offset)
                    await fut
            except EndpointError as e:
                last, avoid = str(e), path
                continue
            except asyncio.CancelledError:
                self.paths.release_probe(seg, path)
                if fut is not None and not fut.done() and ep is not None:
                    # Never let bytes of a finished (timed-out) request land later.
                    ep.abort("request cancelled or timed out", penalize=False)
                raise
            finally:
                self.paths.add_inflight(seg, path, -s.length)
            self.paths.success(seg, path)
            self.nic_bytes[path[0]] = self.nic_bytes.get(path[0], 0) + s.length
            pk = f"{path[0]}->{path[1]}"
            self.path_bytes[pk] = self.path_bytes.get(pk, 0) + s.length
            st.transferred += s.length
            return
        raise _RequestFailed(f"slice at offset {s.remote_offset - req.target_offset} failed "
                             f"{self.config.max_retries + 1} times; last error: {last}")

    # -- endpoints -------------------------------------------------------------
    async def _endpoint(self, seg: str, desc: dict, path: Path) -> Endpoint:
        """Least-busy live connection of ``path``; opens another one (up to
        connections_per_peer) when all existing ones are busy."""
        best: Endpoint | None = None
        free_idx = None
        for idx in range(self.config.connections_per_peer):
            key = (seg, path, idx)
            ep = self._pool.get(key)
            if ep is None or ep.failed is not None:
                if ep is not None:
                    self._pool.remove(key)
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
        return await self._connect((seg, path, free_idx), desc, path)

    async def _connect(self, key: EpKey, desc: dict, path: Path) -> Endpoint:
        fut = self._connecting.get(key)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = self._loop.create_future()
        self._connecting[key] = fut
        try:
            nic = next((n for n in desc["nics"] if n["name"] == path[1]), None)
            if nic is None:
                raise EndpointError(f"segment {desc['name']!r} has no nic {path[1]!r}")
            ep: Endpoint
            if self._verbs is not None:
                if desc.get("transport") != "rdma":
                    raise EndpointError(f"segment {desc['name']!r} speaks {desc.get('transport')}, not rdma")
                ep = RdmaEndpoint(self._loop, self._verbs, path[0], path[1], nic["host"], nic["port"],
                                  self.config.auth_token, desc, self.config.user_timeout_ms,
                                  self.config.connect_timeout_s, on_fail=self._endpoint_failed)
            else:
                ep = TcpEndpoint(self._loop, path[0], nic["host"], nic["port"], self.config.auth_token,
                                 desc["name"], self.config.user_timeout_ms, self.config.connect_timeout_s,
                                 on_fail=self._endpoint_failed)
            ep.pool_key = key  # type: ignore[attr-defined]
            try:
                await ep.connect()
            except EndpointError as e:
                self.path_failures += 1
                self.paths.failure(key[0], path, str(e))
                if self._resolver is not None:
                    # The peer may have restarted elsewhere; look it up again next time.
                    self._segments.pop(key[0], None)
                raise
            self._pool.put(key, ep)
            fut.set_result(ep)
            return ep
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # mark retrieved; waiters re-raise it
            raise
        finally:
            del self._connecting[key]

    def _endpoint_failed(self, ep: Endpoint, reason: str, penalize: bool = True) -> None:
        key = ep.pool_key  # type: ignore[attr-defined]
        if self._pool.get(key) is ep:
            self._pool.remove(key)
        if penalize:
            self.path_failures += 1
            self.paths.failure(key[0], key[1], reason)
            log.warning("endpoint %s -> %s failed: %s", key[1][0], key[1][1], reason)

    def _evicted(self, key: EpKey, ep: Endpoint) -> None:
        ep.retire()

    async def _watch(self) -> None:
        """Declare endpoints dead when they have work but make no progress."""
        period = min(self.config.stall_timeout_s / 4, 0.5)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for ep in self._pool.values():
                if ep.pending and now - ep.last_progress > self.config.stall_timeout_s:
                    ep.abort(f"no progress for stall_timeout_s={self.config.stall_timeout_s}s")

    def stats(self) -> dict:
        return {
            "transport": self.transport,
            "nic_bytes": dict(self.nic_bytes),
            "path_bytes": dict(self.path_bytes),
            "endpoints": len(self._pool),
            "evictions": self._pool.evictions,
            "retries": self.retries,
            "path_failures": self.path_failures,
            "refused_connections": sum(lst.refused for lst in self._listeners),
        }
