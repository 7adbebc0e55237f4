"""A prefill node's job (roles/prefill/job.py, service.py) in one process.

The prefill node is a real ``WorkerNode`` (``WorkerNode.open``: the tiny
model, a store shard, a tcp transfer engine); the "decode side" is a second
store shard registered with its own transfer engine as a segment, whose pages
the tests reserve by hand, as the decode node would.  What the job answers
and what lands in those pages is checked against an independent reference:
the same weights in a bare ``ModelRunner`` over a private buffer, one
request, no shard, no transfer.  The shard's own counters and
``check_integrity`` say what stayed pinned or allocated.
"""

from __future__ import annotations

import asyncio
import threading
import contextlib
import time
from dataclasses import dataclass

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvstore import StoreConfig, StoreShard
from kvstore.keys import block_keys
from model.config import DUMMY_CONFIGS, RuntimeConfig, page_layout
from model.runner import ModelRunner, kv_pages_view
from model.sampling import SamplingParams
from mooncaked.node.config import NodeConfig
from mooncaked.node.context import NodeContext
from mooncaked.node.messages import (FetchPlan, PrefillBudget, PrefillRequest, ReservationGrant,
                                     StoredBlocks)
from mooncaked.node.sections import NodeSection
from rdma.config import TransferConfig
from rdma.engine import TransferEngine
from roles.prefill.job import PrefillCancelled, PrefillJob
from roles.prefill.service import PrefillService
from roles.store_leases import LEASES, add_lease_routes
from roles.worker_node import WORKER, WorkerNode, interleave_tokens
from tests.cluster_helpers import tokens

BLOCK = 16
CHUNK = 16          # one block per chunk: every chunk streams its own layers
PAGES = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=True)
PROMPT_A = tokens(40, seed=1)                   # 2 full blocks + 8
PROMPT_B = PROMPT_A[:32] + tokens(13, seed=2)   # A's 2 blocks + 13 of its own


def pages_for(n: int) -> int:
    return -(-n // BLOCK)


# ---- the reference ----------------------------------------------------------------

@dataclass
class Reference:
    token: int
    logprob: float
    kv: torch.Tensor   # [pages, layers, 2, block, kv_heads, head_dim], page b = block b


def reference(weights, prompt: list[int]) -> Reference:
    """One request alone: prefill into pages 0.. of a private buffer."""
    layout = page_layout(weights.config, BLOCK, weights.dtype_name)
    n = pages_for(len(prompt))
    runner = ModelRunner(weights, kv_pages_view(bytearray(n * layout.page_bytes), layout))
    logits = runner.prefill(prompt, list(range(n)), 0)
    token = int(torch.argmax(logits))
    return Reference(token, float(torch.log_softmax(logits, -1)[token]), runner.kv_pages.clone())


# ---- the two sides -------------------------------------------------------------------

class DecodeSide:
    """The decode node's half of the KV path: a shard whose buffer is a
    registered transfer segment, and page reservations."""

    def __init__(self, weights) -> None:
        self.layout = page_layout(weights.config, BLOCK, weights.dtype_name)
        self.shard = StoreShard(StoreConfig(block_size=BLOCK, capacity_bytes=PAGES * self.layout.page_bytes,
                                            prefault=False, hugepages=False), self.layout)
        self.engine = TransferEngine(TransferConfig(transport="tcp"), "decode-seg")
        self.kv = kv_pages_view(self.shard.buffer, self.layout)
        self.shard.allocate(3)  # so that granted page ids differ from the prefill side's

    async def start(self) -> None:
        await self.engine.start()
        self.region_id = self.engine.register_local_memory(self.shard.buffer).id

    def reserve(self, total_tokens: int) -> ReservationGrant:
        # Reversed: block b of the prompt goes to a page unrelated to b.
        pages = self.shard.allocate(pages_for(total_tokens))[::-1]
        return ReservationGrant(pages=pages, segment=self.engine.name, region=self.region_id)

    def assert_kv_landed(self, grant: ReservationGrant, prompt: list[int], ref: Reference) -> None:
        """Every layer of every prompt block sits in its granted page, as the
        reference computed it; the pages reserved for the output stay zero."""
        n = len(prompt)
        for b, page in enumerate(grant.pages[:pages_for(n)]):
            valid = min(BLOCK, n - b * BLOCK)
            for layer in range(self.layout.num_layers):
                torch.testing.assert_close(self.kv[page, layer, :, :valid],
                                           ref.kv[b, layer, :, :valid], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"block {b} layer {layer}: {m}")
        for page in grant.pages[pages_for(n):]:
            assert not self.kv[page].any(), f"output page {page} was written"

    async def close(self) -> None:
        await self.engine.close()
        del self.kv
        self.shard.close()


def node_config(node_id: str) -> NodeConfig:
    """A ``--model tiny`` prefill node with a 64-page shard and tcp transfers."""
    layout = page_layout(DUMMY_CONFIGS["tiny"], BLOCK)
    return NodeConfig(
        node=NodeSection(role="prefill", node_id=node_id),
        store=StoreConfig(block_size=BLOCK, capacity_bytes=PAGES * layout.page_bytes,
                          prefault=False, hugepages=False),
        transfer=TransferConfig(transport="tcp"),
        model=RuntimeConfig(model="tiny", prefill_chunk=CHUNK))


@pytest.fixture
async def decode(tiny_weights):
    side = DecodeSide(tiny_weights)
    await side.start()
    yield side
    await side.close()


@pytest.fixture
async def open_worker(decode):
    """``await open_worker(node_id)``: a prefill node's open WorkerNode that
    knows the decode side's segment."""
    opened: list[WorkerNode] = []

    async def make(node_id: str = "prefill-A") -> WorkerNode:
        worker = await WorkerNode.open(NodeContext(node_config(node_id)))
        opened.append(worker)
        worker.engine.add_segment(decode.engine.segment_descriptor())
        return worker

    yield make
    for worker in opened:
        await worker.close()


def spec_for(worker: WorkerNode, request_id: str, prompt: list[int], grant: ReservationGrant,
             fetch: FetchPlan | None = None, budget: PrefillBudget | None = None
             ) -> PrefillRequest:
    return PrefillRequest(request_id=request_id, token_ids=prompt,
                          block_keys=block_keys(prompt, BLOCK, worker.config.store.hash_seed),
                          decode=grant, sampling=GREEDY, fetch=fetch, budget=budget)


async def prefill(worker: WorkerNode, decode: DecodeSide, request_id: str, prompt: list[int],
                  fetch: FetchPlan | None = None):
    """One PrefillJob into a fresh reservation for prompt + 8 output tokens."""
    grant = decode.reserve(len(prompt) + GREEDY.max_tokens)
    job = PrefillJob(spec_for(worker, request_id, prompt, grant, fetch), worker, CHUNK,
                     fetch_timeout_s=5.0)
    return job, grant, await job.run()


def assert_nothing_held(shard: StoreShard, cached_blocks: int) -> None:
    stats = shard.stats()
    assert (stats.pinned_blocks, stats.private_pages) == (0, 0)
    assert stats.cached_blocks == stats.evictable_blocks == cached_blocks
    assert stats.free_pages == shard.num_pages - cached_blocks
    shard.check_integrity()


def spy_on_compute(worker: WorkerNode, on_layer=None) -> list:
    """Record the shard's stats as each compute call starts; ``on_layer(i)``
    runs in the layer hook before the job's own (i counts hook calls across
    compute calls: a job makes one per chunk)."""
    seen: list = []
    compute = worker.compute
    calls: list[int] = []

    async def spying(fn, *args):
        seen.append(worker.shard.stats())
        if on_layer is not None and args and callable(args[-1]):
            job_hook = args[-1]

            def hook(start: int, end: int, layer: int) -> None:
                on_layer(len(calls))
                calls.append(layer)
                job_hook(start, end, layer)
            args = (*args[:-1], hook)
        return await compute(fn, *args)

    worker.compute = spying
    return seen


def record_chunks(job: PrefillJob, order: list[str]) -> None:
    """Append "chunk [start, end)" to ``order`` as each chunk's first layer runs."""
    hook = job.layer_hook

    def recording_hook(loop_, abort_on_cancel=True):
        inner = hook(loop_, abort_on_cancel)

        def record(start: int, end: int, layer: int) -> None:
            if layer == 0:
                order.append(f"chunk [{start}, {end})")
            inner(start, end, layer)
        return record
    job.layer_hook = recording_hook


# ---- one job ------------------------------------------------------------------------

def list_step(worker: WorkerNode, loop: asyncio.AbstractEventLoop, queued: list,
              fn, *args) -> None:
    """From the compute thread: list a decode step ``fn(*args)`` with the
    worker (``compute_step``, on the loop) and wait until it is listed."""
    listed = threading.Event()

    def submit() -> None:
        queued.append(worker.compute_step(fn, *args))
        listed.set()
    loop.call_soon_threadsafe(submit)
    assert listed.wait(10)


async def run_recorded(worker: WorkerNode, decode: DecodeSide, order: list[str],
                       before=None, after=None, budget: PrefillBudget | None = None):
    """PROMPT_A's job, its layer hook appending "[start, end) layer l" to
    ``order``; ``before(start, layer)`` / ``after(start, layer)`` run on the
    compute thread around the job's own hook (which gives way).  Returns
    (reply, grant)."""
    grant = decode.reserve(len(PROMPT_A) + GREEDY.max_tokens)
    job = PrefillJob(spec_for(worker, "req-a", PROMPT_A, grant, budget=budget), worker, CHUNK,
                     fetch_timeout_s=5.0)
    job_hook = job.layer_hook

    def recording_hook(loop_, abort_on_cancel=True):
        inner = job_hook(loop_, abort_on_cancel)

        def record(start: int, end: int, layer: int) -> None:
            order.append(f"[{start}, {end}) layer {layer}")
            if before is not None:
                before(start, layer)
            inner(start, end, layer)
            if after is not None:
                after(start, layer)
        return record
    job.layer_hook = recording_hook
    return await job.run(), grant


@pytest.mark.parametrize("listed", ["before the boundary", "after the boundary"])
async def test_a_decode_step_waiting_runs_within_the_layer_it_was_listed_in(
        open_worker, decode, tiny_weights, listed):
    """A colocated node's decode step does not wait for the chunk that holds
    the thread (the node's StepQueue; no step ran before, so at once).
    Listed as layer 0 starts, it runs at that layer's boundary; listed just
    after the boundary gave way to nothing, it runs inside layer 0 (before
    its MLP): before layer 1 either way.  The prompt's result and its
    streamed KV do not change."""
    worker = await open_worker()
    loop = asyncio.get_running_loop()
    order: list[str] = []
    queued: list[asyncio.Future] = []

    def layer_0(start: int, layer: int) -> None:    # layer 0 of chunk 1
        if (start, layer) == (0, 0):
            list_step(worker, loop, queued, order.append, "decode step")
    hooks = {"before": layer_0} if listed == "before the boundary" else {"after": layer_0}
    reply, grant = await run_recorded(worker, decode, order, **hooks)
    await asyncio.gather(*queued)
    assert order[:3] == ["[0, 16) layer 0", "decode step", "[0, 16) layer 1"]
    assert worker.steps.between_layers == 1
    ref = reference(tiny_weights, PROMPT_A)
    assert reply.first_token == ref.token
    decode.assert_kv_landed(grant, PROMPT_A, ref)


@pytest.mark.parametrize("budget, early", [
    (None, False),                                                    # no prediction
    (PrefillBudget(prefill_s=0.001, reply_within_s=30.0), True),      # far ahead of it
    (PrefillBudget(prefill_s=0.001, reply_within_s=0.0), False)])     # already late
async def test_a_prefill_on_time_for_its_prediction_lets_steps_go_first(
        open_worker, decode, tiny_weights, budget, early):
    """A step that just ran held the thread 50 ms: by the ratio rule the
    prefill keeps it for the next 100 ms, so a second step waits for the
    chunk; a prefill still on time for the conductor's prediction lets the
    second one run at its next yield point.  Results do not change."""
    worker = await open_worker()
    loop = asyncio.get_running_loop()
    order: list[str] = []
    queued: list[asyncio.Future] = []

    def step(name: str) -> None:
        time.sleep(0.05)
        order.append(name)

    def before(start: int, layer: int) -> None:
        if (start, layer) == (0, 0):
            list_step(worker, loop, queued, step, "step 1")    # runs here: none ran lately

    def after(start: int, layer: int) -> None:
        if (start, layer) == (0, 0):
            list_step(worker, loop, queued, step, "step 2")
    reply, grant = await run_recorded(worker, decode, order, before, after, budget)
    await asyncio.gather(*queued)
    assert order[:2] == ["[0, 16) layer 0", "step 1"]
    assert (order[2] == "step 2") is early, order
    assert worker.steps.between_layers == (2 if early else 1)
    ref = reference(tiny_weights, PROMPT_A)
    assert reply.first_token == ref.token
    decode.assert_kv_landed(grant, PROMPT_A, ref)


async def test_compute_queued_meanwhile_runs_between_chunks_not_after_the_prompt(
        open_worker, decode, tiny_weights):
    """A colocated node's decode step shares the one compute thread with
    prefill: a step queued while a prompt computes must run before the
    prompt's last chunk (token spacing grows by a chunk, not a prompt), and
    the prompt's result must not change."""
    worker = await open_worker()
    loop = asyncio.get_running_loop()
    order: list[str] = []
    queued: list[asyncio.Future] = []

    def on_layer(i: int) -> None:    # on the compute thread, inside chunk 1
        if i == 0:
            loop.call_soon_threadsafe(lambda: queued.append(asyncio.ensure_future(
                worker.compute(order.append, "other work"))))
    spy_on_compute(worker, on_layer=on_layer)
    grant = decode.reserve(len(PROMPT_A) + GREEDY.max_tokens)
    job = PrefillJob(spec_for(worker, "req-a", PROMPT_A, grant), worker, CHUNK,
                     fetch_timeout_s=5.0)
    record_chunks(job, order)
    reply = await job.run()
    await asyncio.gather(*queued)
    # PROMPT_A is 40 tokens in chunks of 16: [0,16) [16,32) [32,40).
    assert order == ["chunk [0, 16)", "other work", "chunk [16, 32)", "chunk [32, 40)"]
    ref = reference(tiny_weights, PROMPT_A)
    assert reply.first_token == ref.token
    decode.assert_kv_landed(grant, PROMPT_A, ref)


def test_the_interleave_chunk_is_the_fewest_blocks_within_the_overhead_share():
    # o = 2 ms, c = 0.1 ms/token (a 16-token block: 2 + 1.5 ms).  o <= s(o + c t)
    # <=> t >= o (1 - s) / (s c): s = 0.2 -> 80 tokens = 5 blocks; s = 0.5 ->
    # 20 tokens -> 2 blocks; never above prefill_chunk (whole blocks).
    assert interleave_tokens(0.002, 0.0035, 16, 0.2, 1024) == 80
    assert interleave_tokens(0.002, 0.0035, 16, 0.5, 1024) == 32
    assert interleave_tokens(0.002, 0.0035, 16, 0.2, 50) == 48
    assert interleave_tokens(0.002, 0.0035, 16, 0.0, 1024) == 0
    # No per-chunk cost measured: one block is as efficient as any.
    assert interleave_tokens(0.0, 0.0035, 16, 0.2, 1024) == 16


def test_the_interleave_chunk_grows_to_what_a_decode_step_may_wait():
    # o = 2 ms, c = 0.1 ms/token: 20 ms fit (20 - 2) / 0.1 = 180 tokens -> 11
    # blocks = 176; 5 ms fit 30 tokens, under the overhead floor of 80.
    assert interleave_tokens(0.002, 0.0035, 16, 0.2, 1024, wait_s=0.020) == 176
    assert interleave_tokens(0.002, 0.0035, 16, 0.2, 1024, wait_s=0.005) == 80
    assert interleave_tokens(0.002, 0.0035, 16, 0.2, 1024, wait_s=0.001) == 80
    # Never above prefill_chunk, and share 0 still means no interleave size.
    assert interleave_tokens(0.002, 0.0035, 16, 0.2, 100, wait_s=1.0) == 96
    assert interleave_tokens(0.002, 0.0035, 16, 0.0, 1024, wait_s=1.0) == 0


@pytest.mark.parametrize("decoding, chunks", [
    (False, ["chunk [0, 40)"]),
    (True, ["chunk [0, 16)", "chunk [16, 32)", "chunk [32, 40)"])])
async def test_a_prefill_chunks_finer_while_decode_sequences_share_the_node(
        open_worker, decode, tiny_weights, decoding, chunks):
    """A colocated node's decode steps wait for one chunk: while sequences are
    decoding there, a prefill computes in the node's interleave size, not in
    whole prefill_chunk chunks; the result is the same."""
    worker = await open_worker()
    worker.interleave_tokens = BLOCK
    worker.decoding = lambda request_id: decoding and request_id == "req-a"
    order: list[str] = []
    grant = decode.reserve(len(PROMPT_A) + GREEDY.max_tokens)
    job = PrefillJob(spec_for(worker, "req-a", PROMPT_A, grant), worker, 3 * BLOCK,
                     fetch_timeout_s=5.0)
    record_chunks(job, order)
    reply = await job.run()
    assert order == chunks
    ref = reference(tiny_weights, PROMPT_A)
    assert reply.first_token == ref.token
    decode.assert_kv_landed(grant, PROMPT_A, ref)


async def test_first_token_and_streamed_kv_match_the_reference(open_worker, decode, tiny_weights):
    worker = await open_worker()
    job, grant, reply = await prefill(worker, decode, "req-a", PROMPT_A)
    ref = reference(tiny_weights, PROMPT_A)
    assert reply.first_token == ref.token
    assert reply.logprob == pytest.approx(ref.logprob, abs=1e-5)
    assert (reply.local_hit_tokens, reply.fetched_tokens, reply.computed_tokens) == (0, 0, 40)
    decode.assert_kv_landed(grant, PROMPT_A, ref)
    # Streamed per chunk of 16 and per layer, in compute order.
    assert [(end, layer) for end, layer, _ in job.stream_log] == [
        (16, 0), (16, 1), (32, 0), (32, 1), (40, 0), (40, 1)]
    # The two full blocks stay cached here, unpinned; the partial one was freed.
    assert_nothing_held(worker.shard, cached_blocks=2)
    keys = block_keys(PROMPT_A, BLOCK, worker.config.store.hash_seed)
    assert worker.shard.match_prefix(keys, PROMPT_A) == 2


@pytest.mark.parametrize("prompt, hit, streamed", [
    # A's two blocks reused, B's 13 tokens computed in one chunk [32, 45)
    (PROMPT_B, 32, [(45, 0), (45, 1)]),
    # all of A's two blocks match, but the last token must be computed: block 1 is redone
    (PROMPT_A[:32], 16, [(32, 0), (32, 1)]),
])
async def test_a_cached_prefix_is_reused_and_changes_nothing(open_worker, decode, tiny_weights,
                                                             prompt, hit, streamed):
    worker = await open_worker()
    await prefill(worker, decode, "req-a", PROMPT_A)
    during = spy_on_compute(worker)
    job, grant, reply = await prefill(worker, decode, "req-b", prompt)

    ref = reference(tiny_weights, prompt)
    assert reply.first_token == ref.token
    assert (reply.local_hit_tokens, reply.cached_tokens, reply.computed_tokens) == (
        hit, hit, len(prompt) - hit)
    assert [(end, layer) for end, layer, _ in job.stream_log] == streamed
    decode.assert_kv_landed(grant, prompt, ref)   # prefix pages went whole, the rest by layer
    # While it computed: the reused blocks pinned, pages for the rest private.
    (stats,) = during
    assert stats.pinned_blocks == hit // BLOCK
    assert stats.private_pages == pages_for(len(prompt)) - hit // BLOCK
    assert_nothing_held(worker.shard, cached_blocks=2)


async def test_a_reply_names_the_blocks_it_stored_and_the_batch_that_reports_them(
        open_worker, decode):
    worker = await open_worker()
    shard = worker.shard
    _, _, first = await prefill(worker, decode, "req-a", PROMPT_A)
    keys = block_keys(PROMPT_A, BLOCK, worker.config.store.hash_seed)
    # PROMPT_A's 2 full blocks, reported by the shard's next batch.
    assert first.stored == StoredBlocks(shard.events.epoch, 1, keys[:2])
    batch = shard.drain_events()
    assert (batch.seq, batch.stored) == (1, keys[:2])
    # PROMPT_B reuses both and stores none; a prompt of its own stores its one block.
    _, _, reused = await prefill(worker, decode, "req-b", PROMPT_B)
    assert reused.stored is None
    other = tokens(20, seed=9)
    _, _, fresh = await prefill(worker, decode, "req-c", other)
    assert fresh.stored == StoredBlocks(shard.events.epoch, 2,
                                        block_keys(other, BLOCK, worker.config.store.hash_seed)[:1])
    assert "stored" not in reused.to_wire() and fresh.to_wire()["stored"]["seq"] == 2


@pytest.mark.parametrize("prompt, hit", [
    (PROMPT_B, 32),
    (PROMPT_A[:32], 16),  # cached in full: the block with the last token is recomputed
])
async def test_the_shard_counts_the_prefix_tokens_actually_reused(open_worker, decode, prompt, hit):
    worker = await open_worker()
    await prefill(worker, decode, "req-a", PROMPT_A)
    before = worker.shard.stats()
    _, _, reply = await prefill(worker, decode, "req-b", prompt)
    after = worker.shard.stats()
    assert reply.cached_tokens == hit
    assert (after.query_tokens - before.query_tokens, after.hit_tokens - before.hit_tokens) == (
        len(prompt), hit)


@contextlib.asynccontextmanager
async def lease_server(peer):
    """The peer's block-lease routes, served over HTTP: (its URL, the app)."""
    app = web.Application()
    app[WORKER] = peer
    add_lease_routes(app)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")), app
    finally:
        await server.close()


async def test_a_prefix_fetched_from_a_peer_is_kept_here(open_worker, decode, tiny_weights):
    """B's first two blocks are READ from a peer that computed A (under a lease
    it serves over HTTP), published here, and not recomputed."""
    worker, peer = await open_worker("prefill-A"), await open_worker("prefill-B")
    await prefill(peer, decode, "req-peer", PROMPT_A)
    worker.engine.add_segment(peer.engine.segment_descriptor())
    async with lease_server(peer) as (url, app):
        job, grant, reply = await prefill(worker, decode, "req-b", PROMPT_B,
                                          FetchPlan(source_url=url, to_block=2))
        leases = app[LEASES].leases
    ref = reference(tiny_weights, PROMPT_B)
    assert reply.fetch_failed == ""
    assert (reply.local_hit_tokens, reply.fetched_tokens, reply.computed_tokens) == (0, 32, 13)
    assert reply.first_token == ref.token
    decode.assert_kv_landed(grant, PROMPT_B, ref)
    assert leases == {}                                # released before the reply
    assert_nothing_held(peer.shard, cached_blocks=2)
    assert_nothing_held(worker.shard, cached_blocks=2)  # the fetched blocks stay here
    keys = block_keys(PROMPT_B, BLOCK, worker.config.store.hash_seed)
    assert worker.shard.match_prefix(keys, PROMPT_B) == 2


async def test_a_failed_fetch_is_recomputed(open_worker, decode, tiny_weights):
    """The peer holds none of the prefix: the job says so and computes it all."""
    worker, peer = await open_worker("prefill-A"), await open_worker("prefill-B")
    async with lease_server(peer) as (url, _):
        _, grant, reply = await prefill(worker, decode, "req-b", PROMPT_B,
                                        FetchPlan(source_url=url, to_block=2))
    assert "no longer holds" in reply.fetch_failed
    assert (reply.fetched_tokens, reply.computed_tokens) == (0, 45)
    ref = reference(tiny_weights, PROMPT_B)
    assert reply.first_token == ref.token
    decode.assert_kv_landed(grant, PROMPT_B, ref)
    assert_nothing_held(peer.shard, cached_blocks=0)
    assert_nothing_held(worker.shard, cached_blocks=2)


# ---- the queue ----------------------------------------------------------------------

@pytest.fixture
async def service_on(open_worker):
    made: list[PrefillService] = []

    async def make(worker: WorkerNode, chunk_size: int, **kw) -> PrefillService:
        svc = PrefillService(worker, chunk_size, max_queue=8, fetch_timeout_s=5.0, **kw)
        svc.start()
        made.append(svc)
        return svc

    yield make
    for svc in made:
        await svc.close()


async def submit_together_and_check(svc, worker, decode, tiny_weights, prompts,
                                    budgets: dict[str, PrefillBudget] | None = None) -> None:
    """Queue every prompt before the service takes its next step (one
    gather), then check each reply and its KV against the reference."""
    grants = {rid: decode.reserve(len(p) + GREEDY.max_tokens) for rid, p in prompts.items()}
    budgets = budgets or {}
    replies = await asyncio.gather(*(svc.submit(spec_for(worker, rid, p, grants[rid],
                                                         budget=budgets.get(rid)))
                                     for rid, p in prompts.items()))
    for (rid, prompt), reply in zip(prompts.items(), replies):
        ref = reference(tiny_weights, prompt)
        assert reply.first_token == ref.token, rid
        decode.assert_kv_landed(grants[rid], prompt, ref)


async def test_short_prompts_queued_together_share_one_pass(open_worker, decode, service_on,
                                                            tiny_weights):
    worker = await open_worker()
    svc = await service_on(worker, chunk_size=64)
    prompts = {"req-1": tokens(20, seed=3), "req-2": tokens(37, seed=4), "req-3": PROMPT_A}
    await submit_together_and_check(svc, worker, decode, tiny_weights, prompts)
    assert (svc.batches, svc.batched_requests) == (1, 3)
    assert svc.completed == 3
    # The replies go out before the batch's cleanup: give the queue its turn.
    for _ in range(100):
        if not svc.running:
            break
        await asyncio.sleep(0.01)
    load = svc.load()
    assert (load.queue_len, load.queued_tokens, load.completed, load.failed) == (0, 0, 3, 0)
    assert load.request_ids == []
    assert_nothing_held(worker.shard, cached_blocks=1 + 2 + 2)


async def test_a_batch_stops_at_its_token_budget(open_worker, decode, service_on, tiny_weights):
    """Every request of a batch waits for the whole pass: the budget bounds
    what the head of the queue waits for the requests behind it."""
    worker = await open_worker()
    svc = await service_on(worker, chunk_size=64, batch_tokens=64)
    # 20 + 37 = 57 tokens fit in 64; the third (30) would make 87: it runs next, alone.
    prompts = {"req-1": tokens(20, seed=3), "req-2": tokens(37, seed=4),
               "req-3": tokens(30, seed=6)}
    await submit_together_and_check(svc, worker, decode, tiny_weights, prompts)
    assert (svc.batches, svc.batched_requests) == (1, 2)


# (predicted compute s, reply due s after receipt) of req-1, req-2, req-3,
# and the passes they run in.  The seconds are far above the time the test
# itself takes between the submits and the pass, so only the sums decide: a
# request joins while the predicted compute of the pass so far plus its own
# stays within every earlier member's due time.
BUDGET_CASES = {
    # 1 + 3 = 4 <= 5: req-2 joins; 4 + 2 = 6 > 5 (req-1's): req-3 runs next.
    "the_head_binds": ([(1.0, 5.0), (3.0, 60.0), (2.0, 60.0)],
                       [["req-1", "req-2"], ["req-3"]]),
    # 1 + 1 = 2 <= 60: req-2 joins; 2 + 1 = 3 > 2.5, req-2's own due time.
    "a_later_member_binds": ([(1.0, 60.0), (1.0, 2.5), (1.0, 60.0)],
                             [["req-1", "req-2"], ["req-3"]]),
    # 1 + 1 + 1 = 3 <= 60 for each.
    "all_fit": ([(1.0, 60.0), (1.0, 60.0), (1.0, 60.0)], [["req-1", "req-2", "req-3"]]),
    # The head is due at once: nothing may delay it; the two behind share a pass.
    "the_head_is_due_now": ([(1.0, 0.0), (1.0, 60.0), (1.0, 60.0)],
                            [["req-1"], ["req-2", "req-3"]]),
}
PROMPTS_3 = {"req-1": tokens(20, seed=3), "req-2": tokens(17, seed=4), "req-3": tokens(12, seed=6)}


def record_steps(svc: PrefillService) -> list[list[str]]:
    """The request ids of each step the service takes, in order."""
    steps: list[list[str]] = []
    take = svc._next_step

    def taking(now: float):
        step = take(now)
        steps.append([item.job.spec.request_id for item in step])
        return step

    svc._next_step = taking
    return steps


@pytest.mark.parametrize("case", BUDGET_CASES)
async def test_a_request_joins_a_pass_only_while_every_earlier_reply_stays_on_time(
        open_worker, decode, service_on, tiny_weights, case):
    """What a request behind the head adds to a batched pass delays every
    first token in it: it joins only within the slack the conductor's
    predictions left (PrefillRequest.budget), FIFO order kept."""
    worker = await open_worker()
    svc = await service_on(worker, chunk_size=64)
    steps = record_steps(svc)
    budgets, passes = BUDGET_CASES[case]
    await submit_together_and_check(svc, worker, decode, tiny_weights, PROMPTS_3,
                                    {rid: PrefillBudget(*b) for rid, b in zip(PROMPTS_3, budgets)})
    assert steps == passes
    assert svc.completed == 3
    # Each pass cut short by a due time, not by the token budget, is counted.
    assert svc.load().batch_joins_declined == len(passes) - 1


async def test_with_batching_within_predictions_off_the_token_budget_alone_decides(
        open_worker, decode, service_on, tiny_weights):
    worker = await open_worker()
    svc = await service_on(worker, chunk_size=64, batch_within_predictions=False)
    steps = record_steps(svc)
    await submit_together_and_check(svc, worker, decode, tiny_weights, PROMPTS_3,
                                    {rid: PrefillBudget(1.0, 0.0) for rid in PROMPTS_3})
    assert steps == [["req-1", "req-2", "req-3"]]
    assert svc.load().batch_joins_declined == 0


async def test_a_batched_reply_does_not_wait_for_the_finish_of_the_one_ahead(
        open_worker, decode, service_on, tiny_weights, monkeypatch):
    """The first request of a batch is held in its finish (as by slow KV
    sends): the second's reply still goes out, and the first's follows once
    it is let go."""
    worker = await open_worker()
    svc = await service_on(worker, chunk_size=64)
    held = asyncio.Event()
    real_finish = PrefillJob.finish

    async def finish(job, *args):
        if job.spec.request_id == "req-1":
            await held.wait()
        return await real_finish(job, *args)

    monkeypatch.setattr(PrefillJob, "finish", finish)
    prompts = {"req-1": tokens(20, seed=3), "req-2": tokens(37, seed=4)}
    grants = {rid: decode.reserve(len(p) + GREEDY.max_tokens) for rid, p in prompts.items()}
    first, second = (asyncio.ensure_future(svc.submit(spec_for(worker, rid, p, grants[rid])))
                     for rid, p in prompts.items())
    # Bounded: without the fix the second waits for the first, which waits for `held`.
    done, _ = await asyncio.wait({first, second}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    assert done == {second} and (svc.batches, svc.batched_requests) == (1, 2)
    held.set()
    for rid, reply in zip(prompts, await asyncio.gather(first, second)):
        ref = reference(tiny_weights, prompts[rid])
        assert reply.first_token == ref.token, rid
        decode.assert_kv_landed(grants[rid], prompts[rid], ref)


async def test_a_job_cancelled_mid_compute_frees_everything(open_worker, decode, service_on):
    """The cancel arrives after the first chunk's layers have gone out: the
    prefix pins, the new pages and the sends in flight are all let go."""
    worker = await open_worker()
    await prefill(worker, decode, "req-a", PROMPT_A)
    svc = await service_on(worker, chunk_size=CHUNK)
    prompt = PROMPT_A[:32] + tokens(40, seed=5)        # chunks [32,48) [48,64) [64,72)
    grant = decode.reserve(len(prompt) + GREEDY.max_tokens)
    loads = []   # the heartbeat's figures while the job computes
    during = spy_on_compute(worker, on_layer=lambda i: (i == 1 and loads.append(svc.load()))
                            or (i == 2 and svc.cancel("req-c")))
    submit = asyncio.ensure_future(svc.submit(spec_for(worker, "req-c", prompt, grant)))
    await asyncio.sleep(0)             # submitted: the job is queued
    job = svc.jobs["req-c"]
    with pytest.raises(PrefillCancelled):
        await asyncio.wait_for(submit, 10)
    assert [(end, layer) for end, layer, _ in job.stream_log] == [(48, 0), (48, 1)]
    # It said how long the running request had computed (the conductor's
    # estimate of it is that much spent).
    assert list(loads[0].running_s) == ["req-c"] and loads[0].running_s["req-c"] >= 0
    assert all(task.done() for task in job.sends)
    assert during[0].pinned_blocks == 2 and during[0].private_pages == 3
    assert svc.cancel("req-c") is False and svc.load().failed == 1
    assert_nothing_held(worker.shard, cached_blocks=2)   # A's blocks, nothing of the cancelled job


async def test_a_job_cancelled_while_queued_takes_nothing(open_worker, decode, service_on):
    worker = await open_worker()
    svc = await service_on(worker, chunk_size=CHUNK)
    grant = decode.reserve(len(PROMPT_A) + GREEDY.max_tokens)
    submit = asyncio.ensure_future(svc.submit(spec_for(worker, "req-q", PROMPT_A, grant)))
    await asyncio.sleep(0)             # queued; the queue task has not taken it yet
    assert svc.load().request_ids == ["req-q"]   # what the heartbeat tells the conductor
    assert svc.load().running_s == {}             # queued, not running
    assert svc.cancel("req-q") is True
    with pytest.raises(PrefillCancelled, match="queued"):
        await asyncio.wait_for(submit, 10)
    assert_nothing_held(worker.shard, cached_blocks=0)
    assert not decode.kv[grant.pages].any()


@pytest.mark.parametrize("prompt, fetch_to_block, computed", [
    (PROMPT_B, None, 13),                 # A's 2 blocks held here: 13 tokens to compute
    (PROMPT_A[:32], None, 16),            # held in full: the last token's block is recomputed
    (tokens(50, seed=6), None, 50),       # nothing held
    (tokens(50, seed=6), 2, 18),          # 2 blocks planned to come from a peer
])
async def test_the_queue_counts_the_tokens_it_will_compute(open_worker, decode, prompt,
                                                           fetch_to_block, computed):
    """The load report's queue (queued_prefill_s) divides queued tokens by the
    measured rate of *computed* tokens, so the queue counts computed tokens:
    counting whole prompts overstated a cache-hit-heavy node's queue."""
    worker = await open_worker()
    await prefill(worker, decode, "req-a", PROMPT_A)
    svc = PrefillService(worker, CHUNK, max_queue=8, fetch_timeout_s=5.0)   # not started: it queues
    grant = decode.reserve(len(prompt) + GREEDY.max_tokens)
    fetch = None if fetch_to_block is None else FetchPlan("http://127.0.0.1:9", fetch_to_block)
    submit = asyncio.ensure_future(svc.submit(spec_for(worker, "req-q", prompt, grant, fetch)))
    await asyncio.sleep(0)
    load = svc.load()
    assert load.queued_tokens == computed
    assert load.queued_prefill_s == pytest.approx(computed / svc.tokens_per_s)
    await svc.close()
    with pytest.raises(PrefillCancelled):
        await submit


async def test_a_reply_says_the_cpu_seconds_its_compute_took(open_worker, decode, service_on):
    """What a node at idle priority is fitted on: the compute thread's CPU
    time, which on one thread can never exceed the compute's wall time; a
    batched pass shares it by tokens, like its wall time."""
    worker = await open_worker()
    _, _, reply = await prefill(worker, decode, "req-a", PROMPT_A)
    cpu, wall = reply.timings.compute_cpu_s, reply.timings.compute_s
    assert 0 < cpu <= wall
    svc = await service_on(worker, chunk_size=64)
    prompts = {"req-1": tokens(20, seed=3), "req-2": tokens(40, seed=4)}
    grants = {rid: decode.reserve(len(p) + GREEDY.max_tokens) for rid, p in prompts.items()}
    one, two = await asyncio.gather(*(svc.submit(spec_for(worker, rid, p, grants[rid]))
                                      for rid, p in prompts.items()))
    assert svc.batches == 1
    assert 0 < one.timings.compute_cpu_s <= one.timings.compute_s
    # Shares by tokens to compute: 20 and 40.
    assert two.timings.compute_cpu_s == pytest.approx(2 * one.timings.compute_cpu_s, rel=1e-3)
    assert worker.compute_cpu_s() > 0


async def test_a_batched_pass_is_charged_once_to_its_requests(open_worker, decode, service_on):
    """The heartbeat charges each request of a batched pass its share of the
    time so far, so the whole counts the pass once; each reply says the part
    of the pass spent on the requests ahead of it."""
    worker = await open_worker()
    svc = await service_on(worker, chunk_size=64)
    seen = []   # (load, the earliest start, when the load was read) during the pass

    real = worker.runner.prefill_batch

    def prefill_batch(requests, layer_hook, yield_point=None):
        def hook(i, start, end, layer):
            if not seen:   # the first layer's KV is out: the pass is under way
                seen.append((svc.load(), min(item.started_at for item in svc.running),
                             time.perf_counter()))
            layer_hook(i, start, end, layer)
        return real(requests, layer_hook=hook, yield_point=yield_point)
    worker.runner.prefill_batch = prefill_batch
    prompts = {"req-1": tokens(20, seed=3), "req-2": tokens(40, seed=4)}
    grants = {rid: decode.reserve(len(p) + GREEDY.max_tokens) for rid, p in prompts.items()}
    one, two = await asyncio.gather(*(svc.submit(spec_for(worker, rid, p, grants[rid]))
                                      for rid, p in prompts.items()))
    assert svc.batches == 1
    load, first_start, read_at = seen[0]
    assert set(load.running_s) == {"req-1", "req-2"}
    assert sum(load.running_s.values()) <= read_at - first_start + 1e-6
    assert one.timings.batched_ahead_s == 0.0
    # req-1's 20 tokens of 60 ran ahead of req-2: its share of the pass.
    assert two.timings.batched_ahead_s == pytest.approx(one.timings.compute_s, rel=1e-3)
    # ... and req-2's 40 behind req-1: req-1's first token waited for them too.
    assert one.timings.batched_behind_s == pytest.approx(two.timings.compute_s, rel=1e-3)
    assert two.timings.batched_behind_s == 0.0


# ---- where a reply's time went --------------------------------------------------------

BLOCKED_S = 0.5   # the compute thread is held this long before the prefill's work


def hold_the_thread(worker: WorkerNode) -> asyncio.Future:
    """Occupy the compute thread for BLOCKED_S from now (queued at once)."""
    return asyncio.get_running_loop().run_in_executor(worker.compute_pool, time.sleep, BLOCKED_S)


async def test_a_reply_tells_its_wait_for_the_thread_and_its_steps_from_its_compute(
        open_worker, decode):
    """A chunk queued behind other work on the compute thread waited for it:
    that wait is thread_wait_s, not compute; a decode step run inside the
    prefill is gave_way_s, neither."""
    worker = await open_worker()
    loop = asyncio.get_running_loop()
    order: list[str] = []
    queued: list[asyncio.Future] = []

    def step() -> None:
        time.sleep(0.2)

    def before(start: int, layer: int) -> None:
        if (start, layer) == (0, 0):
            list_step(worker, loop, queued, step)
    held = hold_the_thread(worker)
    reply, _ = await run_recorded(worker, decode, order, before)
    await asyncio.gather(held, *queued)
    t = reply.timings
    assert worker.steps.between_layers == 1
    assert t.gave_way_s >= 0.2
    assert t.thread_wait_s >= BLOCKED_S - 0.1
    assert t.compute_s < 0.2


async def test_a_batched_pass_waiting_for_the_thread_does_not_count_the_wait_as_compute(
        open_worker, decode, service_on):
    worker = await open_worker()
    svc = await service_on(worker, chunk_size=64)
    prompts = {"req-1": tokens(20, seed=3), "req-2": tokens(40, seed=4)}
    grants = {rid: decode.reserve(len(p) + GREEDY.max_tokens) for rid, p in prompts.items()}
    held = hold_the_thread(worker)
    one, two = await asyncio.gather(*(svc.submit(spec_for(worker, rid, p, grants[rid]))
                                      for rid, p in prompts.items()))
    await held
    assert svc.batches == 1
    for reply in (one, two):
        assert reply.timings.thread_wait_s >= BLOCKED_S - 0.1
        assert reply.timings.gave_way_s == 0.0
    # The pass's own time, shared by tokens (20 and 40): not the wait.
    assert one.timings.compute_s + two.timings.compute_s < BLOCKED_S


async def test_a_batched_pass_counts_only_its_own_cpu_seconds(open_worker, decode, service_on):
    """Work the compute thread does around the pass (here 30 ms of CPU spun
    on it just before) is not the pass's: its CPU seconds stay within its
    wall time."""
    worker = await open_worker()
    svc = await service_on(worker, chunk_size=64)
    real = worker.compute

    def spin(fn, *args):
        end = time.thread_time() + 0.03
        while time.thread_time() < end:
            pass
        return fn(*args)

    async def compute_after_spinning(fn, *args):
        return await real(spin, fn, *args)

    worker.compute = compute_after_spinning
    prompts = {"req-1": tokens(20, seed=3), "req-2": tokens(40, seed=4)}
    grants = {rid: decode.reserve(len(p) + GREEDY.max_tokens) for rid, p in prompts.items()}
    replies = await asyncio.gather(*(svc.submit(spec_for(worker, rid, p, grants[rid]))
                                     for rid, p in prompts.items()))
    assert svc.batches == 1
    for reply in replies:
        assert 0 < reply.timings.compute_cpu_s <= reply.timings.compute_s
