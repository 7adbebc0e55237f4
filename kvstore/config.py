"""Configuration of one store shard (the ``[store]`` section of a node config)."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30

# ASCII "mooncake" read as a big-endian integer.  It is below 2**63 so that it
# survives TOML (signed 64-bit integers) unchanged.
DEFAULT_HASH_SEED = 0x6D6F6F6E63616B65


@dataclass
class StoreConfig:
    """Settings of one node's store shard.

    Every node of a cluster (and the conductor) must use the same
    ``block_size`` and ``hash_seed``: together they define the block key space.
    """

    # Tokens per KV block (page), the unit of prefix reuse: only whole blocks
    # are shared, so a prompt shorter than a block reuses nothing.  64 lets
    # chat-length prompts (a few hundred tokens) share their system prompt;
    # the paper's 256 suits its 128k-token prompts.
    block_size: int = 64
    # Size of the one contiguous DRAM buffer allocated at start-up; it is
    # carved into pages of ``PageLayout.page_bytes`` (the remainder is unused).
    capacity_bytes: int = 256 * MIB
    # Seed of the xxh3 block-key chain (see kvstore.keys); 0 <= seed < 2**63.
    hash_seed: int = DEFAULT_HASH_SEED
    # Touch every page at start-up so that first writes do not page-fault
    # (and so that an over-committed host fails at start, not mid-request).
    prefault: bool = True
    # Ask the kernel for transparent huge pages for the buffer (fewer TLB misses).
    hugepages: bool = True
    # Second tier: blocks evicted from DRAM are demoted to a file-backed pool
    # instead of dropped, and promoted back on a hit.  Off by default.
    ssd_tier: bool = False
    # Pool file of the SSD tier; "" = a file in the system temp directory.
    ssd_path: str = ""
    # Size of the SSD tier's pool file.
    ssd_capacity_bytes: int = 1 * GIB
    # Block events not yet drained beyond this count are dropped and the next
    # batch asks the consumer to resync from a snapshot (bounds memory when
    # nobody drains).
    max_pending_events: int = 1_000_000
    # Upper bound for the async ``*_wait`` calls that wait for free space.
    max_wait_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not 16 <= self.block_size <= 512:
            raise ValueError(f"store.block_size must be an int in 16..512; got {self.block_size!r}")
        if self.capacity_bytes <= 0:
            raise ValueError(f"store.capacity_bytes must be positive; got {self.capacity_bytes}")
        if not 0 <= self.hash_seed < (1 << 63):
            raise ValueError(f"store.hash_seed must be in 0..2**63-1; got {self.hash_seed}")
        if self.ssd_capacity_bytes <= 0:
            raise ValueError(f"store.ssd_capacity_bytes must be positive; got {self.ssd_capacity_bytes}")
        if self.max_pending_events <= 0:
            raise ValueError(f"store.max_pending_events must be positive; got {self.max_pending_events}")
        if self.max_wait_s <= 0:
            raise ValueError(f"store.max_wait_s must be positive; got {self.max_wait_s}")
