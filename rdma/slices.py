"""Cutting requests into slices and choosing a path for each slice.

A *path* is a (local NIC, remote NIC) pair. Primary paths pair the local
preferred NICs of the source memory with the remote preferred NICs of the
target memory rail by rail (local i <-> remote i mod n), which is what a
multi-rail cluster wires up; every other pair is a fallback used only when
no primary path is usable. Each slice goes to the usable path with the
fewest bytes in flight, so faster links naturally take more slices.

Path health: a failure puts the path in back-off (``base * 2**(k-1)``,
capped); when the back-off ends one slice *probes* it; success clears the
record, failure doubles the back-off. A slice that finds no usable path
waits (``wait_usable``) for a back-off to end or for a probe to finish.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from .topology import Topology


@dataclass(frozen=True)
class Slice:
    index: int
    local_offset: int
    remote_offset: int
    length: int


def cut(local_offset: int, remote_offset: int, length: int, slice_bytes: int) -> list[Slice]:
    """Half-open slices [k*slice_bytes, min((k+1)*slice_bytes, length)) of the request."""
    if slice_bytes <= 0:
        raise ValueError(f"slice_bytes must be positive, got {slice_bytes}")
    return [Slice(i, local_offset + o, remote_offset + o, min(slice_bytes, length - o))
            for i, o in enumerate(range(0, length, slice_bytes))]


Path = tuple[str, str]  # (local nic, remote nic name)


def plan_paths(local: Topology, local_location: str, remote: Topology,
               remote_location: str) -> tuple[list[Path], list[Path]]:
    lp, ls = local.lists(local_location)
    rp, rs = remote.lists(remote_location)
    primary: list[Path] = []
    for i in range(max(len(lp), len(rp)) if lp and rp else 0):  # a side may prefer no nic
        p = (lp[i % len(lp)], rp[i % len(rp)])
        if p not in primary:
            primary.append(p)
    fallback: list[Path] = []
    for lo in lp + ls:
        for re in rp + rs:
            if (lo, re) not in primary and (lo, re) not in fallback:
                fallback.append((lo, re))
    return primary, fallback


@dataclass
class PathHealth:
    failures: int = 0
    until: float = 0.0      # avoid before this monotonic time
    probing: bool = False   # one slice is testing the path after a back-off
    last_reason: str = ""


@dataclass
class PathTable:
    """Health and load of paths to every segment, keyed (segment, path).

    Both tables hold only what is live: ``inflight`` a path's bytes while
    any are in flight, ``health`` a path that failed until it succeeds or
    ``forget_idle`` finds it long out of back-off and unused (a peer that
    went away), so neither grows with the peers ever seen.
    """

    backoff_s: float
    backoff_max_s: float
    health: dict[tuple[str, Path], PathHealth] = field(default_factory=dict)
    inflight: dict[tuple[str, Path], int] = field(default_factory=dict)
    # Set and cleared on every change of health that may reopen a path.
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)

    def is_probe(self, seg: str, path: Path) -> bool:
        h = self.health.get((seg, path))
        return h is not None and h.probing

    def usable(self, seg: str, path: Path, now: float) -> bool:
        h = self.health.get((seg, path))
        return h is None or (h.until <= now and not h.probing)

    def choose(self, seg: str, primary: list[Path], fallback: list[Path],
               avoid: Path | None = None) -> Path | None:
        """Least-loaded usable path; primaries first; ``avoid`` (the path that
        just failed this slice) only if nothing else is usable."""
        now = time.monotonic()
        for group in (primary, fallback):
            cands = [p for p in group if p != avoid and self.usable(seg, p, now)]
            if cands:
                best = min(cands, key=lambda p: self.inflight.get((seg, p), 0))
                self._mark_probe(seg, best)
                return best
        if avoid is not None and self.usable(seg, avoid, now):
            self._mark_probe(seg, avoid)
            return avoid
        return None

    def _mark_probe(self, seg: str, path: Path) -> None:
        h = self.health.get((seg, path))
        if h is not None and h.failures:
            h.probing = True

    def next_usable_at(self, seg: str, paths: list[Path]) -> float:
        """When the first of ``paths`` not being probed leaves its back-off
        (inf when all are probed: only a probe's end can reopen one)."""
        ends = [h.until if h is not None else 0.0
                for h in (self.health.get((seg, p)) for p in paths) if h is None or not h.probing]
        return min(ends, default=math.inf)

    async def wait_usable(self, seg: str, paths: list[Path]) -> None:
        """Wait until one of ``paths`` may be usable again: a back-off ends or
        a path's health changes (a probe succeeded, failed or was given up).
        It may return early; the caller chooses again. Unbounded while a
        probe runs: the caller's own deadline bounds it."""
        changed = self._changed
        delay = self.next_usable_at(seg, paths) - time.monotonic()
        if delay <= 0:
            await asyncio.sleep(0)  # usable already: never spin without yielding
            return
        try:
            async with asyncio.timeout(None if delay == math.inf else delay):
                await changed.wait()
        except TimeoutError:
            pass

    def _notify(self) -> None:
        self._changed.set()  # wakes every waiter at once
        self._changed.clear()

    def success(self, seg: str, path: Path) -> None:
        if self.health.pop((seg, path), None) is not None:
            self._notify()

    def failure(self, seg: str, path: Path, reason: str) -> None:
        h = self.health.setdefault((seg, path), PathHealth())
        now = time.monotonic()
        if h.until > now and not h.probing:
            # Already backing off: the same outage seen by another connection
            # or slice must not escalate the back-off again.
            h.last_reason = reason
            return
        h.failures += 1
        h.probing = False
        h.last_reason = reason
        h.until = now + min(self.backoff_s * 2 ** (h.failures - 1), self.backoff_max_s)
        self._notify()  # waiters on a probe recompute when to look again

    def release_probe(self, seg: str, path: Path) -> None:
        """A probe slice ended without telling us anything (cancelled, or
        failed for a reason not charged to the path)."""
        h = self.health.get((seg, path))
        if h is not None and h.probing:
            h.probing = False
            self._notify()

    def forget_segment(self, seg: str) -> None:
        """Drop the health of every path to ``seg``: the peer registered
        again at new addresses, and the failures were its old address's."""
        for key in [k for k in self.health if k[0] == seg]:
            del self.health[key]
        self._notify()

    def add_inflight(self, seg: str, path: Path, n: int) -> None:
        left = self.inflight.get((seg, path), 0) + n
        if left:
            self.inflight[(seg, path)] = left
        else:
            del self.inflight[(seg, path)]

    def forget_idle(self, now: float) -> None:
        """Drop the health of paths out of back-off for over ``backoff_max_s``
        with nothing in flight; used again, such a path starts afresh."""
        for key in [k for k, h in self.health.items()
                    if not h.probing and h.until + self.backoff_max_s <= now and k not in self.inflight]:
            del self.health[key]
