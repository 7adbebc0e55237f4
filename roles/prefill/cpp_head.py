"""The head (stage 0) of a CPP group: one request's prefill across the whole group.

The head takes the request from its prefill queue and drives the other stages
(their endpoints: cpp_routes; the compute on each, its own included: cpp_stage):
  1. pin its own cached prefix, then POST /internal/cpp/prepare to every other
     stage in order, each pinning at most as many blocks as the head holds;
  2. the prefix used is the shortest one every stage still holds (stages
     evict independently): each trims to it;
  3. POST /internal/cpp/start to every other stage (long calls, in flight
     together), then compute its own layers chunk by chunk, forwarding each
     chunk's hidden states to stage 1;
  4. the last stage's report carries the first token; the reply sums the
     bytes that crossed boundaries and each stage's compute time.
Invariant: on any failure or cancellation every stage prepared so far gets an
abort, and the head's own run is closed on every path out.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, TypeVar

from mooncaked.node.internal_client import (CONTROL_TIMEOUT_S, CPP_PREPARE_TIMEOUT_S, UNBOUNDED,
                                            InternalCallError)
from mooncaked.node.messages import (CppHop, CppPrepare, CppPrepared, CppStageReport, CppStart,
                                     CppSummary, Message, PrefillReply, PrefillRequest, RequestRef,
                                     Route)
from roles.prefill.cpp_stage import StageRun
from roles.prefill.job import PrefillFailed
from roles.worker_node import WorkerNode

T = TypeVar("T")


class GroupPrefill:
    """The head's side of one CPP request (duck-types PrefillJob for the queue)."""

    def __init__(self, spec: PrefillRequest, worker: WorkerNode, stage_urls: list[str],
                 chunk_size: int, timeout_s: float) -> None:
        self.spec = spec
        self.worker = worker
        self.client = worker.client  # carries the cluster token
        self.stage_urls = stage_urls
        self.chunk_size = chunk_size
        self.timeout_s = timeout_s
        self._cancelled = False
        self._head: StageRun | None = None

    # The queue may cancel before run() has built the head's StageRun: the flag
    # is kept here and handed on once it exists.
    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @cancelled.setter
    def cancelled(self, value: bool) -> None:
        self._cancelled = value
        if value and self._head is not None:
            self._head.job.cancelled = True

    async def _call(self, url: str, message: Message, decode: Callable[[Any], T], what: str,
                    timeout: float | None) -> T:
        """A call to another stage; any failure is this prefill's failure."""
        try:
            return await self.client.call(url, message, decode, what=f"{what} on {url}",
                                          timeout=timeout)
        except InternalCallError as exc:
            raise PrefillFailed(str(exc)) from None

    async def run(self) -> PrefillReply:
        spec, worker = self.spec, self.worker
        rid = spec.request_id
        head = StageRun(worker, spec, self.chunk_size, self.timeout_s, is_last=False)
        head.job.cancelled = self._cancelled
        self._head = head
        result = PrefillReply(first_token=-1, logprob=0.0)
        t0 = time.perf_counter()
        starts: list[asyncio.Task] = []
        prepared: list[str] = []
        try:
            n0 = head.prepare(len(spec.block_keys))
            prepare = CppPrepare(request_id=rid, token_ids=spec.token_ids,
                                 block_keys=spec.block_keys, sampling=spec.sampling,
                                 decode=spec.decode, max_prefix_blocks=n0)
            preps: list[CppPrepared] = []
            for url in self.stage_urls:
                preps.append(await self._call(url + Route.CPP_PREPARE, prepare, CppPrepared.from_wire,
                                              "cpp prepare", CPP_PREPARE_TIMEOUT_S))
                prepared.append(url)
            final = min([n0] + [p.prefix_blocks for p in preps])
            head.trim(final)
            hops = [CppHop.at(u, p.act) for u, p in zip(self.stage_urls, preps)]
            for k, url in enumerate(self.stage_urls):
                nxt = hops[k + 1] if k + 1 < len(hops) else None
                starts.append(asyncio.ensure_future(self._call(
                    url + Route.CPP_START, CppStart(request_id=rid, prefix_blocks=final, next=nxt),
                    CppStageReport.from_wire, "cpp start", UNBOUNDED)))
            t_compute = time.perf_counter()
            head_report = await head.run(hops[0])
            reports: list[CppStageReport] = await asyncio.gather(*starts)
            last = reports[-1]
            if last.first_token is None:
                raise PrefillFailed(f"the last stage ({self.stage_urls[-1]}) sent no first token")
            result.first_token, result.logprob = last.first_token, last.logprob
            result.top_logprobs = last.top_logprobs
            result.local_hit_tokens = final * worker.layout.block_size
            result.computed_tokens = len(spec.token_ids) - result.local_hit_tokens
            result.timings.compute_s = time.perf_counter() - t_compute
            if head.job.stream_log:
                result.timings.first_layer_sent_s = head.job.stream_log[0][2] - t_compute
            result.timings.total_s = time.perf_counter() - t0
            every = [head_report] + reports
            result.cpp = CppSummary(stages=1 + len(self.stage_urls),
                                    boundary_bytes=sum(r.boundary_bytes for r in every),
                                    stage_compute_s=[round(r.stage_compute_s, 6) for r in every])
            return result
        except BaseException:
            for task in starts:
                task.cancel()
            for url in prepared:
                try:
                    await self.client.send(url + Route.CPP_ABORT, RequestRef(request_id=rid),
                                           what="cpp abort", timeout=CONTROL_TIMEOUT_S)
                except InternalCallError:
                    pass  # that stage is gone; its own timeouts release what it held
            await asyncio.gather(*starts, return_exceptions=True)
            raise
        finally:
            await head.close()
