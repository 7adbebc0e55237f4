"""Optional second tier: a file-backed pool of page-sized slots on local SSD.

Blocks evicted from DRAM are written here (demoted) instead of dropped and
read back into a DRAM page (promoted) on a hit.  The tier has its own LRU;
when it is full the oldest block is dropped for good.  Blocks here are never
pinned: anything in use lives in DRAM.

Writes run off the event loop.  When :meth:`SsdPool.put` is called on a
thread that runs an asyncio loop (the node), it copies the block into a
buffer it owns (the DRAM page is reused by the caller at once), indexes the
block as *writing* and hands the ``pwrite`` to the pool's one writer thread;
the completion comes back to the loop thread (``call_soon_threadsafe``) and
is applied there by :meth:`SsdPool.reap`.  Without a running loop (tools,
unit tests) there is no loop to stall and the write runs inline.

Invariants (the index is only touched on the caller's thread):
  * a *writing* entry is read from its in-memory copy, never from its slot:
    a slot is read only once the write into it is complete;
  * a slot with a write in flight is never reused: the tier's LRU skips
    writing entries, and a writing entry removed or promoted gives its slot
    back only when the writer is done with it (:meth:`reap`);
  * a failed write (ENOSPC, EIO) drops the block cleanly: out of the index,
    slot freed, and the key reported by :meth:`reap` so the shard can say
    it left the node; never a half-indexed block;
  * the copies of in-flight writes are bounded (``max_write_backlog_bytes``);
    a demotion past the bound is not stored (the block leaves the node, as
    when the tier is full of in-flight writes), so eviction never waits.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Bytes of block copies waiting for the writer thread, by default.
DEFAULT_WRITE_BACKLOG_BYTES = 64 << 20


@dataclass(slots=True)
class SsdEntry:
    key: int
    slot: int
    size: int
    tokens: bytes | None
    replicas: int
    # The block's bytes while its write is in flight (None once on disk).
    pending: bytes | None = None
    # Removed or promoted while writing: the writer's completion frees the slot.
    released: bool = False


class SsdPool:
    def __init__(self, path: str, page_bytes: int, capacity_bytes: int,
                 max_write_backlog_bytes: int = DEFAULT_WRITE_BACKLOG_BYTES) -> None:
        self.page_bytes = page_bytes
        self.num_slots = capacity_bytes // page_bytes
        if self.num_slots <= 0:
            raise ValueError(f"store.ssd_capacity_bytes ({capacity_bytes}) is smaller than one "
                             f"page ({page_bytes} bytes)")
        if path:
            self.path = path
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            self._unlink_on_close = False
        else:
            fd, self.path = tempfile.mkstemp(prefix="mooncaked-ssd-", suffix=".pool")
            self._fd = fd
            self._unlink_on_close = True
        # The pool's contents do not survive a restart (the DRAM index that
        # describes them does not either), so the file is simply resized.
        os.ftruncate(self._fd, self.num_slots * page_bytes)
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        # key -> entry; first item = least recently used.
        self._index: OrderedDict[int, SsdEntry] = OrderedDict()
        # slot -> entry whose write into that slot is in flight.
        self._inflight: dict[int, SsdEntry] = {}
        self.max_write_backlog_bytes = max_write_backlog_bytes
        self._backlog_bytes = 0
        # (entry, error or None) appended by the writer thread, drained by reap().
        self._done: collections.deque[tuple[SsdEntry, OSError | None]] = collections.deque()
        self._writer: ThreadPoolExecutor | None = None
        self.writes = 0
        self.reads = 0
        self.write_errors = 0
        self.backlog_drops = 0  # demotions not stored because the write backlog was full
        # Told the keys that a failed background write dropped (set by the tier).
        self.on_write_failed: Callable[[list[int]], None] | None = None

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: int) -> bool:
        return key in self._index

    def keys(self) -> list[int]:
        return list(self._index)

    def peek(self, key: int) -> SsdEntry | None:
        return self._index.get(key)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def writes_in_flight(self) -> int:
        return len(self._inflight)

    def put(self, key: int, data: memoryview, tokens: bytes | None,
            replicas: int) -> tuple[bool, list[int]]:
        """Store a block.  Returns (stored, keys dropped to make room).  Not
        stored when no slot can be had (every slot is being written or
        reserved by an ongoing promotion), the write backlog is full, or an
        inline write fails (e.g. the disk is full).  A background write that
        fails later is reported by :meth:`reap`."""
        entry = self._index.get(key)
        if entry is not None:  # same key = same content; keep the old copy
            self._index.move_to_end(key)
            return True, []
        loop = _running_loop()
        if loop is not None and self._backlog_bytes + data.nbytes > self.max_write_backlog_bytes:
            self.backlog_drops += 1
            return False, []
        dropped: list[int] = []
        if not self._free and not self._evict_one(dropped):
            return False, dropped
        slot = self._free.pop()
        if loop is None:
            try:
                self._pwrite(slot, data)
            except OSError as exc:
                self._free.append(slot)
                self.write_errors += 1
                log.warning("SSD tier: write to %s failed, dropping block %#x: %s", self.path, key, exc)
                return False, dropped
            self._index[key] = SsdEntry(key, slot, data.nbytes, tokens, replicas)
            self.writes += 1
            return True, dropped
        entry = SsdEntry(key, slot, data.nbytes, tokens, replicas, pending=bytes(data))
        self._index[key] = entry
        self._inflight[slot] = entry
        self._backlog_bytes += data.nbytes
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="mooncaked-ssd-writer")
        self._writer.submit(self._write_job, entry, loop)
        return True, dropped

    def reap(self) -> None:
        """Apply finished background writes (on the caller's thread).  The keys
        of failed writes, now dropped from the tier, go to ``on_write_failed``."""
        failed: list[int] = []
        while self._done:
            entry, error = self._done.popleft()
            del self._inflight[entry.slot]
            self._backlog_bytes -= entry.size
            if error is None:
                self.writes += 1
                entry.pending = None  # on disk now: later reads go to the slot
                if entry.released:
                    self._free.append(entry.slot)
                continue
            self.write_errors += 1
            log.warning("SSD tier: write to %s failed, dropping block %#x: %s",
                        self.path, entry.key, error)
            self._free.append(entry.slot)
            if entry.released:
                continue  # removed or promoted meanwhile: nothing else to undo
            if self._index.get(entry.key) is entry:
                del self._index[entry.key]
                failed.append(entry.key)
            else:
                # Taken by a promotion that has not finished: it reads the
                # bytes from ``pending``, and ``untake`` will not re-index it.
                entry.slot = -1
        if failed and self.on_write_failed is not None:
            self.on_write_failed(failed)

    def take(self, key: int) -> SsdEntry | None:
        """Remove a block from the index for promotion.  Its slot stays reserved
        (not reusable) until :meth:`release_slot`, so a demotion triggered by
        the promotion itself cannot overwrite it before it is read."""
        return self._index.pop(key, None)

    def untake(self, key: int, entry: SsdEntry) -> bool:
        """Undo :meth:`take` (the promotion could not get a DRAM page).  False
        when the block's write failed meanwhile: it is gone from the tier."""
        if entry.slot < 0:
            return False
        self._index[key] = entry
        return True

    def read_into(self, entry: SsdEntry, out: memoryview) -> None:
        self.read_bytes(entry, out)
        self.reads += 1

    def read_bytes(self, entry: SsdEntry, out: memoryview) -> None:
        """Only the read of :meth:`read_into`, touching no pool state: safe on
        a worker thread while the entry is taken (its slot cannot be reused)."""
        view = out[:entry.size]
        pending = entry.pending
        if pending is not None:  # still being written: the copy is the block
            view[:] = pending
            return
        if entry.slot < 0:
            raise OSError(f"block lost from SSD pool {self.path}: its write failed")
        off = entry.slot * self.page_bytes
        done = 0
        while done < entry.size:
            n = os.preadv(self._fd, [view[done:]], off + done)
            if n <= 0:
                raise OSError(f"short read from SSD pool {self.path} at slot {entry.slot}")
            done += n

    def release_slot(self, entry: SsdEntry) -> None:
        """Give back the slot of an entry taken for promotion."""
        self._release(entry)

    def remove(self, key: int) -> bool:
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._release(entry)
        return True

    def set_replicas(self, key: int, n: int) -> int:
        entry = self._index[key]
        old, entry.replicas = entry.replicas, n
        return old

    def wait_writes(self) -> None:
        """Block until every background write is done, then :meth:`reap`
        (shutdown, and tests that want a settled tier)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()
        self.reap()

    def check_integrity(self) -> None:
        slots = [e.slot for e in self._index.values()]
        assert len(set(slots)) == len(slots), "two SSD blocks share a slot"
        assert not set(slots) & set(self._free), "an SSD slot is both used and free"
        assert not set(self._inflight) & set(self._free), "an SSD slot being written is free"
        assert all((e.pending is not None) == (e.slot in self._inflight)
                   for e in self._index.values()), "an SSD block's write state is inconsistent"
        assert len(set(slots) | set(self._inflight)) + len(self._free) <= self.num_slots

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)  # never close the fd under a pwrite
            self._writer = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            if self._unlink_on_close:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass

    # --------------------------------------------------------------- internals

    def _evict_one(self, dropped: list[int]) -> bool:
        """Free a slot by dropping the least recently used block that is on
        disk (a block still being written keeps its slot)."""
        for old_key, old in self._index.items():
            if old.pending is None:
                del self._index[old_key]
                self._free.append(old.slot)
                dropped.append(old_key)
                return True
        return False

    def _release(self, entry: SsdEntry) -> None:
        if self._inflight.get(entry.slot) is entry:
            entry.released = True  # reap() frees it when the writer is done
        elif entry.slot >= 0:
            self._free.append(entry.slot)

    def _write_job(self, entry: SsdEntry, loop: asyncio.AbstractEventLoop) -> None:
        """Runs on the writer thread: only the file and ``_done`` are touched here."""
        error: OSError | None = None
        try:
            assert entry.pending is not None
            self._pwrite(entry.slot, memoryview(entry.pending))
        except OSError as exc:
            error = exc
        self._done.append((entry, error))
        try:
            loop.call_soon_threadsafe(self.reap)
        except RuntimeError:  # the loop is closed: the next call on the pool reaps
            pass

    def _pwrite(self, slot: int, data: memoryview) -> None:
        off = slot * self.page_bytes
        done = 0
        while done < data.nbytes:
            done += os.pwrite(self._fd, data[done:], off + done)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
