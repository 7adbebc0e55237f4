"""Bounded waits for async tests (a wait that times out fails, naming what it waited for)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import pytest


async def eventually(pred: Callable[[], bool], timeout: float = 5.0,
                     interval: float = 0.005) -> None:
    """Wait until ``pred()`` holds, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"still false after {timeout}s: {pred}")
        await asyncio.sleep(interval)
