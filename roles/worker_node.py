"""The resources every prefill/decode node owns, opened and closed together.

Opening order (each step needs the one before):
 1. model weights (they fix the KV page shape),
 2. the store shard: one registered buffer carved into pages,
 3. the model runner, viewing those same pages as a tensor (no copy),
 4. the transfer engine, with the shard buffer registered as one region,
    so peers READ cached blocks from it and WRITE streamed KV into it.
Model compute runs on one dedicated thread (torch releases the GIL), so the
event loop keeps serving HTTP and moving KV while a prefill or decode step
computes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import mmap
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import aiohttp
import torch
from aiohttp import web

from kvstore.metrics import register_store_metrics
from kvstore.shard import StoreShard
from model.config import load_model_config, page_layout, stage_layers
from model.runner import DecodeSeq, ModelRunner, configure_torch, kv_pages_view
from model.weights import load_weights
from rdma.engine import TransferEngine

log = logging.getLogger("mooncaked.worker")
T = TypeVar("T")


class WorkerNode:
    def __init__(self, ctx) -> None:  # ctx: mooncaked.node.context.NodeContext
        self.ctx = ctx
        self.config = ctx.config
        # One compute thread, configured for torch (threads, denormals) once.
        self.compute_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute",
                                               initializer=configure_torch,
                                               initargs=(ctx.config.model,))
        self.http: aiohttp.ClientSession | None = None
        self.shard: StoreShard | None = None
        self.runner: ModelRunner | None = None
        self.engine: TransferEngine | None = None
        self.region_id = 0
        self.cpp = False
        self.act_memory: mmap.mmap | None = None

    async def open(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        configure_torch(cfg.model)
        pf = cfg.prefill
        self.cpp = self.ctx.role == "prefill" and pf.cpp_stages > 1
        first, end = 0, None
        if self.cpp:
            # A pipeline stage loads, and keeps KV of, only its layer range.
            first, end = stage_layers(load_model_config(cfg.model.model).num_layers,
                                      pf.cpp_stages, pf.cpp_stage)
        # Loading weights is heavy: keep the loop free while it runs.
        weights = await loop.run_in_executor(self.compute_pool, load_weights, cfg.model, first, end)
        self.first_layer, self.end_layer = weights.first_layer, weights.end_layer
        # full_layout: a page with every layer (what decode nodes and single
        # prefill nodes hold); layout: this node's pages (only its layers).
        self.full_layout = page_layout(weights.config, cfg.store.block_size, cfg.model.dtype)
        self.layout = dataclasses.replace(self.full_layout,
                                          num_layers=self.end_layer - self.first_layer)
        self.shard = StoreShard(cfg.store, self.layout)
        self.runner = ModelRunner(weights, kv_pages_view(self.shard.buffer, self.layout))
        self.model_config = weights.config
        register_store_metrics(self.shard, self.ctx.metrics)
        self.engine = TransferEngine(cfg.transfer, self.ctx.node_id)
        await self.engine.start()
        self.region_id = self.engine.register_local_memory(self.shard.buffer, "cpu:0").id
        if self.cpp:
            # Hidden states cross stage boundaries through this region: two
            # slots (in, out) of one chunk each per request in flight.
            elem = torch.finfo(weights.dtype).bits // 8
            slot = cfg.model.prefill_chunk * weights.config.hidden_size * elem
            self.act_slot_bytes = slot
            self.act_memory = mmap.mmap(-1, 2 * pf.cpp_slots * slot)
            self.act_region_id = self.engine.register_local_memory(self.act_memory, "cpu:0").id
            self.act_free = list(range(pf.cpp_slots))
        self.engine.set_resolver(self._resolve_segment)
        token = cfg.node.cluster_token
        # Every call this node makes to a peer or the conductor is internal:
        # carry the cluster token when one is configured.
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            headers={"Authorization": f"Bearer {token}"} if token else None)
        self.ctx.transfer_descriptor = self.engine.segment_descriptor()
        self.ctx.capacity.update({
            "pages": self.shard.num_pages, "block_size": self.layout.block_size,
            # Whole-model KV per token: what a transfer of a prefix moves.
            "page_bytes": self.layout.page_bytes,
            "kv_bytes_per_token": self.full_layout.kv_bytes_per_token,
            "layout": self.layout.to_dict(), "region": self.region_id,
            "layers": [self.first_layer, self.end_layer],
        })
        if self.cpp:
            self.ctx.capacity.update({"cpp_group": pf.cpp_group, "cpp_stage": pf.cpp_stage,
                                      "cpp_stages": pf.cpp_stages})
        # The first forward pass pays one-off costs (kernel selection, page
        # faults): take them now rather than in the first request's TTFT.
        t_warm = time.perf_counter()
        await self.compute(self._warm_up)
        log.info("model warmed up in %.2fs", time.perf_counter() - t_warm)
        self.ctx.status_providers["store"] = lambda: self.shard.stats().to_dict()
        self.ctx.status_providers["transfer"] = self.engine.stats
        log.info("worker ready in %.2fs: model %s (%d layers), %d pages of %d tokens (%.1f MiB), "
                 "transfer %s", time.perf_counter() - t0, cfg.model.model, weights.config.num_layers,
                 self.shard.num_pages, self.layout.block_size,
                 self.shard.num_pages * self.layout.page_bytes / 2**20,
                 self.engine.segment_descriptor().get("transport"))

    def _warm_up(self) -> None:
        """A short prefill and decode step through one scratch page."""
        if self.first_layer != 0 or self.end_layer != self.model_config.num_layers:
            return  # a pipeline stage: its first chunk warms it
        page = self.shard.allocate(1)
        try:
            n = min(8, self.layout.block_size - 1)
            self.runner.prefill([0] * n, page, 0)
            self.runner.decode_step([DecodeSeq(0, n, page)])
        finally:
            self.shard.free(page)

    async def _resolve_segment(self, name: str):  # -> messages.SegmentDescriptor
        """Peers' transfer segments come from the conductor's registry."""
        from mooncaked.node.internal_client import InternalCallError, InternalClient
        from mooncaked.node.messages import Route, SegmentDescriptor

        assert self.http is not None
        url = self.config.node.conductor_url.rstrip("/") + Route.SEGMENT.format(name=name)
        try:
            # The worker's session carries the cluster token.
            return await InternalClient(self.http).call(url, None, SegmentDescriptor.from_wire,
                                                        what=f"looking up segment {name!r}",
                                                        method="GET")
        except InternalCallError as exc:
            if exc.status is None:
                raise  # conductor unreachable, or its answer does not decode
            raise LookupError(f"segment {name!r} unknown to the conductor (HTTP {exc.status})") from None

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run model work on the compute thread."""
        return await asyncio.get_running_loop().run_in_executor(self.compute_pool, fn, *args)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()
        if self.engine is not None:
            await self.engine.close()
        self.compute_pool.shutdown(wait=True, cancel_futures=True)
        if self.act_memory is not None:
            try:
                self.act_memory.close()
            except BufferError:
                pass  # a view is still alive; the OS reclaims it at exit
        if self.shard is not None:
            self.runner = None  # drop the tensor view before unmapping the buffer
            try:
                self.shard.close()
            except BufferError:
                log.warning("store buffer still referenced at exit; left to the OS")


WORKER = web.AppKey("worker", WorkerNode)


def add_worker_resources(app: web.Application, ctx) -> WorkerNode:
    worker = WorkerNode(ctx)
    app[WORKER] = worker

    async def resources(app: web.Application):
        try:
            await worker.open()
        except Exception:
            await worker.close()
            raise
        yield
        await worker.close()

    app.cleanup_ctx.append(resources)
    return worker
