"""One prefill request, the paper's steps 1-3 (step 4 is the conductor's hand-off).

1. KVCache reuse: pin the longest prefix held locally; READ the planned
   extra prefix blocks from the peer that holds them (under a lease) into
   fresh local pages and publish them here (this replicates hot prefixes);
   if the fetch fails, recompute those blocks instead and say so.
2. Incremental prefill: compute only the uncached suffix, in chunks; publish
   every new full block in the local shard under its key.
3. KVCache transfer: the prefix pages are sent whole to the decode node at
   once; every computed chunk streams layer by layer from the runner's layer
   hook, so the decode node receives layer l while layer l+1 computes.
Invariant: every page this job pins or allocates is released or freed on
every path out (success, failure, cancellation).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from typing import Any

from kvstore.shard import StoreFullError, StoreShard
from model.sampling import sample_top
from model.structured import GrammarMatcher
from mooncaked.node.internal_client import UNBOUNDED, InternalCallError
from mooncaked.node.messages import (DecodeStart, DecodeStartFromPrefill, FetchPlan,
                                     LeaseGrant, LeaseRelease, LeaseRequest, Ok, PrefillReply,
                                     PrefillRequest, ReservationGrant, Route, StoredBlocks)
from rdma.types import TransferError, TransferOp, TransferRequest
from roles.worker_node import WorkerNode

log = logging.getLogger("mooncaked.prefill")

# A decode start sent to a peer gives up after this: the conductor's own
# start, a moment later, starts the decode anyway.
START_THERE_TIMEOUT_S = 5.0
# Starts sent to decode peers and not answered yet: referenced here until
# done (the event loop keeps only weak references to tasks).
_starts_in_flight: set[asyncio.Task] = set()


class PrefillCancelled(Exception):
    pass


class PrefillFailed(Exception):
    pass


class PrefillJob:
    """One request's prefill on this node (see the module docstring).

    ``run()`` is the whole job.  The prefill queue and the CPP stages drive
    the public steps themselves: ``prepare`` (or their own prefix agreement)
    -> compute with ``layer_hook`` -> ``finish``, with ``send_blocks`` and
    ``publish_new_blocks`` in between; whoever starts a job calls ``cleanup``.
    """

    def __init__(self, spec: PrefillRequest, worker: WorkerNode, chunk_size: int,
                 fetch_timeout_s: float, prefix_cache: bool = True) -> None:
        self.spec = spec
        self.worker = worker
        self.client = worker.client  # carries the cluster token
        self.shard: StoreShard = worker.shard
        self.layout = worker.layout
        self.bs = self.layout.block_size
        # Chunks start on block boundaries so that each (page, layer) byte
        # range is written to the decode node exactly once.
        self.chunk_size = max(self.bs, chunk_size - chunk_size % self.bs)
        self.fetch_timeout_s = fetch_timeout_s
        # Without the prefix cache nothing is looked up, fetched or kept.
        self.prefix_cache = prefix_cache
        self.cancelled = False
        self.pinned_keys: list[int] = []      # released at the end (tail first)
        self.private_pages: list[int] = []    # freed at the end
        self.sends: list[asyncio.Task] = []
        self.fetch_pages: list[int] = []      # targets of a peer READ in flight
        self.stream_log: list[tuple[int, int, float]] = []  # (chunk_end, layer, sent_at)
        # The compute thread's CPU clock when this job's compute began
        # (WorkerNode.compute_cpu_s); None until then.
        self.cpu_at_start: float | None = None
        # Seconds the compute thread spent on this job's chunks, and on the
        # decode steps it gave way to inside them; and from each chunk's
        # submission to its result back on the event loop: those two plus the
        # chunks' waits for the thread and for the loop.
        self.chunk_compute_s = 0.0
        self.chunk_gave_way_s = 0.0
        self.chunk_wall_s = 0.0
        # The conductor's prediction as this node can keep it: the first
        # token's reply due by ``reply_due`` (perf_counter; inf: no
        # prediction), after ``predicted_s`` of compute.  While the prefill
        # is on time, decode steps sharing the thread run first (on_time).
        budget = spec.budget
        self.reply_due = math.inf if budget is None \
            else time.perf_counter() + budget.reply_within_s
        self.predicted_s = 0.0 if budget is None else budget.prefill_s
        # Progress of the chunk on the thread: tokens through every layer,
        # counted when a layer starts (the layer hook); when it started and
        # the given-way steps' seconds then.
        self._done_tokens = 0.0
        self._chunk_t0 = 0.0
        self._chunk_steps_s = 0.0

    # -- step 1 -------------------------------------------------------------
    async def load_prefix(self, result: PrefillReply,
                          max_blocks: int | None = None) -> list[int]:
        """Pin the longest prefix held here (at most ``max_blocks``), then
        fetch the planned extra blocks from the peer (a failed fetch is
        recorded in ``result`` and those blocks are recomputed).  Returns the
        prefix's pages, pinned under ``pinned_keys``; counts go into ``result``."""
        spec, shard = self.spec, self.shard
        if not self.prefix_cache:
            return []
        reusable = spec.block_keys[:max_blocks]
        # Blocks on the SSD tier are read back off the event loop first; the
        # acquire right after (no await between) finds them in DRAM.
        await shard.promote_prefix(reusable)
        pages = shard.acquire_prefix(reusable, spec.token_ids)
        self.pinned_keys = list(reusable[:len(pages)])
        result.local_hit_tokens = len(pages) * self.bs
        fetch = spec.fetch
        want = min(fetch.to_block, len(reusable)) if fetch is not None else 0
        if want > len(pages):
            t0 = time.perf_counter()
            try:
                fetched = await asyncio.wait_for(self._fetch(fetch, len(pages), want),
                                                 self.fetch_timeout_s)
                pages += fetched
                result.fetched_tokens = len(fetched) * self.bs
            except (PrefillFailed, TransferError, StoreFullError, LookupError, InternalCallError,
                    asyncio.TimeoutError, OSError) as exc:
                result.fetch_failed = f"{type(exc).__name__}: {exc}"
                log.warning("%s: prefix fetch from %s failed, recomputing: %s",
                            spec.request_id, fetch.source_url, result.fetch_failed)
                self._quarantine_fetch_pages()
            result.timings.fetch_s = time.perf_counter() - t0
        return pages

    async def _fetch(self, fetch: FetchPlan, first: int, end: int) -> list[int]:
        """READ blocks [first, end) from the peer into local pages; publish them."""
        spec, shard, engine = self.spec, self.shard, self.worker.engine
        peer = fetch.source_url.rstrip("/")
        keys = spec.block_keys[first:end]
        # No per-call timeouts: the whole fetch runs under load_prefix's wait_for.
        lease = await self.client.call(
            peer + Route.LEASE, LeaseRequest(keys=keys, ttl_s=self.fetch_timeout_s + 5),
            LeaseGrant.from_wire, what="block lease", timeout=UNBOUNDED)
        try:
            if not lease.pages:
                raise PrefillFailed("peer no longer holds the prefix")
            local = shard.allocate(len(lease.pages))
            self.private_pages += local
            self.fetch_pages = list(local)
            pb = self.layout.page_bytes
            await engine.transfer([
                TransferRequest(TransferOp.READ, self.worker.region_id, self.layout.page_offset(lp), pb,
                                lease.segment, rp * pb, lease.region)
                for lp, rp in zip(local, lease.pages)])
        finally:
            # Only an unreachable peer fails the release (its answer is not looked at).
            await self.client.send(peer + Route.LEASE_RELEASE, LeaseRelease(lease_id=lease.lease_id),
                                   what="block lease release", timeout=UNBOUNDED, check_status=False)
        pages = []
        for i, page in enumerate(local):
            b = first + i
            published = shard.publish(keys[i], page, spec.token_ids[b * self.bs:(b + 1) * self.bs],
                                      pin=True)
            self.pinned_keys.append(keys[i])
            if published.stored:
                self.private_pages.remove(page)
            pages.append(published.page_id)
        return pages

    def _quarantine_fetch_pages(self) -> None:
        """A READ that failed or timed out may still land a few late bytes in
        the pages it targeted: keep them out of circulation for a while
        instead of handing them to the next allocation (ours included)."""
        pages = [p for p in self.fetch_pages if p in self.private_pages]
        if not pages:
            return
        for p in pages:
            self.private_pages.remove(p)
        delay = 2 * self.worker.config.transfer.stall_timeout_s
        asyncio.get_running_loop().call_later(delay, self.shard.free, pages)

    # -- step 3: KV streaming -------------------------------------------------
    def send_blocks(self, block_table: list[int], first_block: int, end_block: int,
                    layers: tuple[int, int] | None) -> None:
        """Queue WRITEs of blocks [first_block, end_block) to the decode node's pages:
        model layers ``layers`` = [l0, l1) of each page, or all of this node's
        layers when None.  Decode pages hold every layer (``full_layout``); a
        pipeline stage's own pages hold only its layers (``layout``), so the
        same layers sit at different offsets on the two sides."""
        spec, worker = self.spec, self.worker
        target = spec.decode
        base = worker.first_layer
        l0, l1 = layers if layers is not None else (worker.first_layer, worker.end_layer)
        requests = []
        for b in range(first_block, end_block):
            local_off, length = self.layout.layer_range_span(block_table[b], l0 - base, l1 - base)
            remote_off = worker.full_layout.layer_range_span(target.pages[b], l0, l1)[0]
            # The reservation's capability: the decode node lands a WRITE only
            # into pages granted to it, so once the reservation is released
            # (cancelled, expired) none of ours can reach the pages' next owner.
            requests.append(TransferRequest(TransferOp.WRITE, worker.region_id, local_off, length,
                                            target.segment, remote_off, target.region,
                                            capability=target.capability))
        if not requests:
            return
        engine = self.worker.engine
        if target.segment == engine.name:
            # Colocated: the "decode node" is this node; copy between our own
            # pages, through the same write guard a peer's WRITE meets.
            buf = self.shard.buffer
            for r in requests:
                if not engine.write_local(r.target_region, r.target_offset,
                                          buf[r.local_offset:r.local_offset + r.length], r.capability):
                    refused = asyncio.get_running_loop().create_future()
                    refused.set_exception(TransferError(
                        f"local copy into [{r.target_offset}, +{r.length}) refused: the reservation's "
                        f"capability grants no such range (reservation released or expired?)"))
                    self.sends.append(refused)
                    return
            return
        self.sends.append(asyncio.ensure_future(engine.transfer(requests)))

    # -- the whole job --------------------------------------------------------
    # run() = prepare() -> compute -> finish(); the prefill queue may instead
    # prepare several short jobs, compute them in one batched forward pass and
    # finish each (PrefillService).  Whoever calls prepare() calls cleanup().
    async def prepare(self) -> None:
        """Step 1 and the page allocation: afterwards ``table`` covers the
        prompt and ``cached`` tokens of it need no compute."""
        spec, shard, bs = self.spec, self.shard, self.bs
        n = len(spec.token_ids)
        self.result = result = PrefillReply(first_token=-1, logprob=0.0)
        self.t_start = time.perf_counter()
        # The last prompt token is always computed (it yields the logits): the
        # block holding it is never reused, so it is neither pinned, counted
        # as a cache hit nor fetched.
        prefix_pages = await self.load_prefix(result, max_blocks=(n - 1) // bs)
        usable = min(len(prefix_pages), (n - 1) // bs)
        if usable < len(prefix_pages):
            shard.release(self.pinned_keys[usable:])
            del self.pinned_keys[usable:]
            dropped = (len(prefix_pages) - usable) * bs
            result.fetched_tokens -= min(result.fetched_tokens, dropped)
            result.local_hit_tokens = min(result.local_hit_tokens, usable * bs)
            prefix_pages = prefix_pages[:usable]
        self.usable = usable
        self.cached = usable * bs
        new_pages = shard.allocate(-(-n // bs) - usable)
        self.private_pages += new_pages
        self.table = prefix_pages + new_pages
        self.send_blocks(self.table, 0, usable, None)

    def layer_hook(self, loop: asyncio.AbstractEventLoop, abort_on_cancel: bool = True):
        """The runner's per-(chunk, layer) callback: it runs on the compute
        thread and hands the KV send of that layer to the event loop."""
        table, bs = self.table, self.bs

        layers = self.worker.model_config.num_layers

        def hook(start: int, end: int, layer: int) -> None:
            if self.cancelled and abort_on_cancel:
                raise PrefillCancelled()
            if self._chunk_t0:   # one of run()'s chunks: on_time reads its progress
                self._done_tokens = start - self.cached + (end - start) * layer / layers
            loop.call_soon_threadsafe(self.send_blocks, table, start // bs, -(-end // bs),
                                      (layer, layer + 1))
            self.stream_log.append((end, layer, time.perf_counter()))
            # A colocated node's decode steps waiting for the thread run
            # here while this prefill is on time or once it has had its share.
            self._yield_point()
        return hook

    def on_time(self, step_s: float) -> bool:
        """Whether this prefill, after one more decode step of ``step_s``,
        still replies by its predicted time: its remaining compute is the
        prediction less what it has computed, or what its own pace so far
        makes of the tokens left, whichever is longer.  On the compute
        thread, during one of ``run``'s chunks (False otherwise: a batched
        pass does not track its jobs' progress)."""
        if self.reply_due == math.inf or not self._chunk_t0:
            return False
        now = time.perf_counter()
        own = self.chunk_compute_s + (now - self._chunk_t0) \
            - (self.worker.steps.between_layers_s - self._chunk_steps_s)
        left = max(0.0, self.predicted_s - own)
        total = len(self.spec.token_ids) - self.cached
        if self._done_tokens > 0:
            left = max(left, own * (total - self._done_tokens) / self._done_tokens)
        return now + step_s + left <= self.reply_due

    def _yield_point(self) -> None:
        """At a layer boundary (the hook) and inside a layer
        (``prefill_layer``): run the decode steps that are due."""
        self.worker.give_way(self.on_time)

    async def finish(self, logits: Any, t_compute: float, compute_s: float) -> PrefillReply:
        """Sample the first token, keep the new blocks, wait for the KV sends."""
        spec, result = self.spec, self.result
        if self.cancelled:
            raise PrefillCancelled()
        result.timings.compute_s = compute_s
        result.computed_tokens = len(spec.token_ids) - self.cached
        # The first output token: no output before it to penalize; min_tokens
        # reads the EOS ids the front end put in the params.
        grammar = None if spec.sampling.grammar is None else \
            GrammarMatcher.for_model(spec.sampling.grammar, self.worker.config.model.model)
        first = sample_top(logits, spec.sampling, spec.sampling.make_generator(),
                           prompt_ids=spec.token_ids, grammar=grammar)
        result.first_token, result.logprob = first.token, first.logprob
        result.top_logprobs = list(first.top) or None
        if self.prefix_cache:
            stored = self.publish_new_blocks(self.table, self.usable)
            if stored:
                # Read after the publishes: their events wait for the next drain.
                result.stored = StoredBlocks(*self.shard.next_event_batch(), stored)
        t_wait = time.perf_counter()
        await asyncio.gather(*self.sends)
        result.timings.transfer_wait_s = time.perf_counter() - t_wait
        self._start_decode(result.first_token)
        if self.stream_log:
            result.timings.first_layer_sent_s = self.stream_log[0][2] - t_compute
        result.timings.total_s = time.perf_counter() - self.t_start
        return result

    def _start_decode(self, first_token: int) -> None:
        """Decoding starts once the KV is in the reservation's pages, not when
        the conductor's start arrives (which then attaches to it): on this
        colocated node at once (local copies complete as they are made), on
        another node by ``DecodeStartFromPrefill`` to ``decode_url`` (every
        WRITE is acknowledged by now), sent beside the reply, not awaited.
        Refused (reservation gone, grammar, the conductor's start there
        first, ...): the conductor's start meets the same and reports it."""
        spec, worker = self.spec, self.worker
        if spec.cpp is not None or worker.first_layer != 0:
            return
        start = DecodeStart(spec.request_id, len(spec.token_ids), first_token, spec.sampling,
                            spec.token_ids if spec.sampling.needs_prompt else None)
        if spec.decode.segment == worker.engine.name:
            if worker.start_decode_here is None:
                return
            try:
                worker.start_decode_here(start.request_id, start.prompt_len, start.first_token,
                                         start.sampling, start.prompt_token_ids)
            except (KeyError, ValueError) as exc:
                log.info("%s: decode not started with the first token here: %s",
                         spec.request_id, exc)
        elif spec.decode_url is not None:
            task = asyncio.ensure_future(self.client.call(
                spec.decode_url + Route.DECODE_START,
                DecodeStartFromPrefill(start, capability=spec.decode.capability), Ok.from_wire,
                what="starting the decode", timeout=START_THERE_TIMEOUT_S))
            _starts_in_flight.add(task)
            task.add_done_callback(functools.partial(_start_sent, spec.request_id))

    async def run(self) -> PrefillReply:
        """The whole job: prepare, compute on the compute thread, finish; cleans up."""
        try:
            await self.prepare()
            hook = self.layer_hook(asyncio.get_running_loop())
            t_compute = time.perf_counter()
            self.cpu_at_start = self.worker.compute_cpu_s()
            logits = None
            # One compute-thread call per chunk, not one for the whole prompt:
            # the compute thread is FIFO, so a decode step queued on the same
            # worker (a colocated node) runs between two chunks instead of
            # waiting for the whole prefill; token spacing then grows by at
            # most one chunk.  A cancelled job stops at the next chunk.
            # While decode sequences share the compute thread, chunks are the
            # node's interleave size (WorkerNode.interleave_tokens): a step
            # then waits for one short chunk.  Sizes are whole blocks, so
            # every chunk still starts on a block boundary.
            start, n = self.cached, len(self.spec.token_ids)
            while start < n:
                if self.cancelled:
                    raise PrefillCancelled()
                size = self.chunk_size
                if self.worker.interleave_tokens and self.worker.decoding(self.spec.request_id):
                    size = min(size, self.worker.interleave_tokens)
                end = min(n, (start // size + 1) * size)
                t_submit = time.perf_counter()
                logits = await self.worker.compute(self._prefill_chunk, start, end, hook)
                self.chunk_wall_s += time.perf_counter() - t_submit
                start = end
            timings = self.result.timings
            timings.compute_cpu_s = self.worker.compute_cpu_s() - self.cpu_at_start
            timings.gave_way_s = self.chunk_gave_way_s
            timings.thread_wait_s = max(0.0, self.chunk_wall_s - self.chunk_compute_s
                                        - self.chunk_gave_way_s)
            # The prefill's own compute: not the decode steps a colocated
            # node ran between its chunks (the conductor prices those).
            return await self.finish(logits, t_compute, self.chunk_compute_s)
        finally:
            await self.cleanup()

    def _prefill_chunk(self, start: int, end: int, hook) -> Any:
        """Tokens [start, end) through every layer; the logits of the last one.
        Runs on the compute thread, which adds its own time to
        ``chunk_compute_s`` (one compute thread: no two chunks at once),
        less the decode steps it gave way to between its layers."""
        t0 = self._chunk_t0 = time.perf_counter()
        steps_s = self._chunk_steps_s = self.worker.steps.between_layers_s
        try:
            return self.worker.runner.prefill_stage(self.spec.token_ids[start:end], self.table,
                                                    start, layer_hook=hook,
                                                    yield_point=self._yield_point)
        finally:
            stepped_s = self.worker.steps.between_layers_s - steps_s
            self.chunk_gave_way_s += stepped_s
            self.chunk_compute_s += time.perf_counter() - t0 - stepped_s

    def publish_new_blocks(self, table: list[int], first_new: int) -> list[int]:
        """Keep blocks [first_new, ...) of ``table`` in the local shard under
        their keys (pinned until ``cleanup``); a page whose key was stored
        meanwhile stays private and is freed at cleanup.  Returns the keys
        newly stored."""
        spec, bs = self.spec, self.bs
        stored: list[int] = []
        for b in range(first_new, len(spec.block_keys)):
            page = table[b]
            published = self.shard.publish(spec.block_keys[b], page,
                                           spec.token_ids[b * bs:(b + 1) * bs], pin=True)
            self.pinned_keys.append(spec.block_keys[b])
            if published.stored:
                self.private_pages.remove(page)
                stored.append(spec.block_keys[b])
        return stored

    async def cleanup(self) -> None:
        """Release every pin and free every private page (tail first); waits
        for the KV sends, which read those pages, first."""
        if self.sends:
            for task in self.sends:
                if not task.done() and self.cancelled:
                    task.cancel()
            await asyncio.gather(*self.sends, return_exceptions=True)
        if self.pinned_keys:
            self.shard.release(self.pinned_keys)
            self.pinned_keys = []
        if self.private_pages:
            self.shard.free(self.private_pages)
            self.private_pages = []


def _start_sent(request_id: str, task: asyncio.Task) -> None:
    _starts_in_flight.discard(task)
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        # Usually the conductor's start got there first (409) or the request
        # ended meanwhile (404): nothing lost either way.
        log.debug("%s: decode not started from here: %s", request_id, exc)


async def prefetch(worker: WorkerNode, source_url: str, token_ids: list[int], block_keys: list[int],
                   timeout_s: float) -> tuple[int, str]:
    """Pull the blocks of ``block_keys`` this node lacks from ``source_url`` and keep
    them cached (operator-driven replication of a hot prefix; no compute).
    Returns (tokens now held here, fetch error or "")."""
    spec = PrefillRequest(request_id="prefetch", token_ids=token_ids, block_keys=block_keys,
                          decode=ReservationGrant(pages=[], segment=""),
                          fetch=FetchPlan(source_url=source_url, to_block=len(block_keys)))
    job = PrefillJob(spec, worker, worker.layout.block_size, timeout_s)
    result = PrefillReply(first_token=-1, logprob=0.0)
    try:
        await job.load_prefix(result)
    finally:
        await job.cleanup()  # unpin: the blocks stay cached, evictable like any other
    return result.local_hit_tokens + result.fetched_tokens, result.fetch_failed
