"""One node's shard of the KV store: the page state machine, key index, LRU and pins.

Every page of the shard's buffer is in exactly one state at any time:

* **free**     -- in ``_free``; holds nothing;
* **private**  -- in ``_private``; handed out by :meth:`StoreShard.allocate` to a
  caller that writes into it (a prefill computing new blocks, a decode node
  receiving KV); never touched by the shard until :meth:`free` or
  :meth:`publish`;
* **cached**   -- holds the block of one key (``_blocks[key].page``).  A cached
  block is either pinned (``pins > 0``: used by an in-flight request or
  transfer; never evicted, never overwritten) or evictable, in which case its
  key is in ``_lru`` (first = least recently used).

Writes only ever go to free pages turned private (or written by ``put``
before the key is published), so a cached block's bytes never change while
it is cached.  The shard is not thread-safe: call it from one thread (the
node's event loop); other threads may move bytes in and out of pages that
they hold private or pinned.

Beside it: ``tiering`` (moves to and from the SSD tier), ``stats`` (counters
and :class:`StoreStats`), ``waiters`` (coroutines waiting for pages).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvstore.config import StoreConfig
from kvstore.events import EventBatch, EventLog, Snapshot
from kvstore.keys import token_bytes
from kvstore.layout import PageLayout
from kvstore.memory import ShardMemory
from kvstore.ssd import SsdPool
from kvstore.stats import ShardCounters, StoreStats
from kvstore.tiering import SsdTier
from kvstore.waiters import SpaceWaiters

_U64_MAX = (1 << 64) - 1


class StoreFullError(Exception):
    """No page can be had: every page is private or holds a pinned block."""


class BlockPinnedError(Exception):
    """The block is pinned (in use) and cannot be removed."""


class KeyCollisionError(Exception):
    """Two different token blocks hashed to the same key."""


class PublishResult(NamedTuple):
    # The page that holds the key after the call.
    page_id: int
    # True: the given private page became the cached copy.  False: the key was
    # already cached (at ``page_id``); the given page was left private (or
    # freed when ``free_duplicate=True``).
    stored: bool


@dataclass(slots=True)
class _Block:
    key: int
    page: int
    size: int            # valid bytes at the start of the page
    tokens: bytes | None  # the block's token ids (uint32 LE), the collision guard
    pins: int = 0
    replicas: int = 1


def _check_key(key: int) -> None:
    if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or not 0 <= key <= _U64_MAX:
        raise ValueError(f"key must be an int in 0..2**64-1; got {key!r}")


class StoreShard:
    def __init__(self, config: StoreConfig, layout: PageLayout) -> None:
        if layout.block_size != config.block_size:
            raise ValueError(f"layout.block_size ({layout.block_size}) must equal "
                             f"store.block_size ({config.block_size})")
        num_pages = layout.num_pages_for(config.capacity_bytes)
        if num_pages <= 0:
            raise ValueError(f"store.capacity_bytes ({config.capacity_bytes}) is smaller than one "
                             f"page ({layout.page_bytes} bytes)")
        self.config = config
        self.layout = layout
        self.block_size = config.block_size
        self.page_bytes = layout.page_bytes
        self.num_pages = num_pages
        self.memory = ShardMemory(layout, num_pages, prefault=config.prefault,
                                  hugepages=config.hugepages)
        # The whole buffer, writable: register it with the transfer engine as
        # one region; the model runtime views it as a tensor (see memory.py).
        self.buffer: memoryview = self.memory.buffer
        # A stack: after start-up pages are handed out in ascending order.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._private: set[int] = set()
        self._blocks: dict[int, _Block] = {}
        self._page_block: list[_Block | None] = [None] * num_pages
        # Keys of unpinned cached blocks, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.events = EventLog(config.max_pending_events)
        # Shared with the SSD tier, which counts its own moves.
        self._counters = ShardCounters()
        # Holds only keys not in ``_blocks``: a key lives in one tier at a time.
        self._ssd = (SsdTier(SsdPool(config.ssd_path, self.page_bytes, config.ssd_capacity_bytes),
                             self.events, self._counters)
                     if config.ssd_tier else None)
        # Woken whenever a page turns free or evictable (free, remove, last unpin).
        self._waiters = SpaceWaiters()
        self.created_at = time.time()

    # ------------------------------------------------------------------ pages

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free) + len(self._lru)

    def allocate(self, n: int) -> list[int]:
        """``n`` private pages, evicting LRU blocks as needed; all or nothing.

        Raises StoreFullError (and evicts nothing) if fewer than ``n`` pages
        are free or evictable."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int; got {n!r}")
        pages = self._take_pages(n)
        self._private.update(pages)
        return pages

    def free(self, page_ids: Iterable[int]) -> None:
        """Return private pages to the free list; all or nothing."""
        pages = list(page_ids)
        if len(set(pages)) != len(pages):
            raise ValueError("free(): duplicate page ids")
        bad = [p for p in pages if p not in self._private]
        if bad:
            raise ValueError(f"free(): pages {bad[:8]} are not private (allocated and unpublished)")
        for p in pages:
            self._private.remove(p)
            self._free.append(p)
        if pages:
            self._waiters.wake_all()

    def publish(self, key: int, page_id: int, token_ids: Sequence[int] | np.ndarray | None = None,
                *, size: int | None = None, pin: bool = False,
                free_duplicate: bool = False) -> PublishResult:
        """Turn a private page (already filled with the block's KV) into the
        cached block of ``key``.

        If ``key`` is already cached, that copy is kept (same key = same
        prefix = same KV) and ``stored`` is False: the given page stays
        private, because the caller may still be reading it (e.g. an
        in-flight transfer), unless ``free_duplicate`` asks to free it now.
        ``pin`` pins whichever page ends up holding the key."""
        _check_key(key)
        if page_id not in self._private:
            raise ValueError(f"publish(): page {page_id} is not private (allocated and unpublished)")
        tokens = self._block_tokens(token_ids)
        nbytes = self.page_bytes if size is None else size
        if not 0 < nbytes <= self.page_bytes:
            raise ValueError(f"size must be in 1..{self.page_bytes}; got {size}")
        existing = self._blocks.get(key)
        if existing is not None:
            self._reuse(existing, tokens, pin)
            if free_duplicate:
                self.free([page_id])
            return PublishResult(existing.page, False)
        self._drop_ssd_copy(key, tokens)
        self._private.remove(page_id)
        self._insert(key, page_id, nbytes, tokens, pin)
        return PublishResult(page_id, True)

    def _reuse(self, existing: "_Block", tokens, pin: bool) -> None:
        """A key already cached is stored again: keep that copy (same key, same
        prefix, same KV) after the collision guard; pin it or mark it used."""
        self._guard(existing, tokens)
        if pin:
            self._pin(existing)
        else:
            self._touch(existing)

    def page_view(self, page_id: int) -> memoryview:
        """Writable view of a whole page (for private pages being filled)."""
        return self.memory.page_view(page_id)

    def page_of(self, key: int) -> int | None:
        b = self._blocks.get(key)
        return None if b is None else b.page

    def key_of_page(self, page_id: int) -> int | None:
        b = self._page_block[page_id]
        return None if b is None else b.key

    # ------------------------------------------------------------- object API

    def put(self, key: int, data: object, token_ids: Sequence[int] | np.ndarray | None = None,
            *, pin: bool = False) -> bool:
        """Copy ``data`` (any contiguous buffer of at most one page) into a fresh
        page and cache it under ``key``.  Returns False if the key was already
        cached (nothing is written: a cached block is never overwritten).
        Raises StoreFullError if no page is free or evictable."""
        _check_key(key)
        view = _flat_bytes(data)
        if not 0 < view.nbytes <= self.page_bytes:
            raise ValueError(f"data must be 1..{self.page_bytes} bytes; got {view.nbytes}")
        tokens = self._block_tokens(token_ids)
        existing = self._blocks.get(key)
        if existing is not None:
            self._reuse(existing, tokens, pin)
            return False
        self._guard_ssd_copy(key, tokens)
        (page,) = self._take_pages(1)  # may demote blocks and drop the SSD copy itself
        self._drop_ssd_copy(key, tokens)
        self.memory.write(page, view)
        self._insert(key, page, view.nbytes, tokens, pin)
        return True

    def get(self, key: int, *, pin: bool = False) -> memoryview | None:
        """Zero-copy view of the block's bytes, or None on a miss.

        The view aliases the shard buffer: it stays valid only while the
        block is cached, so pass ``pin=True`` (and ``unpin(key)`` later) to
        read it across an await."""
        b = self._blocks.get(key)
        if b is None:
            b = self._promote(key)
            if b is None:
                self._counters.misses += 1
                return None
        self._counters.hits += 1
        if pin:
            self._pin(b)
        else:
            self._touch(b)
        return self.memory.page_view(b.page, b.size)

    def peek(self, key: int) -> memoryview | None:
        """Like get() for a DRAM block, but not a use: no LRU touch, no stats."""
        b = self._blocks.get(key)
        return None if b is None else self.memory.page_view(b.page, b.size)

    def contains(self, key: int) -> bool:
        """In any tier; does not count as a use."""
        return key in self._blocks or (self._ssd is not None and key in self._ssd)

    __contains__ = contains

    def __len__(self) -> int:
        """Blocks held in DRAM."""
        return len(self._blocks)

    def tier_of(self, key: int) -> str | None:
        if key in self._blocks:
            return "dram"
        if self._ssd is not None and key in self._ssd:
            return "ssd"
        return None

    def remove(self, key: int) -> bool:
        """Drop a block from every tier.  Raises BlockPinnedError if pinned."""
        b = self._blocks.get(key)
        if b is not None:
            if b.pins:
                raise BlockPinnedError(f"block {key:#x} is pinned ({b.pins} references)")
            del self._lru[key]
            self._unlink(b)
            self._free.append(b.page)
            self._counters.removed += 1
            self.events.evicted(key)
            self._waiters.wake_all()
            return True
        if self._ssd is not None and self._ssd.remove(key):
            self._counters.removed += 1
            self.events.evicted(key)
            return True
        return False

    def pin(self, key: int) -> int:
        """Take a reference on a block (promoting it from SSD if needed);
        returns its page.  KeyError if the shard does not hold it."""
        b = self._blocks.get(key) or self._promote(key)
        if b is None:
            raise KeyError(f"block {key:#x} is not in the store")
        self._pin(b)
        return b.page

    def unpin(self, key: int) -> None:
        b = self._blocks.get(key)
        if b is None:
            raise KeyError(f"block {key:#x} is not in the store (was it pinned?)")
        self._unpin(b)

    def pins(self, key: int) -> int:
        b = self._blocks.get(key)
        return 0 if b is None else b.pins

    def change_replica(self, key: int, n: int) -> int:
        """Record the cluster-wide replica count the conductor wants for a key;
        returns the previous value.  The shard only keeps and reports it."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"replica count must be an int >= 1; got {n!r}")
        b = self._blocks.get(key)
        if b is not None:
            old, b.replicas = b.replicas, n
            return old
        if self._ssd is not None and key in self._ssd:
            return self._ssd.set_replicas(key, n)
        raise KeyError(f"block {key:#x} is not in the store")

    def replicas(self, key: int) -> int:
        b = self._blocks.get(key)
        if b is not None:
            return b.replicas
        entry = self._ssd.peek(key) if self._ssd is not None else None
        if entry is None:
            raise KeyError(f"block {key:#x} is not in the store")
        return entry.replicas

    # --------------------------------------------------------------- prefixes

    def match_prefix(self, keys: Sequence[int],
                     token_ids: Sequence[int] | np.ndarray | None = None) -> int:
        """Number of leading ``keys`` held (any tier); O(matched).  A pure
        query: no LRU touch, no stats.  With ``token_ids`` (the prompt), each
        matched block's tokens are also compared (collision guard)."""
        if token_ids is not None:
            return self._match_guarded(keys, token_ids)
        blocks = self._blocks
        ssd = self._ssd
        n = 0
        if ssd is None:
            for k in keys:
                if k not in blocks:
                    break
                n += 1
        else:
            for k in keys:
                if k not in blocks and k not in ssd:
                    break
                n += 1
        return n

    def acquire_prefix(self, keys: Sequence[int],
                       token_ids: Sequence[int] | np.ndarray | None = None, *,
                       count_query: bool = True) -> list[int]:
        """Pin the longest cached prefix of ``keys`` and return its pages (in
        order).  Blocks on SSD are promoted; the prefix stops where a block is
        missing, fails the token guard or cannot be promoted.  Counts the
        query and the hit in tokens (the prefix-cache metrics) unless
        ``count_query`` is False (e.g. a lease taken for a peer's fetch).
        Undo with ``release(keys[:len(pages)])``."""
        prompt = self._prompt_bytes(keys, token_ids)
        stride = 4 * self.block_size
        pages: list[int] = []
        for i, k in enumerate(keys):
            b = self._blocks.get(k)
            if b is None:
                b = self._promote(k)
                if b is None:
                    break
            if prompt is not None and b.tokens is not None \
                    and prompt[i * stride:(i + 1) * stride] != b.tokens:
                self._counters.collisions += 1
                break
            self._pin(b)
            pages.append(b.page)
        if count_query:
            self._counters.query_tokens += (len(token_ids) if token_ids is not None
                                            else len(keys) * self.block_size)
            self._counters.hit_tokens += len(pages) * self.block_size
        return pages

    def release(self, keys: Sequence[int]) -> None:
        """Unpin blocks taken by acquire_prefix/pin, last key first, so that a
        request's tail becomes evictable before its head (shared prefixes
        outlive their tails).  Checks every key before changing anything."""
        blocks = [self._pinned_block(k) for k in keys]
        self._check_unpin_counts(blocks)
        for b in reversed(blocks):
            self._unpin(b)

    def release_pages(self, page_ids: Sequence[int]) -> None:
        """Same as :meth:`release`, naming the blocks by page."""
        blocks = []
        for p in page_ids:
            b = self._page_block[p] if 0 <= p < self.num_pages else None
            if b is None or b.pins <= 0:
                raise ValueError(f"release_pages(): page {p} holds no pinned block")
            blocks.append(b)
        self._check_unpin_counts(blocks)
        for b in reversed(blocks):
            self._unpin(b)

    # ------------------------------------------------------------- async waits

    async def allocate_wait(self, n: int, timeout_s: float | None = None) -> list[int]:
        """Like allocate, but waits (at most ``timeout_s``, capped by
        ``store.max_wait_s``) for pages to be released; then StoreFullError."""
        if n > self.num_pages:
            raise StoreFullError(f"cannot allocate {n} pages: the shard has {self.num_pages}")
        await self._wait_for(lambda: self.can_allocate(n), timeout_s, f"{n} pages")
        return self.allocate(n)

    async def put_wait(self, key: int, data: object,
                       token_ids: Sequence[int] | np.ndarray | None = None, *,
                       pin: bool = False, timeout_s: float | None = None) -> bool:
        """Like put, but waits (bounded like allocate_wait) for a page."""
        if key not in self._blocks:
            await self._wait_for(lambda: self.can_allocate(1), timeout_s, "1 page")
        return self.put(key, data, token_ids, pin=pin)

    async def _wait_for(self, ready: Callable[[], bool], timeout_s: float | None,
                        what: str) -> None:
        limit = self.config.max_wait_s if timeout_s is None else min(timeout_s, self.config.max_wait_s)
        if not await self._waiters.wait(ready, limit):
            raise StoreFullError(f"no space for {what} after waiting {limit:.3g} s "
                                 f"({self._occupancy()})")

    # ------------------------------------------------------- events and stats

    def drain_events(self) -> EventBatch | None:
        return self.events.drain()

    def next_event_batch(self) -> tuple[int, int]:
        """(epoch, seq) of the batch that will carry the events recorded now."""
        return self.events.epoch, self.events.seq + 1

    def snapshot(self) -> Snapshot:
        """Every key held (any tier), at the current event seq (see events.py)."""
        keys = list(self._blocks)
        if self._ssd is not None:
            keys.extend(self._ssd.keys())
        return self.events.snapshot(keys)

    def lru_keys(self) -> list[int]:
        """Evictable keys, next to be evicted first."""
        return list(self._lru)

    def stats(self) -> StoreStats:
        pinned = len(self._blocks) - len(self._lru)
        used_pages = self.num_pages - len(self._free)
        ssd = self._ssd
        return StoreStats(
            block_size=self.block_size, page_bytes=self.page_bytes, num_pages=self.num_pages,
            capacity_bytes=self.num_pages * self.page_bytes, used_bytes=used_pages * self.page_bytes,
            free_pages=len(self._free), private_pages=len(self._private),
            cached_blocks=len(self._blocks), pinned_blocks=pinned, evictable_blocks=len(self._lru),
            ssd_blocks=len(ssd) if ssd is not None else 0,
            ssd_capacity_blocks=ssd.num_slots if ssd is not None else 0,
            **self._counters.as_dict())

    def wait_ssd_writes(self) -> None:
        """Block until the SSD tier's background writes are done and applied
        (see ssd.py; a no-op without the tier)."""
        if self._ssd is not None:
            self._ssd.settle()

    def check_integrity(self) -> None:
        """Assert the invariants of the module docstring (used by the tests)."""
        free, private = self._free, self._private
        assert len(set(free)) == len(free), "a page is twice on the free list"
        assert not set(free) & private, "a page is both free and private"
        cached_pages = {b.page for b in self._blocks.values()}
        assert len(cached_pages) == len(self._blocks), "two blocks share a page"
        assert not cached_pages & (set(free) | private), "a cached page is also free or private"
        assert len(free) + len(private) + len(cached_pages) == self.num_pages, "a page is lost"
        for page, b in enumerate(self._page_block):
            if b is None:
                assert page not in cached_pages, f"page {page} is cached but unmapped"
            else:
                assert self._blocks.get(b.key) is b and b.page == page, f"page {page} maps a stale block"
        for key, b in self._blocks.items():
            assert b.key == key and b.pins >= 0 and b.replicas >= 1
            assert 0 < b.size <= self.page_bytes
            assert (key in self._lru) == (b.pins == 0), f"block {key:#x}: LRU membership != unpinned"
        assert len(self._lru) == sum(1 for b in self._blocks.values() if b.pins == 0)
        if self._ssd is not None:
            self._ssd.check_integrity(self._blocks)

    def close(self) -> None:
        self._waiters.cancel_all()
        if self._ssd is not None:
            self._ssd.close()
        self.memory.close()

    # --------------------------------------------------------------- internals

    def _occupancy(self) -> str:
        return (f"{self.num_pages} pages: {len(self._free)} free, {len(self._private)} private, "
                f"{len(self._blocks) - len(self._lru)} pinned, {len(self._lru)} evictable")

    def _take_pages(self, n: int) -> list[int]:
        """``n`` pages off the free list, evicting LRU blocks first if needed."""
        short = n - len(self._free)
        if short > len(self._lru):
            raise StoreFullError(f"cannot allocate {n} pages ({self._occupancy()})")
        for _ in range(short):
            self._evict_lru()
        return [self._free.pop() for _ in range(n)]

    def _evict_lru(self) -> None:
        key, _ = self._lru.popitem(last=False)
        b = self._blocks[key]
        self._unlink(b)
        self._counters.evictions += 1
        if self._ssd is not None:  # the key stays on the node unless the tier drops it
            self._ssd.demote(key, self.memory.page_view(b.page, b.size), b.tokens, b.replicas)
        else:
            self.events.evicted(key)
        self._free.append(b.page)

    def _promote(self, key: int) -> _Block | None:
        """Bring a block back from SSD into a fresh page; None if not on SSD or
        no page can be had (the SSD copy is then kept).  The promoted block is
        unpinned and most recently used."""
        ssd = self._ssd
        if ssd is None:
            return None
        entry = ssd.reserve(key)
        if entry is None:
            return None
        try:
            (page,) = self._take_pages(1)  # may demote other blocks; the reserved slot is safe
        except StoreFullError:
            ssd.unreserve(key, entry)
            return None
        try:
            ssd.read_back(key, entry, self.memory.page_view(page))
        except OSError:
            self._free.append(page)  # the page never held the block
            raise
        b = _Block(key, page, entry.size, entry.tokens, 0, entry.replicas)
        self._blocks[key] = b
        self._page_block[page] = b
        self._lru[key] = None
        return b

    async def promote_prefix(self, keys: Sequence[int]) -> int:
        """Bring the leading blocks of ``keys`` held only on SSD back into DRAM
        with the disk reads off the event loop (``acquire_prefix`` would read
        them inline); call it right before ``acquire_prefix``, which then
        finds them cached.  Stops at the first block held nowhere or when no
        page can be had; returns how many leading blocks are in DRAM.  The
        prefix's blocks are pinned while it runs, so promoting a later block
        never evicts an earlier one.

        While its read runs, a page is private (counted, invisible to
        lookups); the block appears only once its bytes are in.  If the
        caller is cancelled mid-read, the read still finishes and its block
        is kept: the page is never freed under a running read."""
        ssd = self._ssd
        if ssd is None or not len(ssd):
            return 0  # nothing can come back: skip the walk (the common case)
        pinned: list[int] = []
        try:
            for key in keys:
                if key not in self._blocks:
                    entry = ssd.reserve(key)
                    if entry is None:
                        break
                    try:
                        (page,) = self._take_pages(1)  # may demote others; the reserved slot is safe
                    except StoreFullError:
                        ssd.unreserve(key, entry)
                        break
                    self._private.add(page)
                    read = asyncio.ensure_future(
                        ssd.read_back_off_loop(key, entry, self.memory.page_view(page)))
                    try:
                        await asyncio.shield(read)
                    except asyncio.CancelledError:
                        read.add_done_callback(
                            lambda f, k=key, e=entry, p=page: self._promoted(
                                k, e, p, None if f.cancelled() else f.exception()))
                        raise
                    except OSError as exc:
                        self._promoted(key, entry, page, exc)
                        break
                    self._promoted(key, entry, page, None)
                    if key not in self._blocks:
                        break
                self._pin(self._blocks[key])
                pinned.append(key)
            return len(pinned)
        finally:
            self.release(pinned)

    def _promoted(self, key: int, entry, page: int, error: BaseException | None) -> None:
        """End of a background promotion read into private ``page``."""
        self._private.discard(page)
        if error is not None or key in self._blocks:
            # Failed (the tier reported the block gone), or the key was cached
            # meanwhile (e.g. a peer's fetch published it): keep that copy.
            self._free.append(page)
            self._waiters.wake_all()
            return
        b = _Block(key, page, entry.size, entry.tokens, 0, entry.replicas)
        self._blocks[key] = b
        self._page_block[page] = b
        self._lru[key] = None

    def _guard_ssd_copy(self, key: int, tokens: bytes | None) -> None:
        """The collision guard against an SSD copy of ``key``, if any."""
        entry = self._ssd.peek(key) if self._ssd is not None else None
        if entry is not None and tokens is not None and entry.tokens is not None \
                and tokens != entry.tokens:
            self._counters.collisions += 1
            raise KeyCollisionError(f"key {key:#x} is cached (on SSD) for different tokens")

    def _drop_ssd_copy(self, key: int, tokens: bytes | None) -> None:
        """Before caching ``key`` in DRAM, forget an SSD copy (after the guard)."""
        if self._ssd is not None:
            self._guard_ssd_copy(key, tokens)
            self._ssd.remove(key)

    def _insert(self, key: int, page: int, size: int, tokens: bytes | None, pin: bool) -> None:
        b = _Block(key, page, size, tokens, 1 if pin else 0)
        self._blocks[key] = b
        self._page_block[page] = b
        if not pin:
            self._lru[key] = None
        self._counters.stored_blocks += 1
        self.events.stored(key)

    def _unlink(self, b: _Block) -> None:
        del self._blocks[b.key]
        self._page_block[b.page] = None

    def _touch(self, b: _Block) -> None:
        if b.pins == 0:
            self._lru.move_to_end(b.key)

    def _pin(self, b: _Block) -> None:
        if b.pins == 0:
            del self._lru[b.key]
        b.pins += 1

    def _unpin(self, b: _Block) -> None:
        if b.pins <= 0:
            raise ValueError(f"block {b.key:#x} is not pinned")
        b.pins -= 1
        if b.pins == 0:
            self._lru[b.key] = None  # most recently used
            self._waiters.wake_all()

    def _pinned_block(self, key: int) -> _Block:
        b = self._blocks.get(key)
        if b is None or b.pins <= 0:
            raise ValueError(f"release(): block {key:#x} is not pinned in this shard")
        return b

    @staticmethod
    def _check_unpin_counts(blocks: list[_Block]) -> None:
        counts: dict[int, int] = {}
        for b in blocks:
            counts[b.key] = counts.get(b.key, 0) + 1
            if counts[b.key] > b.pins:
                raise ValueError(f"release(): block {b.key:#x} released more often than pinned")

    def _guard(self, b: _Block, tokens: bytes | None) -> None:
        if tokens is None:
            return
        if b.tokens is None:
            b.tokens = tokens  # first caller to know the tokens arms the guard
        elif b.tokens != tokens:
            self._counters.collisions += 1
            raise KeyCollisionError(f"key {b.key:#x} is cached for different tokens")

    def _block_tokens(self, token_ids: Sequence[int] | np.ndarray | None) -> bytes | None:
        if token_ids is None:
            return None
        data = token_bytes(token_ids)
        if len(data) != 4 * self.block_size:
            raise ValueError(f"token_ids must hold one block ({self.block_size} tokens); "
                             f"got {len(data) // 4}")
        return data

    def _prompt_bytes(self, keys: Sequence[int],
                      token_ids: Sequence[int] | np.ndarray | None) -> bytes | None:
        if token_ids is None:
            return None
        data = token_bytes(token_ids)
        if len(data) < 4 * self.block_size * len(keys):
            raise ValueError(f"token_ids ({len(data) // 4} tokens) is shorter than "
                             f"{len(keys)} blocks of {self.block_size}")
        return data

    def _match_guarded(self, keys: Sequence[int], token_ids: Sequence[int] | np.ndarray) -> int:
        prompt = self._prompt_bytes(keys, token_ids)
        assert prompt is not None
        stride = 4 * self.block_size
        n = 0
        for i, k in enumerate(keys):
            b = self._blocks.get(k)
            if b is not None:
                tokens = b.tokens
            elif self._ssd is not None and (entry := self._ssd.peek(k)) is not None:
                tokens = entry.tokens
            else:
                break
            if tokens is not None and prompt[i * stride:(i + 1) * stride] != tokens:
                break
            n += 1
        return n


def _flat_bytes(data: object) -> memoryview:
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"data must support the buffer protocol; got {type(data).__name__}") from None
    if not view.c_contiguous:
        raise ValueError("data must be a C-contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
