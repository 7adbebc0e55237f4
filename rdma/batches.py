"""The batch API's bookkeeping: batch ids, capacity, request tasks, statuses, freeing."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .execution import RequestState
from .types import BatchId, Region, TransferError, TransferRequest, TransferState, TransferStatus


@dataclass
class _Batch:
    capacity: int
    reqs: list[RequestState] = field(default_factory=list)  # in submission order: status index i


class Batches:
    """Every submitted request runs as its own task (``run``); a batch may be
    freed only once all of them ended, so a status is never lost mid-flight."""

    def __init__(self, regions: dict[int, Region], run: Callable[[RequestState], Awaitable[None]]) -> None:
        self._regions = regions  # the local segment's, to reject bad requests up front
        self._run = run
        self._batches: dict[BatchId, _Batch] = {}
        self._next_batch = 1
        self.started = False

    def __len__(self) -> int:
        """Batches in the table: allocated and not yet freed (``transfer()``'s own included)."""
        return len(self._batches)

    def allocate(self, n: int) -> BatchId:
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

    async def submit(self, batch: BatchId, requests: list[TransferRequest]) -> None:
        # All-or-nothing: every request is checked before any starts.
        if not self.started:
            raise RuntimeError("engine not started")
        b = self._batch(batch)
        if len(b.reqs) + len(requests) > b.capacity:
            raise ValueError(f"batch {batch} holds {b.capacity} requests; "
                             f"{len(b.reqs)} submitted, {len(requests)} more given")
        for r in requests:
            if not isinstance(r, TransferRequest):
                raise ValueError(f"expected TransferRequest, got {type(r).__name__}")
            region = self._regions.get(r.local_region)
            if region is None:
                raise ValueError(f"local_region {r.local_region} is not registered")
            if r.local_offset + r.length > region.length:
                raise ValueError(f"local range [{r.local_offset}, +{r.length}) exceeds region "
                                 f"{r.local_region} of {region.length} bytes")
        for r in requests:
            st = RequestState(r)
            st.task = asyncio.create_task(self._run(st))
            b.reqs.append(st)

    def status(self, batch: BatchId, i: int) -> TransferStatus:
        b = self._batch(batch)
        if not 0 <= i < len(b.reqs):
            raise IndexError(f"batch {batch} has {len(b.reqs)} submitted requests, no #{i}")
        return b.reqs[i].status()

    async def wait(self, batch: BatchId, timeout: float | None = None) -> list[TransferStatus]:
        b = self._batch(batch)
        tasks = [r.task for r in b.reqs if r.task is not None and not r.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        return [r.status() for r in b.reqs]

    def free(self, batch: BatchId) -> None:
        b = self._batch(batch)
        if any(not r.state.done for r in b.reqs):
            raise RuntimeError(f"batch {batch} still has transfers in flight")
        del self._batches[batch]

    async def transfer(self, requests: list[TransferRequest]) -> None:
        if not requests:
            return
        bid = self.allocate(len(requests))
        try:
            await self.submit(bid, requests)
            statuses = await self.wait(bid)
        except BaseException:
            for r in self._batches[bid].reqs:
                if r.task is not None:
                    r.task.cancel()
            raise
        finally:
            self._drop_when_ended(bid)
        bad = [(i, s) for i, s in enumerate(statuses) if s.state != TransferState.COMPLETED]
        if bad:
            i, s = bad[0]
            raise TransferError(f"request {i}: {s.state.value}: {s.reason} "
                                f"({len(bad)} of {len(statuses)} requests did not complete)", statuses)

    def _drop_when_ended(self, bid: BatchId) -> None:
        """Remove ``transfer()``'s own batch now, or when its last task ends:
        a task just cancelled has not ended yet, and no caller is left to free it."""
        left = [r.task for r in self._batches[bid].reqs if r.task is not None and not r.task.done()]
        if not left:
            del self._batches[bid]
            return
        pending = len(left)

        def ended(_task: asyncio.Task) -> None:
            nonlocal pending
            pending -= 1
            if not pending:
                self._batches.pop(bid, None)

        for task in left:
            task.add_done_callback(ended)

    def cancel_all(self) -> None:
        for b in self._batches.values():
            for r in b.reqs:
                if r.task is not None and not r.task.done():
                    r.task.cancel()
