"""Small asyncio helpers shared by the node's background loops."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(*tasks: asyncio.Task | None) -> None:
    """Cancel background tasks and wait until each has really finished."""
    for task in tasks:
        if task is not None:
            task.cancel()
    for task in tasks:
        if task is not None:
            try:
                await task
            except asyncio.CancelledError:
                pass


async def wait_woken(wake: asyncio.Event, timeout_s: float) -> None:
    """Until ``wake`` is set or ``timeout_s`` has passed, whichever comes first.

    Not ``asyncio.wait_for(wake.wait(), ...)``: on Python 3.11 that swallows a
    cancellation arriving as the event is set (it returns instead of raising),
    so a loop built on it, woken just as it is stopped, never ends and its
    ``cancel_and_wait`` hangs.  ``asyncio.timeout`` keeps the cancellation."""
    try:
        async with asyncio.timeout(timeout_s):
            await wake.wait()
    except TimeoutError:
        pass
