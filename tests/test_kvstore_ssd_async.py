"""The SSD tier's background writes: on an event loop a demotion's pwrite runs on the
pool's writer thread, and the shard's invariants hold while it is in flight
(a block being written is read from its copy, never from its slot; a slot being
written is never reused; a failed write drops the block cleanly)."""

from __future__ import annotations

import asyncio
import random
import threading

from kvstore import PageLayout, StoreConfig, StoreShard
from kvstore.ssd import SsdPool

from waiting import eventually

LAYOUT = PageLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8)  # 4 KiB pages
PB = LAYOUT.page_bytes


def make_shard(tmp_path, pages: int = 2, ssd_pages: int = 4, **cfg) -> StoreShard:
    config = StoreConfig(block_size=16, capacity_bytes=pages * PB, ssd_tier=True,
                         ssd_path=str(tmp_path / "pool"), ssd_capacity_bytes=ssd_pages * PB, **cfg)
    return StoreShard(config, LAYOUT)


def page(fill: int) -> bytes:
    return bytes([fill % 256]) * PB


def pool_of(shard: StoreShard) -> SsdPool:
    return shard._ssd.pool  # the tier's pool: the tests hold its writer


class GatedWrites:
    """A pwrite that blocks until the test opens the gate (bounded: it fails
    the write after ``limit_s`` so that a broken build cannot hang the run)."""

    def __init__(self, pool: SsdPool, limit_s: float = 5.0) -> None:
        self.real = pool._pwrite
        self.gate = threading.Event()
        self.started = threading.Event()
        self.finished = threading.Event()
        self.limit_s = limit_s
        self.error: OSError | None = None
        pool._pwrite = self  # type: ignore[method-assign]

    def __call__(self, slot: int, data: memoryview) -> None:
        self.started.set()
        try:
            if not self.gate.wait(self.limit_s):
                raise OSError("the gate was never opened: the event loop was blocked")
            if self.error is not None:
                raise self.error
            self.real(slot, data)
        finally:
            self.finished.set()


async def test_event_loop_runs_while_a_demotion_write_is_in_flight(tmp_path) -> None:
    s = make_shard(tmp_path)
    try:
        writes = GatedWrites(pool_of(s))
        s.put(0, page(0))
        s.put(1, page(1))
        progress: list[str] = []

        async def other_work() -> None:
            # Runs only if the loop is free while the write blocks on the gate.
            await asyncio.sleep(0)
            progress.append("in flight" if not writes.finished.is_set() else "after")
            writes.gate.set()

        other = asyncio.create_task(other_work())
        s.put(2, page(2))                       # evicts 0: its demotion blocks in pwrite
        assert s.tier_of(0) == "ssd"            # held (in flight) and reported as held
        await asyncio.wait_for(other, 10)
        assert progress == ["in flight"]
        await eventually(lambda: pool_of(s).writes == 1 and pool_of(s).writes_in_flight == 0)
        assert s.tier_of(0) == "ssd" and bytes(s.get(0)) == page(0)  # promoted from the slot
        assert s.stats().ssd_drops == 0
        s.check_integrity()
    finally:
        writes.gate.set()
        s.close()


async def test_a_block_being_written_is_read_from_its_copy_and_its_slot_kept(tmp_path) -> None:
    s = make_shard(tmp_path, ssd_pages=2)
    try:
        writes = GatedWrites(pool_of(s))
        s.put(0, page(0))
        s.put(1, page(1))
        s.put(2, page(2))                       # demotes 0 (write gated)
        await asyncio.to_thread(writes.started.wait, 5)
        assert pool_of(s).writes_in_flight == 1
        # Promoting 0 demotes 1; the block read back is the in-memory copy.
        assert bytes(s.get(0)) == page(0) and s.tier_of(0) == "dram"
        s.check_integrity()
        # 0's slot is still being written: it is not free although 0 left the tier.
        pool = pool_of(s)
        assert pool.free_slots == 0 and pool.writes_in_flight == 2
        # The tier is full of in-flight writes: one more demotion is not stored
        # (the block leaves the node) instead of overwriting a slot mid-write.
        s.put(3, page(3))                       # demotes 2
        assert s.tier_of(2) is None
        batch = s.drain_events()
        assert batch is not None and batch.evicted == [2]
        writes.gate.set()
        await eventually(lambda: pool.writes_in_flight == 0)
        s.check_integrity()
        assert pool.free_slots == 1             # 0's slot came back once its write was done
        assert bytes(s.get(1)) == page(1)
        s.check_integrity()
    finally:
        writes.gate.set()
        s.close()


async def test_a_failed_background_write_drops_the_block_cleanly(tmp_path) -> None:
    s = make_shard(tmp_path)
    try:
        writes = GatedWrites(pool_of(s))
        writes.error = OSError(28, "No space left on device")
        for k in range(3):
            s.put(k, page(k))                   # 0 demoted; its write will fail
        s.drain_events()
        writes.gate.set()
        pool = pool_of(s)
        await eventually(lambda: pool.writes_in_flight == 0)
        assert s.tier_of(0) is None and not s.contains(0)
        batch = s.drain_events()
        assert batch is not None and batch.evicted == [0]
        st = s.stats()
        assert (st.ssd_drops, st.ssd_blocks, pool.write_errors) == (1, 0, 1)
        assert pool.free_slots == pool.num_slots
        s.check_integrity()
        writes.error = None                     # the disk has room again
        s.put(3, page(3))                       # demotes 1
        s.wait_ssd_writes()
        assert bytes(s.get(1)) == page(1)
        s.check_integrity()
    finally:
        writes.gate.set()
        s.close()


async def test_a_block_removed_mid_write_gives_its_slot_back_after_the_write(tmp_path) -> None:
    s = make_shard(tmp_path)
    try:
        writes = GatedWrites(pool_of(s))
        for k in range(3):
            s.put(k, page(k))
        pool = pool_of(s)
        assert s.remove(0) and not s.contains(0)
        assert pool.free_slots == pool.num_slots - 1  # still being written
        s.check_integrity()
        writes.gate.set()
        await eventually(lambda: pool.writes_in_flight == 0)
        assert pool.free_slots == pool.num_slots and len(pool) == 0
        # A fresh DRAM copy of a key whose SSD write is in flight replaces it.
        writes.gate.clear()
        writes.finished.clear()
        s.put(3, page(3))                       # demotes 1 (gated)
        assert s.put(1, page(1)) and s.tier_of(1) == "dram"
        writes.gate.set()
        s.wait_ssd_writes()
        assert s.tier_of(1) == "dram" and 1 not in pool
        s.check_integrity()
    finally:
        writes.gate.set()
        s.close()


async def test_write_backlog_is_bounded(tmp_path) -> None:
    s = make_shard(tmp_path, ssd_pages=8)
    pool = pool_of(s)
    pool.max_write_backlog_bytes = 2 * PB
    try:
        writes = GatedWrites(pool)
        for k in range(6):
            s.put(k, page(k))                   # demotes 0..3; only two fit the backlog
        assert [s.tier_of(k) for k in range(4)] == ["ssd", "ssd", None, None]
        assert pool.backlog_drops == 2
        writes.gate.set()
        s.wait_ssd_writes()
        s.put(6, page(6))                       # the backlog has drained: 4 is stored
        assert s.tier_of(4) == "ssd"
        s.check_integrity()
    finally:
        writes.gate.set()
        s.close()


async def test_random_operations_with_background_writes_keep_every_byte(tmp_path) -> None:
    """A bounded random walk on a loop, real writes, completions interleaved at
    random points: every block still held reads back byte-identical."""
    rng = random.Random(7)
    s = make_shard(tmp_path, pages=3, ssd_pages=5)
    try:
        data = {k: rng.randbytes(PB) for k in range(12)}
        for _ in range(400):
            k = rng.randrange(12)
            op = rng.random()
            if op < 0.45:
                s.put(k, data[k])
            elif op < 0.8:
                got = s.get(k)
                assert got is None or bytes(got) == data[k]
            elif op < 0.9:
                s.remove(k)
            else:
                await asyncio.sleep(0)          # let finished writes come back
            s.check_integrity()
        s.wait_ssd_writes()
        for k in range(12):
            if s.contains(k):
                assert bytes(s.get(k)) == data[k]
        s.check_integrity()
        assert pool_of(s).write_errors == 0
    finally:
        s.close()


def test_without_an_event_loop_writes_are_inline(tmp_path) -> None:
    s = make_shard(tmp_path)
    try:
        for k in range(3):
            s.put(k, page(k))
        assert pool_of(s).writes == 1 and pool_of(s).writes_in_flight == 0
    finally:
        s.close()


def test_close_waits_for_writes_in_flight(tmp_path) -> None:
    async def go() -> SsdPool:
        s = make_shard(tmp_path)
        writes = GatedWrites(pool_of(s))
        for k in range(3):
            s.put(k, page(k))
        threading.Timer(0.05, writes.gate.set).start()
        s.close()                               # joins the writer before closing the fd
        assert writes.finished.is_set()
        return pool_of(s)

    asyncio.run(go())


class GatedReads:
    """The pool's worker-thread read, blocked until the test opens the gate
    (bounded like GatedWrites)."""

    def __init__(self, pool: SsdPool, limit_s: float = 5.0) -> None:
        self.real = pool.read_bytes
        self.gate = threading.Event()
        self.limit_s = limit_s
        pool.read_bytes = self  # type: ignore[method-assign]

    def __call__(self, entry, out) -> None:
        if not self.gate.wait(self.limit_s):
            raise OSError("the gate was never opened: the event loop was blocked")
        self.real(entry, out)


async def test_event_loop_runs_while_a_promotion_read_is_in_flight(tmp_path) -> None:
    s = make_shard(tmp_path)
    try:
        for k in range(3):
            s.put(k, page(k))                   # 0 goes to SSD
        s.wait_ssd_writes()
        assert s.tier_of(0) == "ssd"
        reads = GatedReads(pool_of(s))
        progress: list[str] = []

        async def other_work() -> None:
            await asyncio.sleep(0)
            progress.append("ran during the read")
            reads.gate.set()

        other = asyncio.create_task(other_work())
        promote = asyncio.create_task(s.promote_prefix([0, 1, 2]))
        await asyncio.sleep(0)
        assert s.stats().private_pages == 1      # the page being read into, not yet a block
        # Two pages: 0 comes back (evicting 1), then 1 (evicting 2); 2 would
        # need a page, but both hold the pinned prefix [0, 1]: it stops there.
        assert await asyncio.wait_for(promote, 10) == 2
        assert (s.tier_of(1), s.tier_of(2)) == ("dram", "ssd")
        await other
        assert progress == ["ran during the read"]
        assert s.tier_of(0) == "dram" and bytes(s.get(0)) == page(0)
        assert s.acquire_prefix([0]) == [s.page_of(0)]
        s.release([0])
        assert s.stats().private_pages == 0
        s.check_integrity()
    finally:
        s.close()


async def test_a_promotion_cancelled_mid_read_keeps_the_page_until_the_read_ends(tmp_path) -> None:
    s = make_shard(tmp_path)
    try:
        for k in range(3):
            s.put(k, page(k))
        s.wait_ssd_writes()
        reads = GatedReads(pool_of(s))
        promote = asyncio.create_task(s.promote_prefix([0]))
        await asyncio.sleep(0.05)
        promote.cancel()
        await asyncio.gather(promote, return_exceptions=True)
        assert s.stats().private_pages == 1      # the thread still writes into it
        reads.gate.set()
        await eventually(lambda: s.stats().private_pages == 0)
        assert s.tier_of(0) == "dram" and bytes(s.get(0)) == page(0)   # the read's block kept
        s.check_integrity()
    finally:
        s.close()
