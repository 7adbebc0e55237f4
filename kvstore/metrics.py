"""Prometheus collector for a store shard (names after vLLM's, prefix ``mooncaked_``).

The collector reads :meth:`StoreShard.stats` at scrape time, so the shard's
hot paths only bump plain ints.  It registers into the registry it is given
(never the global default at import time: a test process may hold several
shards)::

    registry = CollectorRegistry()
    register_store_metrics(shard, registry, labels={"node": node_id})
    generate_latest(registry)   # the /metrics body
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvstore.shard import StoreShard

PREFIX = "mooncaked_"


class StoreCollector(Collector):
    def __init__(self, shard: StoreShard, labels: dict[str, str] | None = None) -> None:
        self.shard = shard
        self.labels = dict(labels or {})

    def collect(self) -> Iterator[Metric]:
        s = self.shard.stats()
        names = list(self.labels)
        values = list(self.labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("kv_cache_usage_perc",
                    "Share of the store shard's pages holding data (cached or private), 0..1.",
                    s.usage_ratio)
        yield gauge("kv_cache_pinned_perc",
                    "Share of pages that cannot be evicted now (pinned blocks and private pages), 0..1.",
                    (s.pinned_blocks + s.private_pages) / s.num_pages)
        yield gauge("kv_cache_capacity_bytes", "Bytes of the shard's DRAM buffer used for pages.",
                    s.capacity_bytes)
        yield gauge("kv_cache_used_bytes", "Bytes of pages holding data.", s.used_bytes)
        yield gauge("kv_cache_blocks", "Blocks cached in DRAM.", s.cached_blocks)
        yield gauge("kv_cache_pinned_blocks", "Cached blocks pinned by in-flight work.", s.pinned_blocks)
        yield gauge("kv_cache_ssd_blocks", "Blocks held in the SSD tier.", s.ssd_blocks)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.query_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      s.hit_tokens)
        yield counter("kv_cache_lookups", "Object-API get() calls that found the block.", s.hits)
        yield counter("kv_cache_lookup_misses", "Object-API get() calls that missed.", s.misses)
        yield counter("kv_cache_evictions", "Blocks evicted from DRAM by LRU.", s.evictions)
        yield counter("kv_cache_stored_blocks", "Blocks inserted into the shard.", s.stored_blocks)
        yield counter("kv_cache_collisions", "Key matches rejected by the token guard.", s.collisions)
        yield counter("kv_cache_demotions", "Blocks demoted from DRAM to SSD.", s.demotions)
        yield counter("kv_cache_promotions", "Blocks promoted from SSD to DRAM.", s.promotions)


def register_store_metrics(shard: StoreShard, registry: CollectorRegistry,
                           labels: dict[str, str] | None = None) -> StoreCollector:
    collector = StoreCollector(shard, labels)
    registry.register(collector)
    return collector
