"""StoreShard unit tests: object API, pages, pins, LRU order, guards, async waits, tiers."""

from __future__ import annotations

import asyncio
import ctypes
import mmap

import numpy as np
import pytest

from kvstore import (BlockPinnedError, KeyCollisionError, PageLayout, StoreConfig, StoreFullError,
                     StoreShard, block_keys)

LAYOUT = PageLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8)  # 4 KiB pages


def make_shard(pages: int = 4, **cfg) -> StoreShard:
    config = StoreConfig(block_size=16, capacity_bytes=pages * LAYOUT.page_bytes, **cfg)
    return StoreShard(config, LAYOUT)


@pytest.fixture
def shard():
    s = make_shard()
    yield s
    s.check_integrity()
    s.close()


def page(fill: int) -> bytes:
    return bytes([fill % 256]) * LAYOUT.page_bytes


def tokens(i: int) -> list[int]:
    return list(range(16 * i, 16 * (i + 1)))


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="store.block_size"):
        StoreConfig(block_size=8)
    with pytest.raises(ValueError, match="store.block_size"):
        StoreConfig(block_size=1024)
    with pytest.raises(ValueError, match="store.capacity_bytes"):
        StoreConfig(capacity_bytes=0)
    with pytest.raises(ValueError, match="store.hash_seed"):
        StoreConfig(hash_seed=-1)
    with pytest.raises(ValueError, match="layout.block_size"):
        StoreShard(StoreConfig(block_size=32, capacity_bytes=1 << 20), LAYOUT)
    with pytest.raises(ValueError, match="smaller than one page"):
        StoreShard(StoreConfig(block_size=16, capacity_bytes=100), LAYOUT)


def test_buffer_is_one_page_aligned_writable_region(shard: StoreShard) -> None:
    buf = shard.buffer
    assert not buf.readonly and buf.nbytes == 4 * LAYOUT.page_bytes
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert addr % mmap.PAGESIZE == 0


def test_put_get_is_zero_copy(shard: StoreShard) -> None:
    assert shard.put(11, page(7), tokens(0))
    view = shard.get(11)
    assert view is not None and bytes(view) == page(7)
    off = shard.page_of(11) * LAYOUT.page_bytes
    shard.buffer[off] = 99            # a write through the buffer shows in the view
    assert view[0] == 99
    assert shard.get(12) is None
    st = shard.stats()
    assert (st.hits, st.misses, st.cached_blocks, st.stored_blocks) == (1, 1, 1, 1)


def test_put_accepts_any_contiguous_buffer_and_partial_pages(shard: StoreShard) -> None:
    arr = np.arange(10, dtype=np.float32)
    assert shard.put(1, arr)
    assert np.array_equal(np.frombuffer(shard.get(1), dtype=np.float32), arr)
    with pytest.raises(ValueError, match="bytes"):
        shard.put(2, page(0) + b"x")
    with pytest.raises(ValueError, match="contiguous"):
        shard.put(3, np.arange(20, dtype=np.float32)[::2])
    with pytest.raises(ValueError, match="key"):
        shard.put(-5, b"x")
    with pytest.raises(ValueError, match="one block"):
        shard.put(4, b"x", token_ids=[1, 2, 3])


def test_duplicate_put_never_overwrites(shard: StoreShard) -> None:
    assert shard.put(5, page(1), tokens(0))
    assert not shard.put(5, page(2), tokens(0))
    assert bytes(shard.get(5)) == page(1)
    assert shard.stats().stored_blocks == 1


def test_collision_guard(shard: StoreShard) -> None:
    shard.put(5, page(1), tokens(0))
    with pytest.raises(KeyCollisionError):
        shard.put(5, page(2), tokens(1))
    keys = [5]
    assert shard.match_prefix(keys, tokens(0)) == 1
    assert shard.match_prefix(keys, tokens(1)) == 0
    assert shard.acquire_prefix(keys, tokens(1)) == []
    assert shard.stats().collisions == 2
    # A block stored without tokens adopts the first tokens it is published with.
    shard.put(6, page(3))
    shard.put(6, page(3), tokens(2))
    with pytest.raises(KeyCollisionError):
        shard.put(6, page(3), tokens(3))


def test_lru_evicts_least_recently_used(shard: StoreShard) -> None:
    for k in range(4):
        shard.put(k, page(k))
    shard.get(0)                       # 0 becomes most recently used
    assert shard.lru_keys() == [1, 2, 3, 0]
    shard.put(10, page(10))            # evicts 1
    assert not shard.contains(1) and shard.contains(0)
    assert shard.stats().evictions == 1
    assert shard.match_prefix([0, 1]) == 1   # queries do not touch
    assert shard.lru_keys() == [2, 3, 0, 10]


def test_pinned_blocks_are_never_evicted_and_full_fails_cleanly(shard: StoreShard) -> None:
    for k in range(4):
        shard.put(k, page(k), pin=True)
    with pytest.raises(StoreFullError, match="4 pinned"):
        shard.put(9, page(9))
    with pytest.raises(StoreFullError):
        shard.allocate(1)
    with pytest.raises(BlockPinnedError):
        shard.remove(2)
    for k in range(4):
        assert bytes(shard.get(k)) == page(k)
    shard.unpin(2)
    assert shard.put(9, page(9))
    assert not shard.contains(2) and shard.contains(9)


def test_allocate_is_all_or_nothing(shard: StoreShard) -> None:
    shard.put(1, page(1))
    shard.put(2, page(2), pin=True)
    before = (shard.lru_keys(), shard.stats())
    with pytest.raises(StoreFullError):
        shard.allocate(4)
    assert (shard.lru_keys(), shard.stats()) == before
    pages = shard.allocate(3)           # 2 free + evict key 1
    assert len(set(pages)) == 3 and not shard.contains(1)
    assert shard.stats().private_pages == 3
    shard.free(pages[:1])
    with pytest.raises(ValueError, match="not private"):
        shard.free(pages[:1])
    with pytest.raises(ValueError, match="duplicate"):
        shard.free([pages[1], pages[1]])
    assert shard.stats().private_pages == 2


def test_publish_private_pages(shard: StoreShard) -> None:
    p, q = shard.allocate(2)
    shard.page_view(p)[:] = page(4)
    res = shard.publish(40, p, tokens(4), pin=True)
    assert res == (p, True) and shard.pins(40) == 1
    assert bytes(shard.get(40)) == page(4)
    with pytest.raises(ValueError, match="not private"):
        shard.publish(41, p)
    # The same key again: the cached copy wins, the page stays the caller's.
    dup = shard.publish(40, q, tokens(4))
    assert dup == (p, False) and shard.stats().private_pages == 1
    dup = shard.publish(40, q, tokens(4), free_duplicate=True)
    assert dup == (p, False) and shard.stats().private_pages == 0
    shard.release([40])
    assert shard.key_of_page(p) == 40


def test_acquire_and_release_tail_before_head(shard: StoreShard) -> None:
    toks = list(range(64))
    keys = block_keys(toks, 16)
    for i, k in enumerate(keys[:3]):
        shard.put(k, page(i), toks[16 * i:16 * (i + 1)])
    pages = shard.acquire_prefix(keys, toks)
    assert pages == [shard.page_of(k) for k in keys[:3]]
    assert all(shard.pins(k) == 1 for k in keys[:3])
    st = shard.stats()
    assert (st.query_tokens, st.hit_tokens) == (64, 48)
    shard.release(keys[:3])
    # Tail released first, so it is evicted first; the shared head lives longest.
    assert shard.lru_keys() == [keys[2], keys[1], keys[0]]
    with pytest.raises(ValueError, match="not pinned"):
        shard.release(keys[:1])
    pages = shard.acquire_prefix(keys[:2])
    with pytest.raises(ValueError, match="more often"):
        shard.release_pages([pages[0], pages[0]])
    assert shard.pins(keys[0]) == 1       # nothing changed by the failed call
    shard.release_pages(pages)
    assert shard.lru_keys() == [keys[2], keys[1], keys[0]]


def test_match_prefix_counts_leading_hits_only(shard: StoreShard) -> None:
    shard.put(1, page(1))
    shard.put(3, page(3))
    assert shard.match_prefix([1, 2, 3]) == 1
    assert shard.match_prefix([]) == 0
    assert shard.match_prefix([2, 3]) == 0


def test_remove_and_replicas(shard: StoreShard) -> None:
    shard.put(1, page(1))
    assert shard.replicas(1) == 1
    assert shard.change_replica(1, 3) == 1 and shard.replicas(1) == 3
    with pytest.raises(ValueError):
        shard.change_replica(1, 0)
    with pytest.raises(KeyError):
        shard.change_replica(2, 2)
    assert shard.remove(1) and not shard.remove(1)
    assert shard.stats().free_pages == 4


def test_model_runtime_can_view_pages_as_a_tensor(shard: StoreShard) -> None:
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    kv = torch.frombuffer(shard.buffer, dtype=torch.float32).view(
        shard.num_pages, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    (p,) = shard.allocate(1)
    kv[p, 1].fill_(2.5)                 # layer 1 of page p, K and V
    shard.publish(77, p)
    layer1 = np.frombuffer(shard.memory.layer_view(p, 1), dtype=np.float32)
    layer0 = np.frombuffer(shard.memory.layer_view(p, 0), dtype=np.float32)
    assert (layer1 == 2.5).all() and not (layer0 == 2.5).any()
    off, n = LAYOUT.layer_range(p, 1)
    assert bytes(shard.get(77))[off - p * LAYOUT.page_bytes:][:n] == bytes(layer1)
    del kv


async def test_allocate_wait_gets_pages_when_released() -> None:
    s = make_shard(2)
    try:
        s.put(1, page(1), pin=True)
        s.put(2, page(2), pin=True)
        asyncio.get_running_loop().call_later(0.05, s.unpin, 1)
        pages = await s.allocate_wait(1, timeout_s=5)
        assert len(pages) == 1 and not s.contains(1)
        asyncio.get_running_loop().call_later(0.05, s.free, pages)
        assert await s.put_wait(3, page(3), timeout_s=5)
        s.check_integrity()
    finally:
        s.close()


async def test_allocate_wait_is_bounded() -> None:
    s = make_shard(2, max_wait_s=0.2)
    try:
        s.put(1, page(1), pin=True)
        s.put(2, page(2), pin=True)
        with pytest.raises(StoreFullError, match="after waiting"):
            await s.allocate_wait(1, timeout_s=60)     # capped by max_wait_s
        with pytest.raises(StoreFullError, match="has 2"):
            await s.allocate_wait(3)
        with pytest.raises(StoreFullError):
            await s.put_wait(3, page(3), timeout_s=0.05)
    finally:
        s.close()


def test_ssd_tier_demotes_and_promotes(tmp_path) -> None:
    s = make_shard(2, ssd_tier=True, ssd_path=str(tmp_path / "pool"),
                   ssd_capacity_bytes=2 * LAYOUT.page_bytes)
    try:
        for k in range(3):
            s.put(k, page(k), tokens(k))
        assert s.tier_of(0) == "ssd" and s.tier_of(2) == "dram"
        assert s.contains(0) and s.match_prefix([0, 1, 2]) == 3
        assert bytes(s.get(0)) == page(0)          # promoted; 1 demoted
        assert s.tier_of(0) == "dram" and s.tier_of(1) == "ssd"
        s.put(3, page(3))                          # demotes 2
        s.put(4, page(4))                          # demotes 0; SSD full: drops 1
        assert s.tier_of(1) is None
        batch = s.drain_events()
        assert batch is not None and batch.evicted == [1]
        assert sorted(batch.stored) == [0, 2, 3, 4]
        assert sorted(s.snapshot().keys) == [0, 2, 3, 4]
        s.check_integrity()
        st = s.stats()
        assert (st.demotions, st.promotions, st.ssd_drops, st.ssd_blocks) == (4, 1, 1, 2)
        # acquire_prefix promotes and pins; here promoting 0 demotes 3, and the
        # full SSD tier drops its oldest block, 2, so the prefix stops there.
        pages = s.acquire_prefix([0, 2], tokens(0) + tokens(2))
        assert len(pages) == 1 and bytes(s.get(0)) == page(0)
        assert s.tier_of(2) is None and s.tier_of(3) == "ssd"
        s.pin(4)
        assert s.acquire_prefix([3]) == []         # on SSD, but no DRAM page can be had
        assert s.tier_of(3) == "ssd"
        s.release([0])
        s.unpin(4)
        assert s.remove(3) and s.tier_of(3) is None
        batch = s.drain_events()
        assert batch is not None and sorted(batch.evicted) == [2, 3] and batch.seq == 2
        s.put(5, page(5))                          # demotes 0 (least recently used)
        assert s.tier_of(0) == "ssd"
        with pytest.raises(KeyCollisionError):      # the guard covers the SSD tier too
            s.put(0, page(0), tokens(9))
        assert not s.put(4, page(4), tokens(4))     # 4 had no tokens: adopts them
        s.check_integrity()
    finally:
        s.close()


def test_ssd_write_failure_drops_the_block_cleanly(tmp_path, monkeypatch) -> None:
    s = make_shard(2, ssd_tier=True, ssd_path=str(tmp_path / "pool"),
                   ssd_capacity_bytes=4 * LAYOUT.page_bytes)
    try:
        import kvstore.ssd

        def no_space(*_args):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(kvstore.ssd.os, "pwrite", no_space)
        for k in range(3):
            s.put(k, page(k))
        assert s.tier_of(0) is None and s.contains(1) and s.contains(2)
        batch = s.drain_events()
        assert batch is not None and batch.evicted == [0]
        st = s.stats()
        assert (st.ssd_drops, st.demotions, st.free_pages) == (1, 0, 0)
        s.check_integrity()
        monkeypatch.undo()
        s.put(3, page(3))                          # writes work again: 1 is demoted
        assert s.tier_of(1) == "ssd" and bytes(s.get(1)) == page(1)
        s.check_integrity()
    finally:
        s.close()
