"""Property tests: the shard against a plain reference model under random operation
sequences (hypothesis stateful testing), with and without the SSD tier.

Checked after every step: capacity never exceeded; a pinned block never
evicted or overwritten; data read back byte-identical (cached blocks, private
pages, promoted blocks); LRU order; the index, the pages and the tiers
consistent (``check_integrity``); StoreFullError exactly when no page can be
had.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections import OrderedDict

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore import (BlockPinnedError, KeyCollisionError, PageLayout, StoreConfig, StoreFullError,
                     StoreShard)

pytestmark = pytest.mark.slow  # two state machines of ~10 s each

LAYOUT = PageLayout(num_layers=2, block_size=16, num_kv_heads=1, head_dim=4)  # 1 KiB pages
NUM_PAGES = 6
KEYS = st.integers(0, 11)
PB = LAYOUT.page_bytes


def tokens_of(key: int) -> list[int]:
    return [key] * LAYOUT.block_size


def blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


class Full(Exception):
    pass


class Model:
    """What the shard must do, written as simply as possible."""

    def __init__(self, num_pages: int, ssd_slots: int) -> None:
        self.num_pages = num_pages
        self.ssd_slots = ssd_slots
        self.blocks: dict[int, bytes] = {}      # DRAM key -> data
        self.pins: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()   # unpinned, oldest first
        self.private: dict[int, bytes] = {}     # page -> what the owner wrote
        self.ssd: OrderedDict[int, bytes] = OrderedDict()  # oldest first
        self.reserved = 0                       # SSD slots held by a promotion

    def free_pages(self) -> int:
        return self.num_pages - len(self.blocks) - len(self.private)

    def take(self, n: int) -> None:
        short = n - self.free_pages()
        if short > len(self.lru):
            raise Full
        for _ in range(max(short, 0)):
            self.evict()

    def evict(self) -> None:
        key, _ = self.lru.popitem(last=False)
        data = self.blocks.pop(key)
        self.pins.pop(key)
        if not self.ssd_slots:
            return
        if len(self.ssd) + self.reserved >= self.ssd_slots:
            if not self.ssd:
                return              # every slot reserved: the block is dropped
            self.ssd.popitem(last=False)
        self.ssd[key] = data

    def insert(self, key: int, data: bytes, pin: bool) -> None:
        self.blocks[key] = data
        self.pins[key] = 1 if pin else 0
        if not pin:
            self.lru[key] = None

    def use(self, key: int, pin: bool) -> None:
        if pin:
            if self.pins[key] == 0:
                del self.lru[key]
            self.pins[key] += 1
        elif self.pins[key] == 0:
            self.lru.move_to_end(key)

    def unpin(self, key: int) -> None:
        self.pins[key] -= 1
        if self.pins[key] == 0:
            self.lru[key] = None

    def promote(self, key: int) -> bool:
        if key not in self.ssd:
            return False
        data = self.ssd.pop(key)
        self.reserved = 1
        try:
            self.take(1)
        except Full:
            self.ssd[key] = data
            return False
        finally:
            self.reserved = 0
        self.insert(key, data, pin=False)
        return True


class ShardMachine(RuleBasedStateMachine):
    ssd_slots = 0

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="kvstore-props-")
        cfg = StoreConfig(block_size=16, capacity_bytes=NUM_PAGES * PB + 100,
                          ssd_tier=bool(self.ssd_slots), ssd_path=f"{self.tmp}/pool",
                          ssd_capacity_bytes=max(self.ssd_slots, 1) * PB)
        self.shard = StoreShard(cfg, LAYOUT)
        self.model = Model(NUM_PAGES, self.ssd_slots)

    def teardown(self) -> None:
        self.shard.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------------ rules

    @rule(key=KEYS, seed=st.integers(0, 1 << 16), size=st.integers(1, PB), pin=st.booleans())
    def put(self, key: int, seed: int, size: int, pin: bool) -> None:
        data = blob(seed, size)
        m = self.model
        expect_new = key not in m.blocks
        if key in m.blocks:
            m.use(key, pin)
        else:
            try:
                m.take(1)
            except Full:
                try:
                    self.shard.put(key, data, tokens_of(key), pin=pin)
                except StoreFullError:
                    return
                raise AssertionError("put() should have raised StoreFullError") from None
            m.ssd.pop(key, None)    # a fresh DRAM copy replaces an SSD copy
            m.insert(key, data, pin)
        assert self.shard.put(key, data, tokens_of(key), pin=pin) == expect_new

    @rule(key=KEYS, pin=st.booleans())
    def get(self, key: int, pin: bool) -> None:
        m = self.model
        hit = key in m.blocks or m.promote(key)
        if hit:
            m.use(key, pin)
        view = self.shard.get(key, pin=pin)
        if not hit:
            assert view is None
        else:
            assert view is not None and bytes(view) == m.blocks[key]

    @rule(key=KEYS)
    def unpin(self, key: int) -> None:
        m = self.model
        if m.pins.get(key, 0) > 0:
            m.unpin(key)
            self.shard.unpin(key)
        elif key in m.blocks:
            try:
                self.shard.unpin(key)
            except ValueError:
                return
            raise AssertionError("unpin of an unpinned block must fail")

    @rule(key=KEYS)
    def remove(self, key: int) -> None:
        m = self.model
        if m.pins.get(key, 0) > 0:
            try:
                self.shard.remove(key)
            except BlockPinnedError:
                return
            raise AssertionError("remove of a pinned block must fail")
        existed = key in m.blocks or key in m.ssd
        if key in m.blocks:
            del m.blocks[key], m.pins[key], m.lru[key]
        m.ssd.pop(key, None)
        assert self.shard.remove(key) == existed

    @rule(key=KEYS, seed=st.integers(0, 1 << 16))
    def colliding_put(self, key: int, seed: int) -> None:
        if key in self.model.blocks or key in self.model.ssd:
            try:
                self.shard.put(key, blob(seed, 8), tokens_of(key + 100))
            except KeyCollisionError:
                return
            raise AssertionError("a put with other tokens for a cached key must fail")

    @rule(n=st.integers(0, 3), seed=st.integers(0, 1 << 16))
    def allocate(self, n: int, seed: int) -> None:
        m = self.model
        try:
            m.take(n)
        except Full:
            try:
                self.shard.allocate(n)
            except StoreFullError:
                return
            raise AssertionError("allocate() should have raised StoreFullError") from None
        pages = self.shard.allocate(n)
        assert len(set(pages)) == n and not set(pages) & set(m.private)
        for i, p in enumerate(pages):
            data = blob(seed + i, PB)
            self.shard.page_view(p)[:] = data
            m.private[p] = data

    @precondition(lambda self: self.model.private)
    @rule(i=st.integers(0, 100), key=KEYS, pin=st.booleans())
    def publish(self, i: int, key: int, pin: bool) -> None:
        m = self.model
        page = sorted(m.private)[i % len(m.private)]
        res = self.shard.publish(key, page, tokens_of(key), pin=pin)
        if key in m.blocks:
            assert not res.stored and res.page_id == self.shard.page_of(key)
            m.use(key, pin)
        else:
            assert res.stored and res.page_id == page
            m.ssd.pop(key, None)
            m.insert(key, m.private.pop(page), pin)

    @precondition(lambda self: self.model.private)
    @rule(i=st.integers(0, 100))
    def free(self, i: int) -> None:
        page = sorted(self.model.private)[i % len(self.model.private)]
        del self.model.private[page]
        self.shard.free([page])

    @rule(keys=st.lists(KEYS, max_size=5, unique=True))
    def acquire_and_maybe_release(self, keys: list[int]) -> None:
        m = self.model
        got: list[int] = []
        for k in keys:
            if k not in m.blocks and not m.promote(k):
                break
            m.use(k, pin=True)
            got.append(k)
        pages = self.shard.acquire_prefix(keys, [t for k in keys for t in tokens_of(k)])
        assert pages == [self.shard.page_of(k) for k in got]
        if len(got) % 2 == 0:       # release half of the time: tail first
            for k in reversed(got):
                m.unpin(k)
            self.shard.release(got)

    @rule(keys=st.lists(KEYS, max_size=6))
    def match(self, keys: list[int]) -> None:
        n = 0
        for k in keys:
            if k not in self.model.blocks and k not in self.model.ssd:
                break
            n += 1
        assert self.shard.match_prefix(keys) == n

    # ------------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        s, m = self.shard, self.model
        s.check_integrity()
        st_ = s.stats()
        assert st_.used_bytes <= st_.capacity_bytes
        assert st_.cached_blocks + st_.private_pages + st_.free_pages == NUM_PAGES
        assert st_.ssd_blocks <= self.ssd_slots
        assert st_.free_pages == m.free_pages()
        assert s.lru_keys() == list(m.lru)
        for key, data in m.blocks.items():
            view = s.peek(key)
            assert view is not None and bytes(view) == data, f"block {key} changed"
            assert s.pins(key) == m.pins[key]
        for key, n in m.pins.items():
            if n:
                assert s.tier_of(key) == "dram", f"pinned block {key} left DRAM"
        for page, data in m.private.items():
            assert bytes(s.page_view(page)) == data, f"private page {page} changed"
        assert {k for k in range(12) if s.tier_of(k) == "ssd"} == set(m.ssd)
        assert {k for k in range(12) if s.tier_of(k) == "dram"} == set(m.blocks)


class ShardWithSsdMachine(ShardMachine):
    ssd_slots = 3


SETTINGS = settings(max_examples=150, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

TestShardProperties = ShardMachine.TestCase
TestShardProperties.settings = SETTINGS
TestShardWithSsdProperties = ShardWithSsdMachine.TestCase
TestShardWithSsdProperties.settings = SETTINGS
