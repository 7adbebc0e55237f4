"""Mooncake Store, one shard per node: paged KV blocks, hash-chained keys, LRU with pins.

Modules: ``layout`` (page byte layout, shared contract), ``config``
(``StoreConfig``), ``keys`` (block key chain), ``memory`` (the one contiguous
buffer), ``shard`` (``StoreShard``: page states, index, LRU, pins, object API),
``tiering`` (the shard's moves to and from the SSD tier), ``stats`` (counters
and ``StoreStats``), ``waiters`` (coroutines waiting for pages), ``events``
(batched stored/evicted events and snapshots), ``ssd`` (optional second tier:
the slot pool), ``metrics`` (Prometheus collector), ``bench``
(``python -m kvstore.bench``).
"""

from kvstore.config import StoreConfig
from kvstore.events import EventBatch, Snapshot
from kvstore.keys import BlockHasher, block_keys, trace_block_keys, trace_token_ids
from kvstore.layout import PageLayout
from kvstore.shard import (BlockPinnedError, KeyCollisionError, PublishResult, StoreFullError,
                           StoreShard)
from kvstore.stats import StoreStats

__all__ = [
    "BlockHasher", "BlockPinnedError", "EventBatch", "KeyCollisionError", "PageLayout",
    "PublishResult", "Snapshot", "StoreConfig", "StoreFullError", "StoreShard", "StoreStats",
    "block_keys", "trace_block_keys", "trace_token_ids",
]
