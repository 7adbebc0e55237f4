"""Endpoint base: the in-flight bookkeeping and failure rules every transport's endpoint shares.

An endpoint is one connection (tcp) or queue pair (rdma) to one remote
NIC. The transports differ in how bytes move; what is common lives here:
posted slices are tracked by sequence number until completed, and an
endpoint ends in exactly one of three ways, each at most once:

* ``abort``  - it failed: every pending slice fails with ``EndpointError``
  and the owner is told (``on_fail``), so the path's health can be charged;
* ``retire`` - it was evicted from the pool: it closes once idle;
* ``close``  - the owner shut it down; pending slices are the owner's.

``failed`` is set by whichever comes first and never cleared; a failed
endpoint refuses new posts. All of this runs on the event-loop thread
only; transport threads reach it through ``_fail_from_thread`` or
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


class EndpointError(ConnectionError):
    """A connection failed; every slice posted on it fails with this."""


class WriteRefused(Exception):
    """The target answered that its write guard refused this WRITE (no grant for
    its capability and range).  Only that slice fails; the connection is fine,
    and re-posting would be refused again, so the request fails at once."""


class Posted:
    """One slice in flight: its future and its size."""

    __slots__ = ("fut", "length")

    def __init__(self, fut: asyncio.Future, length: int) -> None:
        self.fut, self.length = fut, length


class Endpoint:
    """Shared state of one endpoint; subclasses provide ``connect``, ``post``
    and ``_teardown`` (release the wire; must be idempotent)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, token: str, user_timeout_ms: int,
                 connect_timeout_s: float, on_fail: Callable[[Endpoint, str, bool], None] | None) -> None:
        self.loop = loop
        self.token = token
        self.user_timeout_ms = user_timeout_ms
        self.connect_timeout_s = connect_timeout_s
        self.on_fail = on_fail
        self.pool_key: Any = None  # set by the owner that pools it (connections.py)
        self.descriptor: Any = None  # the peer's registration it was opened for (idem)
        self.pending: dict[int, Posted] = {}
        self.pending_bytes = 0
        self.last_progress = time.monotonic()
        self.failed: str | None = None
        self.retired = False
        self._seq = 0

    async def connect(self) -> None:
        raise NotImplementedError

    def _connect_blocking(self) -> None:
        raise NotImplementedError

    async def _connect_in_thread(self) -> None:
        """Run the blocking connect + handshake in a worker thread. The socket's
        own timeout (connect_timeout_s) should fire first; the extra second
        only bounds a thread stuck outside the socket calls."""
        await asyncio.wait_for(asyncio.to_thread(self._connect_blocking), self.connect_timeout_s + 1)

    def post(self, op: Any, rid: int, offset: int, view: memoryview, local_region: int = 0,
             local_offset: int = 0, capability: int = 0) -> asyncio.Future:
        """Queue one slice (a WRITE carrying ``capability``, 0 = none, where the
        transport can); the future resolves when the target acknowledged it."""
        raise NotImplementedError

    def _teardown(self) -> None:
        raise NotImplementedError

    # -- posting and completion ---------------------------------------------
    def _new_future(self) -> asyncio.Future:
        """A future for one slice, already failed when the endpoint is."""
        fut = self.loop.create_future()
        if self.failed is not None:
            fut.set_exception(EndpointError(self.failed))
        return fut

    def _track(self, post: Posted) -> int:
        """Record a slice about to go on the wire; returns its sequence number."""
        self._seq += 1
        if not self.pending:
            # The stall clock (last_progress) only runs while work is pending:
            # an endpoint idle for an hour has not stalled.
            self.last_progress = time.monotonic()
        self.pending[self._seq] = post
        self.pending_bytes += post.length
        return self._seq

    def _complete(self, seq: int, error: Exception | None = None) -> None:
        """The target answered slice ``seq``: done, or failed with ``error``
        (a refusal; the endpoint itself stays up)."""
        post = self.pending.pop(seq, None)
        if post is None:
            return  # aborted meanwhile: the slice already failed
        self.pending_bytes -= post.length
        if not post.fut.done():
            if error is None:
                post.fut.set_result(None)
            else:
                post.fut.set_exception(error)
        if self.retired and not self.pending:
            self.close()

    # -- ending -----------------------------------------------------------------
    def _fail_from_thread(self, reason: str) -> None:
        """``abort`` from a transport thread (the loop may be gone by then)."""
        if self.failed is None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.abort, reason)
            except RuntimeError:
                pass

    def abort(self, reason: str, penalize: bool = True) -> None:
        """Fail the endpoint and every slice on it; ``penalize`` = count it
        against the path's health."""
        if self.failed is not None:
            return
        self.failed = reason
        # An idle connection the peer closed is just dropped (rebuilt on
        # next use); only a failure with work on it counts against the path.
        penalize = penalize and bool(self.pending)
        pending, self.pending = self.pending, {}
        self.pending_bytes = 0
        self._teardown()
        for post in pending.values():
            if not post.fut.done():
                post.fut.set_exception(EndpointError(reason))
        if self.on_fail is not None:
            self.on_fail(self, reason, penalize)

    def retire(self) -> None:
        """Evicted from the pool: close once in-flight slices are done."""
        self.retired = True
        if not self.pending:
            self.close()

    def close(self) -> None:
        if self.failed is None:
            self.failed = "closed"
            self._teardown()
