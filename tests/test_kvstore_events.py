"""Block events and snapshots: a consumer following batches stays equal to the shard."""

from __future__ import annotations

import random

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import EventBatch, PageLayout, Snapshot, StoreConfig, StoreShard
from kvstore.events import EventLog
from kvstore.metrics import register_store_metrics

LAYOUT = PageLayout(num_layers=1, block_size=16, num_kv_heads=1, head_dim=8)


def make_shard(pages: int, **cfg) -> StoreShard:
    return StoreShard(StoreConfig(block_size=16, capacity_bytes=pages * LAYOUT.page_bytes, **cfg),
                      LAYOUT)


class Consumer:
    """What the conductor does with a shard's batches."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.seq = 0
        self.keys: set[int] = set()
        self.resyncs = 0

    def load(self, snap: Snapshot) -> None:
        self.epoch, self.seq, self.keys = snap.epoch, snap.seq, set(snap.keys)
        self.resyncs += 1

    def apply(self, batch: EventBatch, shard: StoreShard) -> None:
        if batch.resync or batch.epoch != self.epoch or batch.seq != self.seq + 1:
            self.load(shard.snapshot())
            if batch.seq <= self.seq:   # the snapshot already covers this batch
                return
        self.keys -= set(batch.evicted)
        self.keys |= set(batch.stored)
        self.seq = batch.seq


def test_net_effect_and_sequence() -> None:
    log = EventLog(epoch=7)
    assert log.drain() is None
    log.stored(1)
    log.stored(2)
    log.evicted(1)
    log.stored(3)
    log.evicted(3)
    log.stored(3)
    b = log.drain()
    assert b == EventBatch(7, 1, stored=[2, 3], evicted=[1])
    assert log.drain() is None
    log.evicted(2)
    assert log.drain().seq == 2
    assert log.snapshot([5]) == Snapshot(7, 2, [5])
    assert orjson.loads(orjson.dumps(b.to_dict())) == {"epoch": 7, "seq": 1, "stored": [2, 3],
                                                      "evicted": [1], "resync": False}


def test_overflow_asks_for_resync() -> None:
    log = EventLog(max_pending=3)
    for k in range(10):
        log.stored(k)
    b = log.drain()
    assert b is not None and b.resync and b.stored == [] and b.seq == 1
    log.stored(1)
    assert not log.drain().resync


def test_consumer_tracks_shard_through_random_churn() -> None:
    rng = random.Random(3)
    shard = make_shard(8, max_pending_events=50)
    consumer = Consumer()
    consumer.load(shard.snapshot())
    try:
        for _ in range(2000):
            op = rng.random()
            key = rng.randrange(40)
            if op < 0.6:
                shard.put(key, bytes([key]) * 8)
            elif op < 0.75:
                shard.remove(key)
            else:
                shard.get(key)
            if rng.random() < 0.05:
                # Occasionally lose a batch: the consumer must notice the gap.
                batch = shard.drain_events()
                if batch is not None and rng.random() < 0.8:
                    consumer.apply(batch, shard)
        batch = shard.drain_events()
        if batch is not None:
            consumer.apply(batch, shard)
        assert consumer.keys == set(shard.snapshot().keys)
        assert consumer.resyncs > 1
    finally:
        shard.close()


def test_epoch_differs_per_shard() -> None:
    a, b = make_shard(1), make_shard(1)
    try:
        assert a.snapshot().epoch != b.snapshot().epoch
    finally:
        a.close()
        b.close()


def test_metrics_text() -> None:
    shard = make_shard(4)
    try:
        registry = CollectorRegistry()
        register_store_metrics(shard, registry, labels={"node": "p0"})
        shard.put(1, b"x" * 8)
        shard.put(2, b"y" * 8, pin=True)
        shard.get(1)
        shard.get(3)
        shard.acquire_prefix([1, 3])
        for k in (4, 5, 6):
            shard.put(k, b"z")
        text = generate_latest(registry).decode()
        samples = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert samples["mooncaked_kv_cache_usage_perc"].value == 1.0
        assert samples["mooncaked_kv_cache_usage_perc"].labels == {"node": "p0"}
        assert samples["mooncaked_kv_cache_pinned_perc"].value == 0.5   # 2 pinned of 4 pages
        assert samples["mooncaked_prefix_cache_queries_total"].value == 32
        assert samples["mooncaked_prefix_cache_hits_total"].value == 16
        assert samples["mooncaked_kv_cache_evictions_total"].value == 1
        assert samples["mooncaked_kv_cache_lookups_total"].value == 1
        assert samples["mooncaked_kv_cache_lookup_misses_total"].value == 1
        # A second shard in the same process registers into its own registry.
        other = make_shard(1)
        register_store_metrics(other, CollectorRegistry())
        other.close()
    finally:
        shard.close()
