"""The shard's counters (bumped on its hot paths) and the stats snapshot built from them."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class ShardCounters:
    """Running totals since the shard started; plain ints so that a bump costs
    one attribute add.  Field names equal :class:`StoreStats`'s, which
    copies them all (see ``StoreShard.stats``)."""

    hits: int = 0
    misses: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    stored_blocks: int = 0
    evictions: int = 0
    removed: int = 0
    collisions: int = 0
    demotions: int = 0
    promotions: int = 0
    ssd_drops: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class StoreStats:
    block_size: int
    page_bytes: int
    num_pages: int
    capacity_bytes: int
    used_bytes: int          # pages holding data: cached + private
    free_pages: int
    private_pages: int
    cached_blocks: int       # in DRAM
    pinned_blocks: int
    evictable_blocks: int
    hits: int                # get(): blocks found
    misses: int              # get(): blocks not found
    query_tokens: int        # acquire_prefix(): tokens asked for
    hit_tokens: int          # acquire_prefix(): tokens served from the cache
    stored_blocks: int       # blocks inserted (put/publish), duplicates excluded
    evictions: int           # blocks pushed out of DRAM by LRU (demoted or dropped)
    removed: int             # blocks removed on request
    collisions: int          # key matches rejected by the token guard
    ssd_blocks: int
    ssd_capacity_blocks: int
    demotions: int
    promotions: int
    ssd_drops: int           # blocks dropped from the SSD tier (gone from the node)

    @property
    def usage_ratio(self) -> float:
        return self.used_bytes / self.capacity_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["usage_ratio"] = self.usage_ratio
        return d
