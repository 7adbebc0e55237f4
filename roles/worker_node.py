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

``WorkerNode.open(ctx)`` is the one factory: it returns a node whose every
part is open (no attribute is ever None or set later); if a step fails, what
was already opened is closed before the error leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import mmap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, TypeVar

import torch
from aiohttp import web

from kvstore.layout import PageLayout
from kvstore.metrics import register_store_metrics
from kvstore.shard import StoreShard
from model.config import ModelConfig, load_model_config, page_layout, stage_layers
from model.precision import bf16_rows_invariant
from model.profile import COLD_MEASURE_CHUNKS, cold_prefill_samples, fit_cold
from model.runner import DecodeSeq, ModelRunner, configure_torch, kv_pages_view
from model.weights import load_weights
from mooncaked.node.config import NodeConfig
from mooncaked.node.context import NodeContext
from mooncaked.node.errors import StartupError
from mooncaked.node.internal_client import InternalCallError, InternalClient
from mooncaked.node.messages import PrefillSpeed, Route, SegmentDescriptor
from rdma.engine import TransferEngine
from roles.compute_sharing import StepQueue

log = logging.getLogger("mooncaked.worker")
T = TypeVar("T")


@dataclasses.dataclass(eq=False)
class WorkerNode:
    """A prefill/decode node's open resources (build it with ``open``)."""

    ctx: NodeContext
    config: NodeConfig
    compute_pool: ThreadPoolExecutor
    # Decode steps a prefill on the compute thread gives way to between two
    # layers (roles/compute_sharing.py): what a colocated node decodes with.
    steps: StepQueue
    # Every call this node makes to a peer or the conductor is internal: the
    # client carries the cluster token when one is configured.
    client: InternalClient
    shard: StoreShard
    runner: ModelRunner | None  # None only once closed (its view pins the buffer)
    engine: TransferEngine
    model_config: ModelConfig
    # full_layout: a page with every layer (what decode nodes and single
    # prefill nodes hold); layout: this node's pages (only its layers
    # [first_layer, end_layer)).
    full_layout: PageLayout
    layout: PageLayout
    first_layer: int
    end_layer: int
    region_id: int
    # Chunked Pipeline Parallelism stage: hidden states cross stage
    # boundaries through ``act_memory`` (registered as ``act_region_id``): two
    # slots (in, out) of ``act_slot_bytes`` per request in flight.
    cpp: bool = False
    act_memory: mmap.mmap | None = None
    act_region_id: int = 0
    act_slot_bytes: int = 0
    act_free: list[int] = dataclasses.field(default_factory=list)
    _resources: contextlib.AsyncExitStack = dataclasses.field(
        default_factory=contextlib.AsyncExitStack, repr=False)
    # The compute thread's CPU-time clock, known once it has run something.
    _compute_clock: int | None = dataclasses.field(default=None, repr=False)
    # Whether decode sequences of requests other than the one named share
    # this node's compute thread now (a colocated node's batcher sets it): a
    # prefill then computes in ``interleave_tokens`` chunks, so a decode
    # step waits for one short chunk rather than a whole prefill_chunk.
    decoding: Callable[[str], bool] = lambda request_id: False
    # A colocated node's batcher: start decoding a request whose reservation
    # is here as soon as this node's prefill samples its first token
    # (DecodeBatcher.start with early=True); None on a node that does not decode.
    start_decode_here: Callable[[str, int, int, Any, list[int]], Any] | None = None
    # ... and its reservation of a request's decode pages (a ReservationGrant
    # for request_id, total_tokens; ApiError when refused): what a
    # PrefillRequest with reserve_here gets.  None on a node that does not decode.
    reserve_here: Callable[[str, int], Any] | None = None
    # ... and the stream of the tokens it decodes for a request its prefill
    # here started: written as TokenLines into a prepared NDJSON response
    # (resp, request_id, prompt_len, first_token), False with nothing written
    # where that prefill did not start it.  None on a node that does not decode.
    decode_here: Callable[[Any, str, int, int], Awaitable[bool]] | None = None
    # The most whole blocks computed within prefill.interleave_tbt_share of
    # the TBT SLO, at least the fewest whose fixed per-chunk cost (measured
    # at warm-up) stays within prefill.interleave_overhead of the chunk's
    # compute; 0 = not measured (chunks stay prefill_chunk).
    interleave_tokens: int = 0
    # This node's prefill time measured at warm-up (prefill and colocated
    # nodes holding every layer): the conductor's prior for it.
    prefill_speed: PrefillSpeed | None = None

    @classmethod
    async def open(cls, ctx: NodeContext) -> WorkerNode:
        """Open every part in order (see the module docstring)."""
        cfg = ctx.config
        pf = cfg.prefill
        t0 = time.perf_counter()
        async with contextlib.AsyncExitStack() as stack:
            configure_torch(cfg.model)
            # One compute thread, configured for torch (threads, denormals) once.
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute",
                                      initializer=configure_torch, initargs=(cfg.model,))
            stack.callback(pool.shutdown, wait=True, cancel_futures=True)
            cpp = ctx.role == "prefill" and pf.cpp_stages > 1
            first, end = 0, None
            if cpp:
                # A pipeline stage loads, and keeps KV of, only its layer range.
                first, end = stage_layers(load_model_config(cfg.model.model).num_layers,
                                          pf.cpp_stages, pf.cpp_stage)
            # Loading weights is heavy: keep the loop free while it runs.
            weights = await asyncio.get_running_loop().run_in_executor(
                pool, load_weights, cfg.model, first, end)
            full_layout = page_layout(weights.config, cfg.store.block_size, cfg.model.dtype)
            layout = dataclasses.replace(full_layout,
                                         num_layers=weights.end_layer - weights.first_layer)
            shard = StoreShard(cfg.store, layout)
            stack.callback(_close_shard, shard)
            memory = None
            if cpp:
                elem = torch.finfo(weights.dtype).bits // 8
                slot_bytes = cfg.model.prefill_chunk * weights.config.hidden_size * elem
                memory = mmap.mmap(-1, 2 * pf.cpp_slots * slot_bytes)
                stack.callback(_close_mapping, memory)
            # Compute must have stopped before the pages and activations it
            # views are unmapped (shutdown is idempotent: it runs again,
            # harmlessly, last).
            stack.callback(pool.shutdown, wait=True, cancel_futures=True)
            runner = ModelRunner(weights, kv_pages_view(shard.buffer, layout))
            register_store_metrics(shard, ctx.metrics)
            engine = TransferEngine(cfg.transfer, ctx.node_id)
            try:
                await engine.start()
            except (OSError, RuntimeError) as exc:  # a port in use, no RDMA for transport=rdma
                t = cfg.transfer
                raise StartupError(
                    f"cannot start the transfer engine (transport {t.transport}, nics "
                    f"{','.join(t.nics)}, ports {t.port or 'any'}+): {exc.strerror or exc}"
                    if isinstance(exc, OSError) else
                    f"cannot start the transfer engine (transport {t.transport}): {exc}") from None
            stack.push_async_callback(engine.close)
            region_id = engine.register_local_memory(shard.buffer, "cpu:0").id
            activations: dict[str, Any] = {}
            if memory is not None:
                activations = dict(
                    act_memory=memory, act_slot_bytes=slot_bytes,
                    act_free=list(range(pf.cpp_slots)),
                    act_region_id=engine.register_local_memory(memory, "cpu:0").id)
            client = InternalClient.open(cfg.node.cluster_token)
            stack.push_async_callback(client.close)
            engine.set_resolver(segment_resolver(client, ctx.conductor))
            worker = cls(ctx=ctx, config=cfg, compute_pool=pool,
                         steps=StepQueue(pool, pf.interleave_step_ratio), client=client, shard=shard,
                         runner=runner, engine=engine, model_config=weights.config,
                         full_layout=full_layout, layout=layout,
                         first_layer=weights.first_layer, end_layer=weights.end_layer,
                         region_id=region_id, cpp=cpp, **activations)
            await asyncio.get_running_loop().run_in_executor(pool, worker._learn_compute_clock)
            # The first forward pass pays one-off costs (kernel selection, page
            # faults): take them now rather than in the first request's TTFT.
            t_warm = time.perf_counter()
            await worker.compute(worker._warm_up)
            log.info("model warmed up in %.2fs; prefill chunks of %s tokens while decoding",
                     time.perf_counter() - t_warm, worker.interleave_tokens or "prefill_chunk")
            worker._resources = stack.pop_all()
        worker._announce()
        log.info("worker ready in %.2fs: model %s (%d layers, %s), %d pages of %d tokens "
                 "(%.1f MiB), transfer %s", time.perf_counter() - t0, cfg.model.model,
                 weights.config.num_layers, cfg.model.dtype, shard.num_pages, layout.block_size,
                 shard.num_pages * layout.page_bytes / 2**20, engine.descriptor().transport)
        if cfg.model.dtype == "bfloat16" and cfg.model.device == "cpu" \
                and not bf16_rows_invariant():
            log.warning("model.dtype is bfloat16, but this CPU's bfloat16 matrix products "
                        "depend on the rows computed beside each row: a greedy token may "
                        "differ with and without cache reuse (model/precision.py); "
                        "model.dtype = \"auto\" picks float32 here")
        return worker

    def _announce(self) -> None:
        """What the node registers with: capacity, transfer segment, status."""
        ctx, pf = self.ctx, self.config.prefill
        ctx.transfer_descriptor = self.engine.segment_descriptor()
        yields_to = [n.strip() for n in pf.yields_to.split(",") if n.strip()]
        colocated = ctx.config.node.role == "colocated"
        ctx.capacity = dataclasses.replace(
            ctx.capacity, pages=self.shard.num_pages, block_size=self.layout.block_size,
            page_bytes=self.layout.page_bytes,
            # Whole-model KV per token: what a transfer of a prefix moves.
            kv_bytes_per_token=self.full_layout.kv_bytes_per_token,
            layout=self.layout, region=self.region_id,
            layers=[self.first_layer, self.end_layer], yields_to=yields_to or None,
            interleave_tokens=(self.interleave_tokens or None) if colocated else None,
            interleave_step_ratio=pf.interleave_step_ratio if colocated else None,
            prefill_speed=self.prefill_speed)
        if self.cpp:
            ctx.capacity = dataclasses.replace(ctx.capacity, cpp_group=pf.cpp_group,
                                               cpp_stage=pf.cpp_stage, cpp_stages=pf.cpp_stages)
        ctx.status_providers["store"] = lambda: self.shard.stats().to_dict()
        ctx.status_providers["transfer"] = self.engine.stats
        ctx.collection_sizes.append(self._collection_sizes)

    def _collection_sizes(self) -> dict[str, int]:
        transfer, store = self.engine.stats(), self.shard.stats()
        return {"transfer_batches": transfer["batches"], "transfer_endpoints": transfer["endpoints"],
                "store_private_pages": store.private_pages, "store_pinned_blocks": store.pinned_blocks}

    def _warm_up(self) -> None:
        """A short prefill and decode step through one scratch page; then the
        per-chunk cost that sizes interleaved chunks (``interleave_tokens``)."""
        if self.first_layer != 0 or self.end_layer != self.model_config.num_layers:
            return  # a pipeline stage: its first chunk warms it
        page = self.shard.allocate(1)
        try:
            n = min(8, self.layout.block_size - 1)
            self.runner.prefill([0] * n, page, 0)
            self.runner.decode_step([DecodeSeq(0, n, page)])
            self.interleave_tokens = self._measure_interleave_tokens(page)
        finally:
            self.shard.free(page)
        if self.ctx.config.node.role in ("prefill", "colocated"):
            self.prefill_speed = self._measure_prefill_speed()

    def _measure_prefill_speed(self) -> PrefillSpeed | None:
        """Uncached prefills of one block, two, four ... up to a few prefill
        chunks (model.profile.cold_prefill_samples), fitted; None when the
        shard cannot spare the pages."""
        bs, chunk = self.layout.block_size, self.config.model.prefill_chunk
        longest = min(COLD_MEASURE_CHUNKS * chunk, self.model_config.max_position)
        need = -(-max(bs, longest) // bs)
        if need > self.shard.num_pages:
            return None
        pages = self.shard.allocate(need)
        try:
            vocab = self.model_config.vocab_size
            tokens = [(7 * i + 3) % vocab for i in range(need * bs)]
            samples = cold_prefill_samples(
                lambda n: self.runner.prefill(tokens[:n], pages, 0, chunk_size=chunk), bs, longest)
        finally:
            self.shard.free(pages)
        c = fit_cold(samples)
        log.info("prefill measured: %s", ", ".join(f"{n} tokens {s * 1e3:.1f} ms"
                                                   for n, s in samples))
        return PrefillSpeed(c0=c["c0"], per_token=c["n"], per_token2=c["n2"],
                            per_token_cached=c["np"], sampled_up_to=samples[-1][0])

    def _measure_interleave_tokens(self, page: list[int]) -> int:
        share = self.config.prefill.interleave_overhead
        if share <= 0:
            return 0
        bs = self.layout.block_size
        one = _best_of(3, lambda: self.runner.prefill([0], page, 0))
        block = _best_of(3, lambda: self.runner.prefill([0] * bs, page, 0))
        cfg = self.config
        wait_s = cfg.prefill.interleave_tbt_share * cfg.conductor.tbt_slo_ms / 1000.0
        return interleave_tokens(one, block, bs, share, cfg.model.prefill_chunk, wait_s)

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run model work on the compute thread."""
        return await asyncio.get_running_loop().run_in_executor(self.compute_pool, fn, *args)

    def compute_step(self, fn: Callable[..., T], *args: Any,
                     first_decode: bool = False) -> Awaitable[T]:
        """Run a decode step on the compute thread: in order, or earlier
        at a yield point of a prefill that has had its share (``give_way``;
        at once when ``first_decode``: it decodes some reply's second
        token).  Queued when called."""
        return self.steps.run(fn, *args, first_decode=first_decode)

    def give_way(self, on_time: Callable[[float], bool] | None = None) -> None:
        """A prefill at a yield point, on the compute thread: run the
        decode steps waiting for the thread if they are due
        (``StepQueue.give_way``)."""
        self.steps.give_way(on_time)

    def _learn_compute_clock(self) -> None:
        self._compute_clock = time.pthread_getcpuclockid(threading.get_ident())

    def compute_cpu_s(self) -> float:
        """CPU seconds the compute thread has had so far (any thread may ask).

        Differences of it are the work of a compute, whatever else ran on the
        cores meanwhile: what a node at idle priority on cores other nodes
        have first call on reports, since its wall times hold their bursts.
        It counts torch's intra-op threads only when torch runs on the
        compute thread alone (model.torch_threads = 1, as for such a node)."""
        if self._compute_clock is None:
            return 0.0
        return time.clock_gettime(self._compute_clock)

    async def close(self) -> None:
        """Close every part, in reverse order of opening."""
        self.runner = None  # drop the tensor view before the buffer is unmapped
        await self._resources.aclose()


def interleave_tokens(one_token_s: float, block_s: float, block_size: int, share: float,
                      prefill_chunk: int, wait_s: float = 0.0) -> int:
    """The chunk a prefill computes in while decode steps wait on it.

    A chunk of t tokens costs about o + c * t: o, what every chunk pays
    whatever its size (a pass over the weights, the per-layer calls), is the
    time of a one-token prefill; c, the rest of a block's time per token.
    The most whole blocks whose time o + c * t fits ``wait_s`` (what a
    decode step may wait on a chunk: the longer the chunk, the more of the
    node's time goes to prefill and the sooner first tokens come), but at
    least the fewest with o <= share * (o + c * t) (the per-chunk cost within
    ``share`` of the compute); at most prefill_chunk (in whole blocks); 0
    when ``share`` is 0 (no interleave size: always prefill_chunk)."""
    if share <= 0:
        return 0
    per_token = max(block_s - one_token_s, 1e-12) / max(1, block_size - 1)
    tokens = one_token_s * (1 - share) / (share * per_token)
    largest = max(block_size, prefill_chunk - prefill_chunk % block_size)
    if not math.isfinite(tokens):
        return largest
    fewest = max(1, math.ceil(tokens / block_size)) * block_size
    fitting = math.floor((wait_s - one_token_s) / per_token / block_size) * block_size \
        if wait_s > one_token_s else 0
    return min(largest, max(fewest, fitting))


def _best_of(repeats: int, fn: Callable[[], Any]) -> float:
    """The least wall time of ``repeats`` calls (the others met interference)."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def segment_resolver(client: InternalClient, conductor_url: str | Callable[[], str]
                     ) -> Callable[[str], Awaitable[SegmentDescriptor]]:
    """Peers' transfer segments come from the conductor's registry (a callable
    URL is read per lookup: with etcd the conductor moves to each new leader)."""

    async def resolve(name: str) -> SegmentDescriptor:
        base = (conductor_url() if callable(conductor_url) else conductor_url).rstrip("/")
        try:
            return await client.call(base + Route.SEGMENT.format(name=name), None,
                                     SegmentDescriptor.from_wire,
                                     what=f"looking up segment {name!r}", method="GET")
        except InternalCallError as exc:
            if exc.status is None:
                raise  # conductor unreachable, or its answer does not decode
            raise LookupError(f"segment {name!r} unknown to the conductor "
                              f"(HTTP {exc.status})") from None

    return resolve


def _close_shard(shard: StoreShard) -> None:
    try:
        shard.close()
    except BufferError:
        log.warning("store buffer still referenced at exit; left to the OS")


def _close_mapping(memory: mmap.mmap) -> None:
    try:
        memory.close()
    except BufferError:
        pass  # a view is still alive; the OS reclaims it at exit


WORKER = web.AppKey("worker", WorkerNode)


def add_worker_resources(app: web.Application, ctx: NodeContext) -> None:
    """Open the node's resources when the app starts (``app[WORKER]``) and
    close them at shutdown; services appended after this one find it open."""

    async def resources(app: web.Application):
        worker = await WorkerNode.open(ctx)
        app[WORKER] = worker
        yield
        await worker.close()

    app.cleanup_ctx.append(resources)
