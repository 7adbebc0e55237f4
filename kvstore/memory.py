"""The shard's one contiguous KV buffer, carved into fixed-size pages.

The buffer is an anonymous private ``mmap`` made once at start-up: it is
page-aligned (so the transfer engine can register it as one memory region),
writable, and never resized or moved, so offsets computed from
:class:`~kvstore.layout.PageLayout` stay valid for the life of the shard.

``buffer`` is a writable ``memoryview`` over all of it, which is what other
parts use directly, e.g.::

    sock.recv_into(mem.buffer[off:off + n])                       # transfer engine
    torch.frombuffer(mem.buffer, dtype=torch.bfloat16).view(      # model runtime
        num_pages, num_layers, 2, block_size, num_kv_heads, head_dim)

This module only owns bytes; which page holds what is the shard's business.
"""

from __future__ import annotations

import mmap

import numpy as np

from kvstore.layout import PageLayout


class ShardMemory:
    """``num_pages`` pages of ``layout.page_bytes`` bytes in one mmap."""

    def __init__(self, layout: PageLayout, num_pages: int, *, prefault: bool = True,
                 hugepages: bool = True) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive; got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.page_bytes = layout.page_bytes
        self.nbytes = num_pages * self.page_bytes
        self._mmap = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # THP disabled on this host: plain pages work too
                pass
        self.buffer: memoryview = memoryview(self._mmap)
        # A flat uint8 view for numpy copies (memcpy speed, no Python loops).
        self._bytes = np.frombuffer(self.buffer, dtype=np.uint8)
        if prefault:
            # One write per 4 KiB page commits the memory now rather than on
            # the first put (a fault storm in the middle of a transfer).
            self._bytes[::mmap.PAGESIZE] = 0
        self.closed = False

    def page_view(self, page_id: int, nbytes: int | None = None) -> memoryview:
        """Writable view of one page (or of its first ``nbytes`` bytes)."""
        self._check_page(page_id)
        off = page_id * self.page_bytes
        return self.buffer[off:off + (self.page_bytes if nbytes is None else nbytes)]

    def page_array(self, page_id: int) -> np.ndarray:
        """Writable uint8 numpy view of one page."""
        self._check_page(page_id)
        off = page_id * self.page_bytes
        return self._bytes[off:off + self.page_bytes]

    def layer_view(self, page_id: int, layer: int) -> memoryview:
        """Writable view of one layer's K and V of one page (see layout.py)."""
        self._check_page(page_id)
        off, length = self.layout.layer_range(page_id, layer)
        return self.buffer[off:off + length]

    def write(self, page_id: int, data: memoryview) -> None:
        """Copy ``data`` (flat bytes, at most one page) to the start of a page."""
        n = data.nbytes
        off = page_id * self.page_bytes
        self._bytes[off:off + n] = np.frombuffer(data, dtype=np.uint8)

    def read_into(self, page_id: int, out: memoryview) -> None:
        """Copy the first ``len(out)`` bytes of a page into ``out``."""
        off = page_id * self.page_bytes
        np.frombuffer(out, dtype=np.uint8)[:] = self._bytes[off:off + out.nbytes]

    def _check_page(self, page_id: int) -> None:
        if not 0 <= page_id < self.num_pages:
            raise IndexError(f"page {page_id} out of range [0, {self.num_pages})")

    def close(self) -> None:
        """Unmap the buffer.  If views are still alive elsewhere the mapping is
        left for the garbage collector (unmapping under a live view would crash)."""
        if self.closed:
            return
        self.closed = True
        self._bytes = np.empty(0, dtype=np.uint8)
        try:
            self.buffer.release()
            self._mmap.close()
        except BufferError:
            pass
