"""Chunked Pipeline Parallelism (CPP): one request's compute on one stage of a group.

A group of X prefill nodes splits the model's layers into X contiguous stages;
each stage loads only its layers' weights and keeps only its layers of every
KV page (block keys are the same on every stage).  A request's uncached
suffix is cut into chunks; chunk i runs on stage s while chunk i+1 runs on
stage s-1.  Hidden states cross each stage boundary once per chunk through
the transfer engine (a WRITE into the next stage's activation slot, then a
small HTTP notice), overlapped with the next chunk's compute.  Every stage
streams its own layers' KV to the decode node as in the single-node workflow;
the last stage samples the first token.

The head coordinates the stages (cpp_head) and the others take their part
through HTTP (cpp_routes); both drive a ``StageRun``, which knows neither.
Invariant: a run's activation slot and every page it pins or allocates are
released by ``close()``, which whoever built the run calls on every path out.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from model.runner import chunk_bounds
from model.sampling import sample_top
from model.structured import GrammarMatcher
from mooncaked.node.errors import ApiError
from mooncaked.node.internal_client import InternalCallError
from mooncaked.node.messages import CppChunk, CppHop, CppStageReport, PrefillRequest, Route
from rdma.types import TransferOp, TransferRequest
from roles.prefill.job import PrefillCancelled, PrefillFailed, PrefillJob
from roles.worker_node import WorkerNode


class StageRun:
    """One request on one stage of a group (the head included)."""

    def __init__(self, worker: WorkerNode, spec: PrefillRequest, chunk_size: int, timeout_s: float,
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
        self.inbox.put_nowait(None)  # wakes a run waiting for the previous stage's chunk

    # -- prefix agreement -----------------------------------------------------
    def prepare(self, max_blocks: int) -> int:
        """Pin up to ``max_blocks`` of the locally cached prefix; returns how many."""
        spec, shard, bs = self.spec, self.worker.shard, self.worker.layout.block_size
        # At least the last prompt token is computed (it yields the logits).
        limit = min(max_blocks, (len(spec.token_ids) - 1) // bs)
        pages = shard.acquire_prefix(spec.block_keys[:limit], spec.token_ids) if limit else []
        self.job.pinned_keys = list(spec.block_keys[:len(pages)])
        self.prefix_pages = pages
        self.prefix_blocks = len(pages)
        return len(pages)

    def trim(self, blocks: int) -> None:
        """Keep only the first ``blocks`` of the pinned prefix (the group's agreed one)."""
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
        # A copy, because the slot is free again once the notice is answered.
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
        token = logprob = top = None
        if self.is_last:
            grammar = None if spec.sampling.grammar is None else \
                GrammarMatcher.for_model(spec.sampling.grammar, worker.config.model.model)
            first = sample_top(last_out, spec.sampling, spec.sampling.make_generator(),
                               prompt_ids=spec.token_ids, grammar=grammar)
            token, logprob = first.token, first.logprob
            top = list(first.top) or None
        report = CppStageReport(stage_compute_s=compute_s, stage_s=stage_s,
                                boundary_bytes=self.boundary_bytes,
                                layers=[worker.first_layer, worker.end_layer],
                                first_token=token, logprob=logprob, top_logprobs=top)
        if job.prefix_cache:
            job.publish_new_blocks(table, self.prefix_blocks)
        await asyncio.gather(*job.sends)
        return report

    async def _chain(self, prev: asyncio.Task | None, hop: CppHop, start: int,
                     x: torch.Tensor) -> None:
        # One output slot per run: a forward may only overwrite it once the
        # one before has been copied out by the next stage.
        if prev is not None:
            await prev
        await self._forward(hop, start, x)

    async def close(self) -> None:
        """Release the pages and the activation slot (once, whatever the path)."""
        if self.closed:
            return
        self.closed = True
        await self.job.cleanup()
        self.worker.act_free.append(self.slot)
