"""Coroutines waiting for a shard to have room, woken together when pages come back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class SpaceWaiters:
    """One future per waiting coroutine; :meth:`wake_all` resolves them all,
    and each waiter re-checks its own condition (a wake-up is a hint, not a
    grant: another waiter may have taken the pages first)."""

    def __init__(self) -> None:
        self._futures: list[asyncio.Future[None]] = []

    async def wait(self, ready: Callable[[], bool], limit_s: float) -> bool:
        """Wait until ``ready()`` holds; False if it still does not after ``limit_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        while not ready():
            left = deadline - loop.time()
            if left <= 0:
                return False
            fut: asyncio.Future[None] = loop.create_future()
            self._futures.append(fut)
            try:
                await asyncio.wait_for(fut, left)
            except TimeoutError:
                pass
        return True

    def wake_all(self) -> None:
        """Pages were freed or became evictable."""
        if self._futures:
            futures, self._futures = self._futures, []
            for fut in futures:
                if not fut.done():
                    fut.set_result(None)

    def cancel_all(self) -> None:
        for fut in self._futures:
            fut.cancel()
        self._futures = []
