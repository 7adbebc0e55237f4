"""Running one transfer request: check the target, cut it into slices, post each with retries across paths."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from . import slices as slicing
from .config import TransferConfig
from .connections import Connections
from .descriptors import SegmentDescriptor
from .directory import SegmentDirectory
from .endpoint import Endpoint, EndpointError, WriteRefused
from .local_segment import LocalSegment
from .slices import Path
from .topology import Topology
from .types import Region, TransferRequest, TransferState, TransferStatus


class RequestFailed(Exception):
    """The request cannot complete; the message becomes its ``reason``."""


class _PathLost(Exception):
    """The path failed while the slice queued for it; nothing was posted."""


@dataclass
class RequestState:
    request: TransferRequest
    state: TransferState = TransferState.WAITING
    reason: str = ""
    transferred: int = 0
    task: asyncio.Task | None = None

    def status(self) -> TransferStatus:
        return TransferStatus(self.state, self.reason, self.transferred)


class RequestRunner:
    """Drives requests to an end state and counts what moved where.

    A request is COMPLETED when all its slices are; FAILED when its target
    cannot be resolved or checked, when the target's write guard refuses a
    slice (at once: a refusal is an answer, not a failure to retry), or when
    a slice runs out of retries (``max_retries`` re-posts after a failed
    post, each on another path when one is usable); TIMEOUT when
    ``request_timeout_s`` passes first. Waiting
    for a path to reopen spends no attempt: only the deadline bounds it.
    """

    def __init__(self, config: TransferConfig, local: LocalSegment, directory: SegmentDirectory,
                 connections: Connections) -> None:
        self.config = config
        self.local = local
        self.directory = directory
        self.connections = connections
        self.slice_bytes = 0
        self.nic_bytes: dict[str, int] = {n: 0 for n in config.nics}
        self.path_bytes: dict[str, int] = {}  # "local nic->remote nic" -> bytes
        self.retries = 0

    def start(self) -> None:
        """Size slices and name NICs for the transport the local segment chose."""
        self.slice_bytes = self.config.effective_slice_bytes(self.local.transport)
        self.nic_bytes = {n: 0 for n in self.local.nic_names}

    async def run(self, st: RequestState) -> None:
        req = st.request
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                desc = await self._resolve(req)
                try:
                    await self._move(st, desc)
                except RequestFailed:
                    # A peer that restarted (same name, new listen ports)
                    # refuses every connect to its stale descriptor, and a
                    # failed connect drops that descriptor (connections.py).
                    # When nothing got through, look it up again and run the
                    # request once more (re-posting a range is idempotent).
                    fresh = None if st.transferred else await self._resolve(req)
                    if fresh is None or fresh == desc:
                        raise
                    # The back-off its old address earned must not hold up
                    # the first requests to where it is now.
                    self.connections.paths.forget_segment(req.target_segment)
                    await self._move(st, fresh)
            st.state = TransferState.COMPLETED
        except TimeoutError:
            st.state = TransferState.TIMEOUT
            st.reason = (f"not done after request_timeout_s={self.config.request_timeout_s}s "
                         f"({st.transferred} of {req.length} bytes moved)")
        except RequestFailed as e:
            st.state = TransferState.FAILED
            st.reason = str(e)
        except asyncio.CancelledError:
            st.state = TransferState.FAILED
            st.reason = "cancelled"
            raise

    async def _resolve(self, req: TransferRequest) -> SegmentDescriptor:
        try:
            desc = await self.directory.resolve(req.target_segment)
        except Exception as e:  # not BaseException: cancellation and the deadline go through
            raise RequestFailed(f"cannot resolve segment {req.target_segment!r}: "
                                f"{type(e).__name__}: {e}") from e
        if desc is None:
            raise RequestFailed(f"unknown segment {req.target_segment!r}")
        return desc

    async def _move(self, st: RequestState, desc: SegmentDescriptor) -> None:
        """Check ``st``'s request against ``desc`` and post all its slices."""
        req = st.request
        rreg = desc.region(req.target_region)
        if rreg is None:
            raise RequestFailed(f"segment {req.target_segment!r} has no region {req.target_region}")
        if req.target_offset + req.length > rreg.length:
            raise RequestFailed(f"target range [{req.target_offset}, +{req.length}) exceeds region "
                                f"{req.target_region} of {rreg.length} bytes")
        if not req.length:
            return
        local = self.local.regions.get(req.local_region)
        if local is None:
            raise RequestFailed(f"local region {req.local_region} was unregistered")
        primary, fallback = slicing.plan_paths(self.local.topology, local.location,
                                               Topology(desc.topology), rreg.location)
        if not primary and not fallback:
            raise RequestFailed(f"no path from our nics to segment {req.target_segment!r}: its "
                                f"topology names no nic for {rreg.location!r}")
        st.state = TransferState.PENDING
        parts = slicing.cut(req.local_offset, req.target_offset, req.length, self.slice_bytes)
        # Not an asyncio.TaskGroup: on Python 3.11 a group whose child fails
        # while the group waits cancels this task and never takes that cancel
        # back (Task.uncancel), so the next group or deadline in this task
        # ends at once, "cancelled" (the retry in ``run`` is one).
        slices = [asyncio.ensure_future(self._run_slice(st, desc, local, s, primary, fallback))
                  for s in parts]
        try:
            await asyncio.wait(slices, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            # The first failing slice ends its siblings (as does our own cancel).
            for task in slices:
                task.cancel()
            await asyncio.wait(slices)
        failed = [t.exception() for t in slices if not t.cancelled() and t.exception() is not None]
        if failed:
            first = next((e for e in failed if isinstance(e, RequestFailed)), failed[0])
            raise first
        # A slice task that ended cancelled (not by us) is no error of its
        # own: COMPLETED only when every byte was acknowledged.
        if st.transferred < req.length:
            raise RequestFailed(f"{req.length - st.transferred} of {req.length} bytes were not "
                                f"acknowledged (a slice was cancelled)")

    async def _run_slice(self, st: RequestState, desc: SegmentDescriptor, local: Region, s: slicing.Slice,
                         primary: list[Path], fallback: list[Path]) -> None:
        """Post ``s`` until it is acknowledged or ``max_retries`` re-posts failed
        too. Only a failed post spends an attempt: waiting for a path (every one
        is backing off, or being probed by another slice) does not, and the
        request's deadline (the ``asyncio.timeout`` in ``run``) bounds it."""
        seg = desc.name
        paths = self.connections.paths
        failures, repost, last, avoid = 0, False, "no usable path", None
        while True:
            path = paths.choose(seg, primary, fallback, avoid)
            if path is None:
                await paths.wait_usable(seg, primary + fallback)
                continue
            if repost:
                self.retries += 1
                repost = False
            try:
                await self._post(st, desc, local, s, path)
            except WriteRefused as e:
                raise RequestFailed(str(e)) from None
            except _PathLost as e:
                last, avoid = str(e), path
                continue
            except EndpointError as e:
                last, avoid = str(e), path
                failures += 1
                if not self.directory.holds(desc) and await self._resolve(st.request) != desc:
                    # A failed connect dropped the descriptor and a fresh lookup
                    # names another: the peer restarted on new ports.  Posting to
                    # the old address again would only climb the path's back-off;
                    # ``run`` starts over with the new descriptor.  The same
                    # descriptor again (now held once more) means the peer is
                    # where it was and the connect failed on the way (a SYN lost
                    # under packet loss): retried below like any failed post.
                    raise RequestFailed(f"segment {seg!r} is no longer at the address "
                                        f"its descriptor names: {last}") from None
                if failures > self.config.max_retries:
                    raise RequestFailed(f"slice at offset {s.remote_offset - st.request.target_offset} failed "
                                        f"{failures} times; last error: {last}") from None
                repost = True
                continue
            self.nic_bytes[path[0]] = self.nic_bytes.get(path[0], 0) + s.length
            pk = f"{path[0]}->{path[1]}"
            self.path_bytes[pk] = self.path_bytes.get(pk, 0) + s.length
            st.transferred += s.length
            return

    async def _post(self, st: RequestState, desc: SegmentDescriptor, local: Region, s: slicing.Slice,
                    path: Path) -> None:
        """Post ``s`` on ``path`` (queueing for one of its slots) and await the
        acknowledgement; EndpointError if the post failed, _PathLost if the
        path failed before the slice got a slot."""
        seg, req = desc.name, st.request
        paths = self.connections.paths
        probe = paths.is_probe(seg, path)
        slots = self.connections.slots(seg, path)
        paths.add_inflight(seg, path, s.length)
        fut: asyncio.Future | None = None
        ep: Endpoint | None = None
        answered = False
        try:
            async with slots:
                if not probe and not paths.usable(seg, path, time.monotonic()):
                    raise _PathLost(paths.health[(seg, path)].last_reason or "path backing off")
                ep = await self.connections.endpoint(desc, path)
                view = local.view[s.local_offset:s.local_offset + s.length]
                fut = ep.post(req.op, req.target_region, s.remote_offset, view, local.id, s.local_offset,
                              req.capability)
                await fut
            answered = True
        except WriteRefused:
            answered = True
            paths.success(seg, path)  # the path carried the frame and its answer: it works
            raise
        except asyncio.CancelledError:
            if fut is not None and not fut.done() and ep is not None:
                # Never let bytes of a finished (timed-out) request land later.
                ep.abort("request cancelled or timed out", penalize=False)
            raise
        finally:
            paths.add_inflight(seg, path, -s.length)
            if probe and not answered:
                # A failure charged to the path already ended the probe; any
                # other end (cancelled, an abort not charged) must, or no slice
                # would ever try the path again.
                paths.release_probe(seg, path)
        paths.success(seg, path)
