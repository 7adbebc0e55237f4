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

from collections.abc import Callable, Iterator
from operator import attrgetter

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvstore.shard import StoreShard
from kvstore.stats import StoreStats

PREFIX = "mooncaked_"

_Family = type[GaugeMetricFamily] | type[CounterMetricFamily]
_GAUGE, _COUNTER = GaugeMetricFamily, CounterMetricFamily

# (family, name after PREFIX, help, value from the stats), in exposition order.
_METRICS: tuple[tuple[_Family, str, str, Callable[[StoreStats], float]], ...] = (
    (_GAUGE, "kv_cache_usage_perc",
     "Share of the store shard's pages holding data (cached or private), 0..1.",
     attrgetter("usage_ratio")),
    (_GAUGE, "kv_cache_pinned_perc",
     "Share of pages that cannot be evicted now (pinned blocks and private pages), 0..1.",
     lambda s: (s.pinned_blocks + s.private_pages) / s.num_pages),
    (_GAUGE, "kv_cache_capacity_bytes", "Bytes of the shard's DRAM buffer used for pages.",
     attrgetter("capacity_bytes")),
    (_GAUGE, "kv_cache_used_bytes", "Bytes of pages holding data.", attrgetter("used_bytes")),
    (_GAUGE, "kv_cache_blocks", "Blocks cached in DRAM.", attrgetter("cached_blocks")),
    (_GAUGE, "kv_cache_pinned_blocks", "Cached blocks pinned by in-flight work.",
     attrgetter("pinned_blocks")),
    (_GAUGE, "kv_cache_ssd_blocks", "Blocks held in the SSD tier.", attrgetter("ssd_blocks")),
    (_COUNTER, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     attrgetter("query_tokens")),
    (_COUNTER, "prefix_cache_hits", "Prompt tokens served from the prefix cache.",
     attrgetter("hit_tokens")),
    (_COUNTER, "kv_cache_lookups", "Object-API get() calls that found the block.",
     attrgetter("hits")),
    (_COUNTER, "kv_cache_lookup_misses", "Object-API get() calls that missed.",
     attrgetter("misses")),
    (_COUNTER, "kv_cache_evictions", "Blocks evicted from DRAM by LRU.", attrgetter("evictions")),
    (_COUNTER, "kv_cache_stored_blocks", "Blocks inserted into the shard.",
     attrgetter("stored_blocks")),
    (_COUNTER, "kv_cache_collisions", "Key matches rejected by the token guard.",
     attrgetter("collisions")),
    (_COUNTER, "kv_cache_demotions", "Blocks demoted from DRAM to SSD.", attrgetter("demotions")),
    (_COUNTER, "kv_cache_promotions", "Blocks promoted from SSD to DRAM.",
     attrgetter("promotions")),
)

class StoreCollector(Collector):
    def __init__(self, shard: StoreShard, labels: dict[str, str] | None = None) -> None:
        self.shard = shard
        self.labels = dict(labels or {})

    def collect(self) -> Iterator[Metric]:
        s = self.shard.stats()
        names = list(self.labels)
        values = list(self.labels.values())
        for family, name, doc, value in _METRICS:
            m = family(PREFIX + name, doc, labels=names)
            m.add_metric(values, value(s))
            yield m


def register_store_metrics(shard: StoreShard, registry: CollectorRegistry,
                           labels: dict[str, str] | None = None) -> StoreCollector:
    collector = StoreCollector(shard, labels)
    registry.register(collector)
    return collector
