"""Event-loop stalls are logged with where the loop was (mooncaked/node/loop_watch.py)."""
import asyncio
import logging
import threading
import time

import pytest

from mooncaked.node.loop_watch import LoopStallWatch


def blocking_callback_for_the_test() -> None:
    time.sleep(0.5)     # ten times the threshold: a stall on any machine


async def test_a_callback_that_blocks_the_loop_is_named_once_per_stall(caplog):
    watch = LoopStallWatch(threshold_s=0.05, tick_s=0.01)
    watch.start()
    try:
        with caplog.at_level(logging.WARNING, logger="mooncaked.loop"):
            for _ in range(2):
                blocking_callback_for_the_test()
                await asyncio.sleep(0.05)        # the loop turns: the beat is fresh again
    finally:
        await watch.stop()
    stalls = [r.getMessage() for r in caplog.records if r.name == "mooncaked.loop"]
    assert len(stalls) == 2 and watch.stalls == 2
    assert all("blocking_callback_for_the_test (tests/test_loop_watch.py:" in m
               for m in stalls), stalls
    status = watch.status()
    assert status["stalls"] == 2 and status["longest_stall_ms"] >= 50
    assert status["threshold_ms"] == 50


def test_the_tick_must_be_shorter_than_the_threshold():
    with pytest.raises(ValueError):
        LoopStallWatch(threshold_s=0.01, tick_s=0.01)


class CountingEvent(threading.Event):
    """The watcher's stop event, counting how often the watcher looked."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.looks += 1
        return super().wait(timeout)


async def test_the_watcher_of_an_on_time_loop_sleeps_until_a_stall_could_begin():
    # Polling every tick would look about 50 times in the half second; a
    # watcher that sleeps until the latest beat would be late looks about
    # once per threshold (5 times).  A busy machine only makes it fewer.
    watch = LoopStallWatch(threshold_s=0.1, tick_s=0.01)
    watch._stop = CountingEvent()
    watch.start()
    try:
        await asyncio.sleep(0.5)
    finally:
        await watch.stop()
    assert 1 <= watch._stop.looks <= 15, watch._stop.looks
    assert watch.stalls == 0
