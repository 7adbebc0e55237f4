"""The prefill queue: requests wait here, then run in steps.

A step is either one long request (its chunks keep the compute thread busy;
a CPP request drives its whole group) or a batch of short ones: queued
requests whose prompts fit in ``prefill_chunk`` tokens are taken together,
up to ``batch_tokens`` tokens, and computed in one forward pass (each still
attends only to its own pages).  KV streaming, peer fetches and HTTP stay on
the event loop meanwhile.  Every request of a batched pass waits for the
whole pass, so a request joins only while the pass, as the conductor
predicted its members' compute, still ends before every earlier member's
reply is due (``PrefillRequest.budget``): a batch then spends the slack the
predictions held, and delays a first token past its prediction only as far
as the predicted compute of the pass falls short of the real one.  The
queue's estimated work (tokens still to compute / measured tokens per
second) is what the node reports to the conductor as its queued prefill
time.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from mooncaked.node.messages import NodeLoad, PrefillReply, PrefillRequest
from mooncaked.node.tasks import cancel_and_wait
from roles.prefill.cpp_head import GroupPrefill
from roles.prefill.job import PrefillCancelled, PrefillJob
from roles.worker_node import WorkerNode

log = logging.getLogger("mooncaked.prefill")


@dataclass
class _Queued:
    job: "PrefillJob | GroupPrefill"
    tokens: int
    enqueued_at: float
    queue_s: float = 0.0
    started_at: float | None = None  # perf_counter() when its step began
    # perf_counter() by which its reply is due for the conductor's predicted
    # TTFT to hold, and the compute the conductor predicted for it (inf and
    # None: no prediction came with it).
    reply_due: float = math.inf
    predicted_s: float | None = None
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class QueueFull(Exception):
    pass


class PrefillService:
    def __init__(self, worker: WorkerNode, chunk_size: int, max_queue: int, fetch_timeout_s: float,
                 prefix_cache: bool = True, cpp_timeout_s: float = 60.0,
                 batch_tokens: int = 512, batch_within_predictions: bool = True) -> None:
        self.worker = worker
        self.chunk_size = chunk_size
        self.max_queue = max_queue
        self.fetch_timeout_s = fetch_timeout_s
        self.prefix_cache = prefix_cache
        self.cpp_timeout_s = cpp_timeout_s
        self.batch_tokens = batch_tokens
        self.batch_within_predictions = batch_within_predictions
        self.queue: collections.deque[_Queued] = collections.deque()
        self._wake = asyncio.Event()
        self.jobs: dict[str, PrefillJob | GroupPrefill] = {}
        self.running: list[_Queued] = []
        self.batches = 0
        self.batched_requests = 0
        # Passes a queued request fitting batch_tokens did not join because the
        # pass would have ended after an earlier member's reply was due.
        self.batch_joins_declined = 0
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
        while self.queue:
            item = self.queue.popleft()
            if not item.done.done():
                item.done.set_exception(PrefillCancelled("node shutting down"))

    async def submit(self, spec: PrefillRequest) -> PrefillReply:
        if len(self.queue) >= self.max_queue:
            raise QueueFull(f"prefill queue full ({self.max_queue} requests)")
        if spec.request_id in self.jobs:
            raise ValueError(f"request {spec.request_id} is already queued here")
        if spec.stage_urls:
            if not self.worker.cpp or self.worker.first_layer != 0:
                raise ValueError("a CPP request must go to the head (stage 0) of a group")
            job: PrefillJob | GroupPrefill = GroupPrefill(
                spec, self.worker, spec.stage_urls, self.chunk_size, self.cpp_timeout_s)
        else:
            if self.worker.cpp:
                raise ValueError("this node is a pipeline stage: it only serves CPP requests")
            job = PrefillJob(spec, self.worker, self.chunk_size, self.fetch_timeout_s,
                             self.prefix_cache)
        now = time.perf_counter()
        item = _Queued(job, self._tokens_to_compute(spec), now)
        if spec.budget is not None and self.batch_within_predictions:
            item.reply_due = now + spec.budget.reply_within_s
            item.predicted_s = spec.budget.prefill_s
        self.jobs[spec.request_id] = job
        self.queued_tokens += item.tokens
        self.queue.append(item)
        self._wake.set()
        try:
            return await asyncio.shield(item.done)
        finally:
            self.jobs.pop(spec.request_id, None)

    def _tokens_to_compute(self, spec: PrefillRequest) -> int:
        """What a request adds to the queue, in the unit ``tokens_per_s``
        measures (computed tokens): the prompt less the prefix it will reuse,
        held here or planned to be pulled from a peer.  The block holding the
        last token is always recomputed (PrefillJob), so it always counts.
        Counting whole prompts made a node full of cache hits report a queue
        many times longer than its real one."""
        n = len(spec.token_ids)
        if not self.prefix_cache or spec.stage_urls:
            return n
        held = self.worker.shard.match_prefix(spec.block_keys)
        planned = spec.fetch.to_block if spec.fetch is not None else 0
        bs = self.worker.layout.block_size
        reused_blocks = min(max(held, planned), (n - 1) // bs)
        return n - reused_blocks * bs

    def cancel(self, request_id: str) -> bool:
        job = self.jobs.get(request_id)
        if job is None:
            return False
        job.cancelled = True
        return True

    def _batchable(self, item: _Queued) -> bool:
        return isinstance(item.job, PrefillJob) and item.tokens <= self.chunk_size \
            and item.job.spec.fetch is None

    def _compute_estimate_s(self, item: _Queued) -> float:
        """The compute a queued request adds to a pass: the conductor's
        prediction when it sent one, else its tokens at the measured speed."""
        if item.predicted_s is not None:
            return item.predicted_s
        return item.tokens / self.tokens_per_s

    def _next_step(self, now: float) -> list[_Queued]:
        """The head of the queue, plus the short requests right behind it when
        it is short itself.  FIFO order is kept: batching stops at the first
        request that does not fit the token budget, or whose compute would
        end the pass after a reply already in it is due (a request behind
        delays every first token of the pass; one ahead was counted in the
        prediction of the one behind it, so only the earlier members'
        deadlines bind)."""
        head = self.queue.popleft()
        step = [head]
        if self._batchable(head):
            tokens = head.tokens
            ends_at = now + self._compute_estimate_s(head)
            due = head.reply_due
            while self.queue and self._batchable(self.queue[0]) \
                    and tokens + self.queue[0].tokens <= self.batch_tokens:
                ends_with = ends_at + self._compute_estimate_s(self.queue[0])
                if ends_with > due:
                    self.batch_joins_declined += 1
                    break
                tokens += self.queue[0].tokens
                ends_at = ends_with
                item = self.queue.popleft()
                due = min(due, item.reply_due)
                step.append(item)
        return step

    async def _run(self) -> None:
        while True:
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            step = self._next_step(time.perf_counter())
            self.running = step
            try:
                if len(step) == 1:
                    await self._run_one(step[0])
                else:
                    await self._run_batch(step)
            finally:
                for item in step:
                    self.queued_tokens -= item.tokens
                self.running = []

    def _succeeded(self, item: _Queued, result: PrefillReply) -> None:
        result.timings.queue_s = item.queue_s
        if result.timings.compute_s > 0 and result.computed_tokens:
            rate = result.computed_tokens / result.timings.compute_s
            self.tokens_per_s = 0.7 * self.tokens_per_s + 0.3 * rate
        self.completed += 1
        if not item.done.done():
            item.done.set_result(result)

    def _failed(self, item: _Queued, exc: BaseException) -> None:
        self.failed += 1
        if not isinstance(exc, (PrefillCancelled, asyncio.CancelledError)):
            log.error("prefill %s failed: %s: %s", item.job.spec.request_id, type(exc).__name__, exc,
                      exc_info=exc)
        if isinstance(exc, asyncio.CancelledError):
            exc = PrefillCancelled("node shutting down")
        if not item.done.done():
            item.done.set_exception(exc)

    @staticmethod
    def _start(item: _Queued) -> None:
        item.started_at = time.perf_counter()
        item.queue_s = item.started_at - item.enqueued_at

    async def _run_one(self, item: _Queued) -> None:
        self._start(item)
        try:
            if item.job.cancelled:
                raise PrefillCancelled("cancelled while queued")
            self._succeeded(item, await item.job.run())
        except asyncio.CancelledError as exc:
            self._failed(item, exc)
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            self._failed(item, exc)

    async def _run_batch(self, step: list[_Queued]) -> None:
        """Several short requests in one forward pass (PrefillJob.prepare ->
        ModelRunner.prefill_batch -> PrefillJob.finish for each)."""
        loop = asyncio.get_running_loop()
        ready: list[_Queued] = []
        try:
            for item in step:
                self._start(item)
                try:
                    if item.job.cancelled:
                        raise PrefillCancelled("cancelled while queued")
                    await item.job.prepare()
                    ready.append(item)
                except Exception as exc:  # noqa: BLE001 - this request only
                    self._failed(item, exc)
            if not ready:
                return
            jobs = [item.job for item in ready]
            # A cancelled request's result is dropped at finish(); it must not
            # abort the pass that its neighbours share.
            hooks = [job.layer_hook(loop, abort_on_cancel=False) for job in jobs]
            requests = [(job.spec.token_ids, job.table, job.cached) for job in jobs]

            def compute():
                # The logits and the pass's own wall and CPU time, timed on
                # the thread: not its wait for the thread or for the loop,
                # nor what the thread ran before or after the pass.
                t0, c0 = time.perf_counter(), self.worker.compute_cpu_s()
                logits = self.worker.runner.prefill_batch(
                    requests, layer_hook=lambda i, start, end, layer: hooks[i](start, end, layer),
                    yield_point=self.worker.give_way)
                return logits, time.perf_counter() - t0, self.worker.compute_cpu_s() - c0

            t_compute = time.perf_counter()
            steps_s = self.worker.steps.between_layers_s
            cpu0 = self.worker.compute_cpu_s()
            for job in jobs:
                job.cpu_at_start = cpu0
            try:
                all_logits, pass_s, compute_cpu_s = await self.worker.compute(compute)
            except Exception as exc:  # noqa: BLE001 - the whole pass failed
                for item in ready:
                    self._failed(item, exc)
                return
            wall_s = time.perf_counter() - t_compute
            # The pass's own time: less the decode steps it gave way to.
            stepped_s = self.worker.steps.between_layers_s - steps_s
            compute_s = pass_s - stepped_s
            self.batches += 1
            self.batched_requests += len(ready)
            computed = [len(job.spec.token_ids) - job.cached for job in jobs]
            tokens = max(1, sum(computed))

            async def finish(item: _Queued, job: PrefillJob, logits: Any, own: int,
                             ahead: int) -> None:
                try:
                    # Each request is charged its share of the pass, and told
                    # the part spent on the requests ahead of it in the pass:
                    # its first token waited for the whole pass, and the
                    # conductor, which counted their work in its queue, must
                    # not take that part for a delay it failed to see.
                    job.result.timings.compute_cpu_s = compute_cpu_s * own / tokens
                    job.result.timings.batched_ahead_s = compute_s * ahead / tokens
                    # ... and the part spent on those behind it, which
                    # joined the pass while it waited: the conductor
                    # learns how much of that a queued request meets.
                    job.result.timings.batched_behind_s = \
                        compute_s * max(0, tokens - ahead - own) / tokens
                    job.result.timings.gave_way_s = stepped_s
                    job.result.timings.thread_wait_s = max(0.0, wall_s - pass_s)
                    self._succeeded(item, await job.finish(logits, t_compute,
                                                           compute_s * own / tokens))
                except Exception as exc:  # noqa: BLE001 - this request only
                    self._failed(item, exc)

            # Side by side: each reply goes out once its own KV sends are
            # done, not after those of the requests ahead of it in the batch.
            aheads = [0, *itertools.accumulate(computed)][:-1]
            await asyncio.gather(*(finish(item, job, logits, own, ahead)
                                   for item, job, logits, own, ahead
                                   in zip(ready, jobs, all_logits, computed, aheads)))
        except asyncio.CancelledError as exc:
            for item in step:
                self._failed(item, exc)
            raise
        finally:
            for item in step:
                if isinstance(item.job, PrefillJob):
                    await item.job.cleanup()

    def _running_shares(self) -> dict[str, float]:
        """Each running request's share of the step it runs in, by tokens to
        compute: how a batched pass's time and CPU are charged to its
        requests (as their replies' compute_s and compute_cpu_s are)."""
        tokens = {item.job.spec.request_id: max(1, len(item.job.spec.token_ids)
                                                - getattr(item.job, "cached", 0))
                  for item in self.running}
        total = sum(tokens.values())
        return {rid: n / total for rid, n in tokens.items()}

    def _running_cpu_s(self, shares: dict[str, float]) -> dict[str, float]:
        """CPU seconds of compute spent on each running request (a batched
        pass: each its share)."""
        jobs = [item.job for item in self.running if isinstance(item.job, PrefillJob)
                and item.job.cpu_at_start is not None]
        if not jobs:
            return {}
        now = self.worker.compute_cpu_s()
        return {job.spec.request_id: round(max(0.0, now - job.cpu_at_start)
                                           * shares[job.spec.request_id], 6)
                for job in jobs}

    def load(self) -> NodeLoad:
        """The prefill part of the node's load report."""
        now = time.perf_counter()
        shares = self._running_shares()
        return NodeLoad(
            queue_len=len(self.queue) + len(self.running),
            batches=self.batches, batched_requests=self.batched_requests,
            batch_joins_declined=self.batch_joins_declined,
            queued_tokens=self.queued_tokens,
            queued_prefill_s=self.queued_tokens / self.tokens_per_s,
            prefill_tokens_per_s=round(self.tokens_per_s, 1),
            # What queued_prefill_s holds, so the conductor knows which of
            # its bookings this figure covers.
            request_ids=[item.job.spec.request_id for item in (*self.running, *self.queue)],
            # How long each running request has been computing: the
            # conductor's estimate of it is that much spent already (a
            # report naming it must not restart its whole estimate).  In
            # a batched pass each is charged its share of the time, so
            # that what is left of the pass is counted once, not less
            # once per request in it.
            running_s={item.job.spec.request_id:
                       round((now - item.started_at) * shares[item.job.spec.request_id], 6)
                       for item in self.running if item.started_at is not None},
            # ... and the CPU seconds the compute thread has spent on it:
            # on cores another role has first call on (prefill.yields_to)
            # that, not the time, is how far it has got.
            running_cpu_s=self._running_cpu_s(shares),
            completed=self.completed, failed=self.failed)
