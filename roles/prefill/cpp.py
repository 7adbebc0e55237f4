"""Chunked Pipeline Parallelism (CPP): one prefill across a group of prefill nodes.

A group of X prefill nodes splits the model's layers into X contiguous stages;
each stage loads only its layers' weights and keeps only its layers of every
KV page (block keys are the same on every stage).  A request's uncached
suffix is cut into chunks; chunk i runs on stage s while chunk i+1 runs on
stage s-1.  Hidden states cross each stage boundary once per chunk through
the transfer engine (a WRITE into the next stage's activation slot, then a
small HTTP notice), overlapped with the next chunk's compute.  Every stage
streams its own layers' KV to the decode node as in the single-node workflow.

Stage 0 (the head) takes the request from the conductor through its prefill
queue and drives the others:

  POST /internal/cpp/prepare  {request_id, token_ids, block_keys, sampling, decode, max_prefix_blocks}
        the stage pins up to max_prefix_blocks of its cached prefix and takes an
        activation slot -> {prefix_blocks, act: {segment, region, offset}}
  POST /internal/cpp/start    {request_id, prefix_blocks, next: hop | null}
        long call: compute each chunk as it arrives, forward hidden states to
        `next`, stream KV; answered at the end (the last stage with the first token)
  POST /internal/cpp/chunk    {request_id, start, n}   (from the previous stage)
        copy the chunk out of the input slot and queue it; the answer frees the slot
  POST /internal/cpp/abort    {request_id}

The prefix used is the shortest one every stage still holds (stages evict
independently).  Every page pinned or allocated, and every activation slot,
is released on every path out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, TypeVar

import torch
from aiohttp import web

from model.runner import chunk_bounds
from model.sampling import sample
from mooncaked.node.errors import ApiError
from mooncaked.node.internal_client import (CONTROL_TIMEOUT_S, CPP_PREPARE_TIMEOUT_S, UNBOUNDED,
                                            InternalCallError, InternalClient, read_message, reply)
from mooncaked.node.messages import (Aborted, ActivationSlot, CppChunk, CppHop, CppPrepare,
                                     CppPrepared, CppStageReport, CppStart, CppSummary, Message,
                                     Ok, PrefillReply, PrefillRequest, RequestRef, Route)
from rdma.types import TransferOp, TransferRequest
from roles.prefill.job import PrefillCancelled, PrefillFailed, PrefillJob

log = logging.getLogger("mooncaked.cpp")
T = TypeVar("T")


class StageRun:
    """One request on one stage of a group (the head included)."""

    def __init__(self, worker, spec: PrefillRequest, chunk_size: int, timeout_s: float,
                 is_last: bool) -> None:
        if not worker.act_free:
            raise ApiError(503, "no free pipeline activation slot on this stage")
        self.worker = worker
        self.spec = spec
        self.job = PrefillJob(spec, worker, chunk_size, timeout_s)
        self.timeout_s = timeout_s
        self.is_last = is_last
        self.slot = worker.act_free.pop()
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.prefix_blocks = 0
        self.started = False
        self.boundary_bytes = 0
        self.closed = False

    # -- activation slots: [in, out] per slot index ---------------------------
    def slot_offset(self, which: int) -> int:
        return (2 * self.slot + which) * self.worker.act_slot_bytes

    @property
    def cancelled(self) -> bool:
        return self.job.cancelled

    def cancel(self) -> None:
        self.job.cancelled = True
        self.inbox.put_nowait(None)

    # -- prefix agreement -----------------------------------------------------
    def prepare(self, max_blocks: int) -> int:
        spec, shard, bs = self.spec, self.worker.shard, self.worker.layout.block_size
        limit = min(max_blocks, (len(spec.token_ids) - 1) // bs)
        pages = shard.acquire_prefix(spec.block_keys[:limit], spec.token_ids) if limit else []
        self.job.pinned_keys = list(spec.block_keys[:len(pages)])
        self.prefix_pages = pages
        self.prefix_blocks = len(pages)
        return len(pages)

    def trim(self, blocks: int) -> None:
        if blocks < self.prefix_blocks:
            self.worker.shard.release(self.job.pinned_keys[blocks:])
            del self.job.pinned_keys[blocks:]
            self.prefix_pages = self.prefix_pages[:blocks]
            self.prefix_blocks = blocks

    # -- data path --------------------------------------------------------------
    def receive(self, start: int, n: int) -> None:
        """The previous stage WROTE a chunk into our input slot: copy it out."""
        hidden = self.worker.runner.config.hidden_size
        dtype = self.worker.runner.weights.dtype
        if n * hidden * (torch.finfo(dtype).bits // 8) > self.worker.act_slot_bytes:
            raise ApiError(400, "chunk larger than an activation slot")
        x = torch.frombuffer(self.worker.act_memory, dtype=dtype, count=n * hidden,
                             offset=self.slot_offset(0)).clone().view(n, hidden)
        self.inbox.put_nowait((start, x))

    async def _forward(self, hop: CppHop, start: int, x: torch.Tensor) -> None:
        worker = self.worker
        nbytes = x.numel() * x.element_size()
        out = torch.frombuffer(worker.act_memory, dtype=x.dtype, count=x.numel(),
                               offset=self.slot_offset(1))
        out.copy_(x.reshape(-1))
        await worker.engine.transfer([TransferRequest(
            TransferOp.WRITE, worker.act_region_id, self.slot_offset(1), nbytes,
            hop.segment, hop.offset, hop.region)])
        try:
            await self.job.client.send(
                hop.url + Route.CPP_CHUNK,
                CppChunk(request_id=self.spec.request_id, start=start, n=x.shape[0]),
                what=f"chunk at {start} to the next stage", timeout=self.timeout_s)
        except InternalCallError as exc:
            raise PrefillFailed(str(exc)) from None
        self.boundary_bytes += nbytes

    async def run(self, next_hop: CppHop | None) -> CppStageReport:
        """Compute every chunk through this stage; returns this stage's report."""
        self.started = True
        worker, spec, job = self.worker, self.spec, self.job
        shard, bs = worker.shard, worker.layout.block_size
        loop = asyncio.get_running_loop()
        n = len(spec.token_ids)
        cached = self.prefix_blocks * bs
        new_pages = shard.allocate(-(-n // bs) - self.prefix_blocks)
        job.private_pages += new_pages
        table = job.table = self.prefix_pages + new_pages
        job.send_blocks(table, 0, self.prefix_blocks, None)
        layer_hook = job.layer_hook(loop)

        def stage(inputs: Any, start: int) -> torch.Tensor:
            return worker.runner.prefill_stage(inputs, table, start, layer_hook=layer_hook)

        forwards: list[asyncio.Task] = []
        last_out = None
        t0 = time.perf_counter()
        compute_s = 0.0
        for start, end in chunk_bounds(cached, n, job.chunk_size):
            if worker.first_layer == 0:
                inputs: Any = spec.token_ids[start:end]
            else:
                item = await asyncio.wait_for(self.inbox.get(), self.timeout_s)
                if item is None:
                    raise PrefillCancelled("aborted by the head")
                got_start, inputs = item
                if got_start != start:
                    raise PrefillFailed(f"chunk at {got_start} arrived, expected {start}")
            t = time.perf_counter()
            last_out = await worker.compute(stage, inputs, start)
            compute_s += time.perf_counter() - t
            if next_hop is not None:
                # Forwards run in order (each waits for the one before), overlapped
                # with this stage's next chunk.
                prev = forwards[-1] if forwards else None
                forwards.append(asyncio.ensure_future(self._chain(prev, next_hop, start, last_out)))
        if forwards:
            await asyncio.gather(*forwards)
        stage_s = time.perf_counter() - t0
        token = logprob = None
        if self.is_last:
            token, logprob = sample(last_out, spec.sampling, spec.sampling.make_generator())
        report = CppStageReport(stage_compute_s=compute_s, stage_s=stage_s,
                                boundary_bytes=self.boundary_bytes,
                                layers=[worker.first_layer, worker.end_layer],
                                first_token=token, logprob=logprob)
        if job.prefix_cache:
            job.publish_new_blocks(table, self.prefix_blocks)
        await asyncio.gather(*job.sends)
        return report

    async def _chain(self, prev: asyncio.Task | None, hop: CppHop, start: int,
                     x: torch.Tensor) -> None:
        if prev is not None:
            await prev
        await self._forward(hop, start, x)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.job.cleanup()
        self.worker.act_free.append(self.slot)


class CppStages:
    """The /internal/cpp/* endpoints of a group member, and the runs it holds."""

    def __init__(self, worker, chunk_size: int, timeout_s: float) -> None:
        self.worker = worker
        self.chunk_size = chunk_size
        self.timeout_s = timeout_s
        self.runs: dict[str, StageRun] = {}

    async def prepare(self, request: web.Request) -> web.Response:
        worker = self.worker
        spec = await read_message(request, CppPrepare, 64 << 20, block_size=worker.layout.block_size)
        if spec.request_id in self.runs:
            raise ApiError(409, f"request {spec.request_id} already prepared here")
        run = StageRun(worker, spec, self.chunk_size, self.timeout_s,
                       is_last=worker.end_layer == worker.runner.config.num_layers)
        self.runs[spec.request_id] = run
        blocks = run.prepare(spec.max_prefix_blocks)
        # A head that never calls /start (it died) must not leave pins behind.
        asyncio.get_running_loop().call_later(self.timeout_s, self._expire, spec.request_id)
        return reply(CppPrepared(prefix_blocks=blocks, act=ActivationSlot(
            segment=worker.engine.name, region=worker.act_region_id, offset=run.slot_offset(0))))

    def _expire(self, request_id: str) -> None:
        run = self.runs.get(request_id)
        if run is not None and not run.started:
            log.warning("cpp request %s prepared but never started: releasing", request_id)
            self.runs.pop(request_id, None)
            asyncio.ensure_future(run.close())

    async def start(self, request: web.Request) -> web.Response:
        req = await read_message(request, CppStart, 1 << 20)
        run = self.runs.get(req.request_id)
        if run is None:
            raise ApiError(404, "no prepared cpp request with that id")
        try:
            run.trim(req.prefix_blocks)
            report = await run.run(req.next)
        except PrefillCancelled as exc:
            raise ApiError(409, f"cancelled: {exc}") from None
        except (PrefillFailed, asyncio.TimeoutError) as exc:
            raise ApiError(502, f"stage failed: {type(exc).__name__}: {exc}") from None
        finally:
            self.runs.pop(run.spec.request_id, None)
            await run.close()
        return reply(report)

    async def chunk(self, request: web.Request) -> web.Response:
        chunk = await read_message(request, CppChunk, 1 << 16)
        run = self.runs.get(chunk.request_id)
        if run is None:
            raise ApiError(404, "no running cpp request with that id")
        run.receive(chunk.start, chunk.n)
        return reply(Ok())

    async def abort(self, request: web.Request) -> web.Response:
        ref = await read_message(request, RequestRef, 1 << 16, "cpp.abort")
        run = self.runs.get(ref.request_id)
        if run is not None:
            run.cancel()
            if not run.started:
                self.runs.pop(run.spec.request_id, None)
                await run.close()
        return reply(Aborted(aborted=run is not None))

    async def close(self) -> None:
        for run in list(self.runs.values()):
            run.cancel()
            await run.close()
        self.runs.clear()


class GroupPrefill:
    """The head's side of one CPP request (duck-types PrefillJob for the queue)."""

    def __init__(self, spec: PrefillRequest, worker, stage_urls: list[str], chunk_size: int,
                 timeout_s: float) -> None:
        self.spec = spec
        self.worker = worker
        self.client = InternalClient(worker.http)  # the worker's session carries the cluster token
        self.stage_urls = stage_urls
        self.chunk_size = chunk_size
        self.timeout_s = timeout_s
        self._cancelled = False
        self._head: StageRun | None = None

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
            result.local_hit_tokens = final * worker.layout.block_size
            result.computed_tokens = len(spec.token_ids) - result.local_hit_tokens
            result.timings["compute_s"] = time.perf_counter() - t_compute
            if head.job.stream_log:
                result.timings["first_layer_sent_s"] = head.job.stream_log[0][2] - t_compute
            result.timings["total_s"] = time.perf_counter() - t0
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
