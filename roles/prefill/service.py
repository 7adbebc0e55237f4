"""The prefill queue: requests wait here, then run one at a time.

One request computes at a time (its chunks keep the compute thread busy);
KV streaming, peer fetches and HTTP stay on the event loop meanwhile.  The
queue's estimated work (tokens still to compute / measured tokens per
second) is what the node reports to the conductor as its queued prefill time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from roles.prefill.cpp import GroupPrefill
from roles.prefill.job import PrefillCancelled, PrefillJob, PrefillResult, PrefillSpec
from mooncaked.tasks import cancel_and_wait

log = logging.getLogger("mooncaked.prefill")


@dataclass
class _Queued:
    job: "PrefillJob | GroupPrefill"
    tokens: int
    enqueued_at: float
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class QueueFull(Exception):
    pass


class PrefillService:
    def __init__(self, worker, chunk_size: int, max_queue: int, fetch_timeout_s: float,
                 prefix_cache: bool = True, cpp_timeout_s: float = 60.0) -> None:
        self.worker = worker
        self.chunk_size = chunk_size
        self.max_queue = max_queue
        self.fetch_timeout_s = fetch_timeout_s
        self.prefix_cache = prefix_cache
        self.cpp_timeout_s = cpp_timeout_s
        self.queue: asyncio.Queue[_Queued] = asyncio.Queue()
        self.jobs: dict[str, PrefillJob] = {}
        self.running: _Queued | None = None
        self.queued_tokens = 0
        # Measured compute speed (EWMA), seeded with a pessimistic guess.
        self.tokens_per_s = 2000.0
        self.completed = 0
        self.failed = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="prefill-queue")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if not item.done.done():
                item.done.set_exception(PrefillCancelled("node shutting down"))

    async def submit(self, spec: PrefillSpec) -> PrefillResult:
        if self.queue.qsize() >= self.max_queue:
            raise QueueFull(f"prefill queue full ({self.max_queue} requests)")
        if spec.request_id in self.jobs:
            raise ValueError(f"request {spec.request_id} is already queued here")
        if spec.cpp_stage_urls:
            if not self.worker.cpp or self.worker.first_layer != 0:
                raise ValueError("a CPP request must go to the head (stage 0) of a group")
            job: PrefillJob | GroupPrefill = GroupPrefill(
                spec, self.worker, spec.cpp_stage_urls, self.chunk_size, self.cpp_timeout_s)
        else:
            if self.worker.cpp:
                raise ValueError("this node is a pipeline stage: it only serves CPP requests")
            job = PrefillJob(spec, self.worker, self.chunk_size, self.fetch_timeout_s,
                             self.prefix_cache)
        item = _Queued(job, len(spec.token_ids), time.perf_counter())
        self.jobs[spec.request_id] = job
        self.queued_tokens += item.tokens
        await self.queue.put(item)
        try:
            return await asyncio.shield(item.done)
        finally:
            self.jobs.pop(spec.request_id, None)

    def cancel(self, request_id: str) -> bool:
        job = self.jobs.get(request_id)
        if job is None:
            return False
        job.cancelled = True
        return True

    async def _run(self) -> None:
        while True:
            item = await self.queue.get()
            self.running = item
            queued_s = time.perf_counter() - item.enqueued_at
            try:
                if item.job.cancelled:
                    raise PrefillCancelled("cancelled while queued")
                result = await item.job.run()
                result.timings["queue_s"] = queued_s
                if result.timings.get("compute_s", 0) > 0 and result.computed_tokens:
                    rate = result.computed_tokens / result.timings["compute_s"]
                    self.tokens_per_s = 0.7 * self.tokens_per_s + 0.3 * rate
                self.completed += 1
                if not item.done.done():
                    item.done.set_result(result)
            except asyncio.CancelledError:
                if not item.done.done():
                    item.done.set_exception(PrefillCancelled("node shutting down"))
                raise
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                self.failed += 1
                if not isinstance(exc, PrefillCancelled):
                    log.exception("prefill %s failed", item.job.spec.request_id)
                if not item.done.done():
                    item.done.set_exception(exc)
            finally:
                self.queued_tokens -= item.tokens
                self.running = None

    def load(self) -> dict:
        return {"queue_len": self.queue.qsize() + (1 if self.running else 0),
                "queued_tokens": self.queued_tokens,
                "queued_prefill_s": self.queued_tokens / self.tokens_per_s,
                "prefill_tokens_per_s": round(self.tokens_per_s, 1),
                "completed": self.completed, "failed": self.failed}
