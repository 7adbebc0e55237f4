"""Optional second tier: a file-backed pool of page-sized slots on local SSD.

Blocks evicted from DRAM are written here (demoted) instead of dropped and
read back into a DRAM page (promoted) on a hit.  The tier has its own LRU;
when it is full the oldest block is dropped for good.  Blocks here are never
pinned: anything in use lives in DRAM.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SsdEntry:
    slot: int
    size: int
    tokens: bytes | None
    replicas: int


class SsdPool:
    def __init__(self, path: str, page_bytes: int, capacity_bytes: int) -> None:
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
        self.writes = 0
        self.reads = 0
        self.write_errors = 0

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

    def put(self, key: int, data: memoryview, tokens: bytes | None,
            replicas: int) -> tuple[bool, list[int]]:
        """Store a block.  Returns (stored, keys dropped to make room).  Not
        stored when no slot can be had (every slot is reserved by an ongoing
        promotion) or the write fails (e.g. the disk is full)."""
        if key in self._index:  # same key = same content; keep the old copy
            self._index.move_to_end(key)
            return True, []
        dropped: list[int] = []
        if not self._free:
            if not self._index:
                return False, dropped
            old_key, old = self._index.popitem(last=False)
            self._free.append(old.slot)
            dropped.append(old_key)
        slot = self._free.pop()
        try:
            self._pwrite(slot, data)
        except OSError as exc:
            self._free.append(slot)
            self.write_errors += 1
            log.warning("SSD tier: write to %s failed, dropping block %#x: %s", self.path, key, exc)
            return False, dropped
        self._index[key] = SsdEntry(slot, data.nbytes, tokens, replicas)
        self.writes += 1
        return True, dropped

    def take(self, key: int) -> SsdEntry | None:
        """Remove a block from the index for promotion.  Its slot stays reserved
        (not reusable) until :meth:`release_slot`, so a demotion triggered by
        the promotion itself cannot overwrite it before it is read."""
        return self._index.pop(key, None)

    def untake(self, key: int, entry: SsdEntry) -> None:
        """Undo :meth:`take` (the promotion could not get a DRAM page)."""
        self._index[key] = entry

    def read_into(self, entry: SsdEntry, out: memoryview) -> None:
        off = entry.slot * self.page_bytes
        view = out[:entry.size]
        done = 0
        while done < entry.size:
            n = os.preadv(self._fd, [view[done:]], off + done)
            if n <= 0:
                raise OSError(f"short read from SSD pool {self.path} at slot {entry.slot}")
            done += n
        self.reads += 1

    def release_slot(self, slot: int) -> None:
        self._free.append(slot)

    def remove(self, key: int) -> bool:
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._free.append(entry.slot)
        return True

    def set_replicas(self, key: int, n: int) -> int:
        entry = self._index[key]
        old, entry.replicas = entry.replicas, n
        return old

    def _pwrite(self, slot: int, data: memoryview) -> None:
        off = slot * self.page_bytes
        done = 0
        while done < data.nbytes:
            done += os.pwrite(self._fd, data[done:], off + done)

    def check_integrity(self) -> None:
        slots = [e.slot for e in self._index.values()]
        assert len(set(slots)) == len(slots), "two SSD blocks share a slot"
        assert not set(slots) & set(self._free), "an SSD slot is both used and free"
        assert len(slots) + len(self._free) <= self.num_slots

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            if self._unlink_on_close:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
