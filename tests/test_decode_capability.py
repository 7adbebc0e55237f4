"""Late one-sided WRITEs of a released reservation (issue 15).

The decode side is a real ``DecodeBatcher`` over a store shard registered
with a tcp ``TransferEngine``, its write guard installed as the decode role
installs it (``roles.decode.app.install_write_guard``); the "prefill node" is
a second engine WRITEing (page, layer) ranges into the granted pages, with
the grant's capability, as ``PrefillJob.send_blocks`` does.  The oracle: a
reservation released while its WRITEs are still coming, whose pages go to
another request at once, leaves that request's pages exactly as it filled
them.  The colocated case runs a real ``PrefillJob`` whose "decode node" is
its own worker (the local copy path).
"""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import orjson
import pytest

from kvstore import StoreConfig, StoreFullError, StoreShard
from kvstore.keys import block_keys
from model.config import DUMMY_CONFIGS, RuntimeConfig, page_layout
from model.runner import ModelRunner, kv_pages_view
from model.sampling import SamplingParams
from mooncaked.node.config import NodeConfig
from mooncaked.node.context import NodeContext
from mooncaked.node.messages import MessageError, PrefillRequest, ReservationGrant
from mooncaked.node.sections import NodeSection
from rdma import frames
from rdma.config import TransferConfig
from rdma.engine import TransferEngine
from rdma.types import WRITE, TransferError, TransferRequest, TransferState
from roles.decode.app import install_write_guard
from roles.decode.batcher import DecodeBatcher
from roles.prefill.job import PrefillJob
from roles.worker_node import WorkerNode
from tests.cluster_helpers import tokens
from tests.waiting import eventually

BLOCK = 16
PAGES = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)



@dataclass
class DecodeWorker:
    """What the decode role uses of a WorkerNode: shard, layout, runner,
    compute, and the transfer engine with the shard registered as a region."""
    shard: StoreShard
    layout: object
    runner: ModelRunner
    pool: ThreadPoolExecutor
    engine: TransferEngine
    region_id: int = 0

    async def compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def compute_step(self, fn, *args, first_decode=False):
        return await self.compute(fn, *args)


@pytest.fixture
async def decode_node(tiny_weights):
    """A decode node of ``PAGES`` pages: (batcher, worker); every reservation of
    all ``PAGES`` pages gets the same pages, so a released reservation's pages
    are the next one's."""
    layout = page_layout(tiny_weights.config, BLOCK, tiny_weights.dtype_name)
    shard = StoreShard(StoreConfig(block_size=BLOCK, capacity_bytes=PAGES * layout.page_bytes,
                                   prefault=False, hugepages=False), layout)
    engine = TransferEngine(TransferConfig(transport="tcp"), "decode")
    await engine.start()
    worker = DecodeWorker(shard, layout, ModelRunner(tiny_weights, kv_pages_view(shard.buffer, layout)),
                          ThreadPoolExecutor(max_workers=1), engine)
    worker.region_id = engine.register_local_memory(shard.buffer).id
    batcher = DecodeBatcher(worker, 8, 60.0, [])
    install_write_guard(worker, batcher)
    batcher.run()
    yield batcher, worker
    await batcher.close()
    await engine.close()
    worker.pool.shutdown(wait=True)
    del worker.runner
    shard.close()


@pytest.fixture
async def prefill_engine(decode_node):
    """The prefill side: an engine whose region 0 holds a known source pattern
    (one slice per layer range, one connection: the stream is a long queue)."""
    _, worker = decode_node
    eng = TransferEngine(TransferConfig(transport="tcp", slice_bytes=512, connections_per_peer=1,
                                        max_inflight_per_endpoint=1), "prefill")
    await eng.start()
    src = bytearray(b"P" * (PAGES * worker.layout.page_bytes))
    eng.register_local_memory(src)
    eng.add_segment(worker.engine.segment_descriptor())
    yield eng
    await eng.close()


def kv_writes(worker: DecodeWorker, grant: ReservationGrant) -> list[TransferRequest]:
    """One WRITE per (page, layer) into the granted pages, layer by layer as
    the layer hook posts them."""
    layout = worker.layout
    return [TransferRequest(WRITE, 0, b * layout.page_bytes + layer * layout.layer_bytes, layout.layer_bytes,
                            grant.segment, layout.layer_range(page, layer)[0], grant.region,
                            capability=grant.capability)
            for layer in range(layout.num_layers) for b, page in enumerate(grant.pages)]


def reserve_all(batcher: DecodeBatcher, worker: DecodeWorker, request_id: str) -> ReservationGrant:
    pages = batcher.reserve(request_id, PAGES * BLOCK)
    return ReservationGrant(pages=pages, segment=worker.engine.name, region=worker.region_id,
                            capability=batcher.capability(request_id))


def fill(worker: DecodeWorker, pages: list[int], byte: int) -> bytes:
    """The next owner's KV: a known pattern in each of its pages."""
    pb = worker.layout.page_bytes
    for p in pages:
        worker.shard.buffer[p * pb:(p + 1) * pb] = bytes([byte]) * pb
    return bytes([byte]) * pb


def pages_hold(worker: DecodeWorker, pages: list[int], want: bytes) -> list[int]:
    """The pages of ``pages`` that do not hold exactly ``want``."""
    pb = worker.layout.page_bytes
    return [p for p in pages if bytes(worker.shard.buffer[p * pb:(p + 1) * pb]) != want]


def test_the_capability_crosses_the_wire_inside_the_grant():
    grant = ReservationGrant(pages=[4, 5], segment="decode-0", region=1, capability=(1 << 64) - 1)
    assert ReservationGrant.from_wire(orjson.loads(orjson.dumps(grant.to_wire()))) == grant
    spec = PrefillRequest(request_id="r", token_ids=list(range(20)), block_keys=[9], decode=grant)
    assert PrefillRequest.from_wire(orjson.loads(orjson.dumps(spec.to_wire()))).decode.capability == grant.capability
    # No capability: the grant's wire shape is the one nodes spoke before, and decodes to 0.
    plain = ReservationGrant(pages=[4], segment="decode-0")
    assert "capability" not in plain.to_wire() and ReservationGrant.from_wire(plain.to_wire()).capability == 0
    for bad in (1 << 64, -1, "7", 1.5):
        with pytest.raises(MessageError) as exc:
            PrefillRequest.from_wire({**spec.to_wire(), "decode": {**grant.to_wire(), "capability": bad}})
        assert exc.value.field.endswith("decode.capability")


async def test_the_grant_carries_a_fresh_capability_and_granted_writes_land(decode_node, prefill_engine):
    batcher, worker = decode_node
    grant = reserve_all(batcher, worker, "a")
    assert grant.capability != 0
    await prefill_engine.transfer(kv_writes(worker, grant))
    assert pages_hold(worker, grant.pages, b"P" * worker.layout.page_bytes) == []
    batcher.release("a", "cancelled")
    again = reserve_all(batcher, worker, "b")
    assert set(again.pages) == set(grant.pages) and again.capability not in (0, grant.capability)


async def test_writes_posted_before_a_release_never_reach_the_next_owner(decode_node, prefill_engine):
    """The prefill node posted its WRITEs; the conductor cancels (the prefill's
    cancel is only a flag) and the decode node frees the pages at once; a new
    request gets those very pages and fills them.  None of the late WRITEs may land."""
    batcher, worker = decode_node
    a = reserve_all(batcher, worker, "a")
    writes = kv_writes(worker, a)
    await prefill_engine.transfer(writes[:2])            # the first layers went out and landed
    bid = prefill_engine.allocate_batch(len(writes) - 2)
    await prefill_engine.submit_transfer(bid, writes[2:])  # posted, not landed yet
    assert batcher.release("a", "cancelled")
    b = reserve_all(batcher, worker, "b")
    assert set(b.pages) == set(a.pages)                  # reused at once: nothing fenced them
    want = fill(worker, b.pages, 0x5B)
    statuses = await prefill_engine.wait(bid, timeout=20)
    prefill_engine.free_batch(bid)
    assert pages_hold(worker, b.pages, want) == []
    assert all(s.state == TransferState.FAILED and "refused" in s.reason for s in statuses), statuses
    assert worker.engine.stats()["refused_writes"] >= 1


async def test_a_stream_still_running_after_the_release_never_reaches_the_next_owner(
        decode_node, prefill_engine):
    """The same race with the stream running on its own: a prefill that keeps
    computing and sending layer after layer while the reservation goes."""
    batcher, worker = decode_node
    a = reserve_all(batcher, worker, "a")
    writes = kv_writes(worker, a) * 50                   # a long prefill: many chunks, every layer
    started = asyncio.Event()
    sent: list[int] = []

    async def stream() -> str:
        for i, w in enumerate(writes):
            try:
                await prefill_engine.transfer([w])
            except TransferError as exc:
                return exc.reason
            sent.append(i)
            if len(sent) == 3:
                started.set()
        return "all landed"

    task = asyncio.create_task(stream())
    await asyncio.wait_for(started.wait(), 10)
    assert batcher.release("a", "expired")
    # A WRITE may be landing at this very moment: its pages stay fenced until
    # its last byte is in, so the next reservation may have to wait for them.
    b = None
    while b is None:
        try:
            b = reserve_all(batcher, worker, "b")
        except StoreFullError:
            assert batcher.load().fenced_pages > 0
            await asyncio.sleep(0.001)
    assert set(b.pages) == set(a.pages)
    want = fill(worker, b.pages, 0xA7)
    ended = await asyncio.wait_for(task, 30)
    assert pages_hold(worker, b.pages, want) == []
    assert "refused" in ended and len(sent) < len(writes)


def _raw_conn(eng: TransferEngine) -> socket.socket:
    nic = eng.segment_descriptor()["nics"][0]
    s = socket.create_connection((nic["host"], nic["port"]), timeout=5)
    frames.client_handshake(s, "")
    return s


async def test_pages_with_a_write_landing_stay_fenced_until_its_last_byte(decode_node):
    """A slow sender: its WRITE was admitted before the release and is still
    arriving.  Those bytes cannot be stopped, so the pages must not be reused
    until they are in; then they are free at once."""
    batcher, worker = decode_node
    grant = reserve_all(batcher, worker, "a")
    page, pb = grant.pages[1], worker.layout.page_bytes
    s = await asyncio.to_thread(_raw_conn, worker.engine)
    try:
        s.sendall(frames.pack_header(None, frames.OP_WRITE, grant.region, page * pb, pb, 1,
                                     capability=grant.capability) + b"L" * (pb // 2))
        await eventually(lambda: batcher.grants.landing(grant.capability) == 1)
        assert batcher.release("a", "cancelled")
        assert batcher.load().fenced_pages == PAGES
        assert worker.shard.stats().free_pages == 0
        with pytest.raises(StoreFullError):
            batcher.reserve("b", BLOCK)
        s.sendall(b"L" * (pb // 2))
        ack = await asyncio.to_thread(frames.recv_bytes, s, frames.HEADER_SIZE)
        assert frames.unpack_header(None, ack)[:2] == (frames.OP_WRITE_ACK, frames.STATUS_OK)
        await eventually(lambda: worker.shard.stats().free_pages == PAGES)
        assert batcher.load().fenced_pages == 0
        b = reserve_all(batcher, worker, "b")
        want = fill(worker, b.pages, 0x33)
        # Anything more from that sender is refused.
        s.sendall(frames.pack_header(None, frames.OP_WRITE, grant.region, page * pb, 8, 2,
                                     capability=grant.capability) + b"too-late")
        ack = await asyncio.to_thread(frames.recv_bytes, s, frames.HEADER_SIZE)
        assert frames.unpack_header(None, ack)[:2] == (frames.OP_WRITE_ACK, frames.STATUS_REFUSED)
        assert pages_hold(worker, b.pages, want) == []
    finally:
        s.close()


async def test_close_frees_pages_a_write_still_fences(decode_node):
    batcher, worker = decode_node
    grant = reserve_all(batcher, worker, "a")
    pb = worker.layout.page_bytes
    s = await asyncio.to_thread(_raw_conn, worker.engine)
    try:
        s.sendall(frames.pack_header(None, frames.OP_WRITE, grant.region, 0, pb, 1,
                                     capability=grant.capability) + b"x")
        await eventually(lambda: batcher.grants.landing(grant.capability) == 1)
        batcher.release("a", "cancelled")
        assert batcher.load().fenced_pages == PAGES
        await batcher.close()                       # the node is stopping
        assert batcher.load().fenced_pages == 0
        assert worker.shard.stats().free_pages == PAGES
    finally:
        s.close()
    await eventually(lambda: batcher.grants.landing(grant.capability) == 0)
    worker.shard.check_integrity()                  # the late "quiet" did not free them twice


# -- colocated: the local copy path -----------------------------------------------------

def colocated_config(pages: int = 64) -> NodeConfig:
    layout = page_layout(DUMMY_CONFIGS["tiny"], BLOCK)
    return NodeConfig(
        node=NodeSection(role="colocated", node_id="colo-0"),
        store=StoreConfig(block_size=BLOCK, capacity_bytes=pages * layout.page_bytes,
                          prefault=False, hugepages=False),
        transfer=TransferConfig(transport="tcp"),
        model=RuntimeConfig(model="tiny", prefill_chunk=BLOCK))


@pytest.fixture
async def colocated():
    worker = await WorkerNode.open(NodeContext(colocated_config()))
    batcher = DecodeBatcher(worker, 8, 60.0, [])
    install_write_guard(worker, batcher)
    batcher.run()
    yield worker, batcher
    await batcher.close()
    await worker.close()


def colocated_grant(worker: WorkerNode, batcher: DecodeBatcher, request_id: str, n: int) -> ReservationGrant:
    pages = batcher.reserve(request_id, n)
    return ReservationGrant(pages=pages, segment=worker.engine.name, region=worker.region_id,
                            capability=batcher.capability(request_id))


def job_for(worker: WorkerNode, request_id: str, prompt: list[int], grant: ReservationGrant) -> PrefillJob:
    spec = PrefillRequest(request_id=request_id, token_ids=prompt,
                          block_keys=block_keys(prompt, BLOCK, worker.config.store.hash_seed),
                          decode=grant, sampling=GREEDY)
    return PrefillJob(spec, worker, BLOCK, fetch_timeout_s=5.0, prefix_cache=False)


async def test_colocated_local_copy_lands_in_granted_pages(colocated):
    worker, batcher = colocated
    prompt = tokens(40, seed=7)
    grant = colocated_grant(worker, batcher, "a", len(prompt) + GREEDY.max_tokens)
    job = job_for(worker, "a", prompt, grant)
    await job.run()
    pb = worker.layout.page_bytes
    buf = worker.shard.buffer
    for b, page in enumerate(grant.pages[:3]):       # the prompt's 3 blocks, copied whole
        src = job.table[b]
        assert bytes(buf[page * pb:(page + 1) * pb]) == bytes(buf[src * pb:(src + 1) * pb]) != bytes(pb)
    assert worker.engine.stats()["refused_writes"] == 0


async def test_colocated_local_copy_of_a_released_reservation_is_refused(colocated):
    """The conductor gave up on the request (its reservation released) but the
    prefill never heard: its local copies must not reach the pages' next owner."""
    worker, batcher = colocated
    prompt = tokens(40, seed=8)
    n = len(prompt) + GREEDY.max_tokens
    a = colocated_grant(worker, batcher, "a", n)
    job = job_for(worker, "a", prompt, a)
    batcher.release("a", "expired")
    b = colocated_grant(worker, batcher, "b", n)
    assert set(b.pages) == set(a.pages)               # the free list hands them out again first
    pb = worker.layout.page_bytes
    for p in b.pages:
        worker.shard.buffer[p * pb:(p + 1) * pb] = b"\x77" * pb
    with pytest.raises(TransferError, match="refused"):
        await job.run()
    for p in b.pages:
        assert bytes(worker.shard.buffer[p * pb:(p + 1) * pb]) == b"\x77" * pb, f"page {p} overwritten"
    assert worker.engine.stats()["refused_writes"] >= 1
    stats = worker.shard.stats()
    assert stats.pinned_blocks == 0 and stats.private_pages == len(b.pages)  # only b's reservation
