"""Segment directory: remote segments' descriptors by name, added directly or fetched through a resolver."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from .descriptors import SegmentDescriptor
from .endpoint_pool import SievePool

# Looks a segment up by name (the node asks the conductor); None = unknown.
# It may answer with the wire dict or an already decoded descriptor.
Resolver = Callable[[str], Awaitable[dict | SegmentDescriptor | None]]


def decode(desc: dict | SegmentDescriptor) -> SegmentDescriptor:
    return desc if isinstance(desc, SegmentDescriptor) else SegmentDescriptor.from_wire(desc)


class SegmentDirectory:
    """Descriptors are kept under the name they carry: those ``add``ed for as
    long as the owner says, those from the resolver in a cache of
    ``cache_size`` (SIEVE), so a daemon talking to ever new peers holds a
    bounded number; an evicted one is simply asked for again. A descriptor
    from the resolver may go stale (the peer restarted elsewhere), so
    ``invalidate`` drops it and the next request asks again."""

    def __init__(self, cache_size: int = 1024) -> None:
        self._known: dict[str, SegmentDescriptor] = {}
        self._cached: SievePool[str, SegmentDescriptor] = SievePool(cache_size)
        self._resolver: Resolver | None = None

    def __len__(self) -> int:
        """Descriptors held, added and cached."""
        return len(self._known) + len(self._cached)

    def add(self, desc: dict | SegmentDescriptor) -> SegmentDescriptor:
        """Record ``desc``; raises ValueError naming the field it gets wrong."""
        seg = decode(desc)
        self._known[seg.name] = seg
        self._cached.remove(seg.name)
        return seg

    def set_resolver(self, resolver: Resolver | None) -> None:
        self._resolver = resolver

    async def resolve(self, name: str) -> SegmentDescriptor | None:
        """The known or cached descriptor, else the resolver's answer (cached); None if unknown."""
        seg = self._known.get(name) or self._cached.get(name)
        if seg is None and self._resolver is not None:
            found = await self._resolver(name)
            if found is not None:
                seg = decode(found)
                self._cached.put(seg.name, seg)
        return seg

    def holds(self, desc: SegmentDescriptor) -> bool:
        """``desc`` (by value: concurrent lookups decode equal copies) is still
        the descriptor held under its name (not dropped by ``invalidate``,
        not replaced by another registration)."""
        return (self._known.get(desc.name) or self._cached.get(desc.name)) == desc

    def invalidate(self, stale: SegmentDescriptor) -> None:
        """Forget ``stale`` after a failed connect to it, when a resolver can
        refresh it (without one, a dropped descriptor could never come back).

        Only ``stale`` itself is dropped: a connect to the old address can
        fail after another request already looked up the peer's new
        descriptor, and dropping that one would fail the requests using it."""
        if self._resolver is not None and self.holds(stale):
            self._known.pop(stale.name, None)
            self._cached.remove(stale.name)
