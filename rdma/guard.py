"""Per-grant WRITE capabilities over a region cut into fixed-size pages.

``PageGrants`` is a ``WriteGuard`` (types.py): the owner of a region (the
decode node, for its KV pages) grants a set of pages and gets a random
64-bit capability to hand to the one peer that may WRITE them; the tcp
listener asks ``admit`` before it receives a WRITE's payload into the
region and says ``landed`` once the payload is in.

Invariants (under one lock, since listener threads and the event loop both
come here):
  * a WRITE is admitted only if its capability is live and every page of
    [offset, offset + length) is one it grants;
  * after ``revoke(cap)`` no WRITE of ``cap`` is admitted; the WRITEs
    admitted before it are counted in ``landing(cap)``, and ``revoke`` says
    whether any is (False: its callback runs once the last one has landed).
    So the owner may reuse the pages the moment ``revoke`` is quiet, and
    otherwise when its callback runs: no byte of that grant lands later;
  * a capability is never 0 (0 means "none" on the wire) and never one that
    is live or still landing.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterable


class PageGrants:
    """Capabilities over pages of ``page_bytes`` bytes (page p = region bytes
    [p * page_bytes, (p + 1) * page_bytes))."""

    def __init__(self, page_bytes: int) -> None:
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        self.page_bytes = page_bytes
        self._lock = threading.Lock()
        self._pages: dict[int, frozenset[int]] = {}          # live capability -> its pages
        self._landing: dict[int, int] = {}                   # capability -> admitted, not yet landed
        self._on_quiet: dict[int, Callable[[], None]] = {}   # revoked, still landing -> callback

    def grant(self, pages: Iterable[int]) -> int:
        """A fresh capability for WRITEs into ``pages``."""
        granted = frozenset(pages)
        with self._lock:
            while True:
                cap = secrets.randbits(64)
                if cap and cap not in self._pages and cap not in self._landing:
                    self._pages[cap] = granted
                    return cap

    def revoke(self, capability: int, when_quiet: Callable[[], None]) -> bool:
        """Refuse every later WRITE of ``capability``.  True: none is landing,
        the pages are safe to reuse now (``when_quiet`` is not called).  False:
        some are; ``when_quiet`` runs, on the thread that lands the last one,
        once they all have."""
        with self._lock:
            self._pages.pop(capability, None)
            if self._landing.get(capability):
                self._on_quiet[capability] = when_quiet
                return False
            return True

    # -- the WriteGuard protocol (listener threads) -------------------------------
    def admit(self, capability: int, offset: int, length: int) -> bool:
        first = offset // self.page_bytes
        last = (offset + max(length, 1) - 1) // self.page_bytes
        with self._lock:
            pages = self._pages.get(capability)
            if pages is None or any(p not in pages for p in range(first, last + 1)):
                return False
            self._landing[capability] = self._landing.get(capability, 0) + 1
            return True

    def landed(self, capability: int) -> None:
        with self._lock:
            left = self._landing.get(capability, 0) - 1
            if left > 0:
                self._landing[capability] = left
                return
            self._landing.pop(capability, None)
            callback = self._on_quiet.pop(capability, None)
        if callback is not None:
            callback()

    # -- state ---------------------------------------------------------------------
    @property
    def live(self) -> int:
        """Capabilities granted and not revoked."""
        return len(self._pages)

    def landing(self, capability: int) -> int:
        """WRITEs of ``capability`` admitted whose payload is not in yet."""
        with self._lock:
            return self._landing.get(capability, 0)
