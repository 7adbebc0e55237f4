"""Decode steps a prefill gives way to at its yield points (roles/compute_sharing.py).

The clock is a counter the tests move by hand; a pool that never runs what
it is given stands for a compute thread busy with a prefill, so a step runs
only where the prefill gives way, and the real one-thread pool shows that a
step runs exactly once whichever way reaches it first.
"""
import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from roles.compute_sharing import StepQueue


class BusyPool:
    """A compute thread taken by a prefill: what is submitted waits."""

    def __init__(self) -> None:
        self.submitted = []

    def submit(self, fn, *args):
        self.submitted.append((fn, args))


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def timed_step(clock: Clock, seconds: float, ran: list, name: str):
    def step():
        ran.append(name)
        clock.t += seconds
        return name
    return step


def busy_queue(ratio: float = 2.0):
    """(clock, the busy pool, the names of the steps that ran, the queue)."""
    clock, pool = Clock(), BusyPool()
    return clock, pool, [], StepQueue(pool, ratio=ratio, clock=clock)


async def test_a_waiting_step_runs_at_the_next_layer_once_the_prefill_has_had_its_share():
    clock, pool, ran, q = busy_queue()
    # No step ran for a while: the first one runs at the first layer boundary.
    first = q.run(timed_step(clock, 0.010, ran, "s1"))
    q.give_way()
    assert ran == ["s1"] and await first == "s1"
    assert q.last_step_s == pytest.approx(0.010) and q.between_layers == 1
    # It took 10 ms and ended at 100.010: the prefill now keeps the thread
    # for 2 x 10 ms, until 100.030.
    second = q.run(timed_step(clock, 0.010, ran, "s2"))
    clock.t = 100.029
    q.give_way()
    assert ran == ["s1"] and not second.done()
    clock.t = 100.0301
    q.give_way()
    assert ran == ["s1", "s2"] and await second == "s2"
    # The pool's own turn later finds both steps claimed: neither runs twice.
    for fn, args in pool.submitted:
        fn(*args)
    assert ran == ["s1", "s2"]


async def test_a_prefill_on_time_gives_way_at_once_and_a_late_one_keeps_its_share():
    """A prefill that, after one more step, still meets its predicted time
    gives way at once (on_time is asked with the latest step's seconds);
    one that would not keeps the thread for ratio x the latest step."""
    clock, pool, ran, q = busy_queue()
    first = q.run(timed_step(clock, 0.010, ran, "s1"))
    q.give_way()
    assert await first == "s1"                 # ended at 100.010, took 10 ms
    asked = []

    def on_time(step_s: float) -> bool:
        asked.append(step_s)
        return answer
    second = q.run(timed_step(clock, 0.010, ran, "s2"))
    clock.t = 100.015                          # within the prefill's 20 ms share
    answer = False
    q.give_way(on_time)
    assert ran == ["s1"] and asked == [pytest.approx(0.010)]
    answer = True
    q.give_way(on_time)
    assert ran == ["s1", "s2"] and await second == "s2"
    # Nothing waiting: on_time is not even asked.
    q.give_way(on_time)
    assert len(asked) == 2


async def test_a_step_decoding_a_replys_second_token_runs_at_once_beside_a_late_prefill():
    """A late prefill (on_time False) that has not had its share gives way
    at once to a step decoding some reply's second token; a plain step
    after it waits for the share again (2 x 10 ms from its end)."""
    clock, pool, ran, q = busy_queue()
    first = q.run(timed_step(clock, 0.010, ran, "s1"))
    q.give_way()
    assert await first == "s1"                 # ended at 100.010, took 10 ms
    late = lambda step_s: False                # noqa: E731
    plain = q.run(timed_step(clock, 0.010, ran, "plain"))
    clock.t = 100.015
    q.give_way(late)
    assert ran == ["s1"] and not plain.done()  # 5 ms of its 20 ms share
    # A reply joins: the waiting steps run in order at once, its own too.
    joined = q.run(timed_step(clock, 0.010, ran, "joined"), first_decode=True)
    q.give_way(late)
    assert ran == ["s1", "plain", "joined"] and await joined == "joined"
    # They ended at 100.035: the next plain step waits for the share again.
    after = q.run(timed_step(clock, 0.010, ran, "plain-2"))
    clock.t = 100.050
    q.give_way(late)
    assert not after.done()                    # 15 of its 20 ms share
    clock.t = 100.0551
    q.give_way(late)
    assert await after == "plain-2"
    assert q._first_decodes_waiting == 0       # counted while waiting only
    # Ratio 0 still turns giving way off, for every step.
    clock, pool, ran, off = busy_queue(ratio=0.0)
    step = off.run(timed_step(clock, 0.010, ran, "x"), first_decode=True)
    off.give_way(late)
    assert ran == [] and not step.done()


async def test_with_a_ratio_of_zero_a_step_waits_for_the_chunk():
    clock, pool, ran, q = busy_queue(ratio=0.0)
    step = q.run(timed_step(clock, 0.010, ran, "s1"))
    q.give_way()
    assert ran == [] and not step.done()
    (fn, args), = pool.submitted      # the chunk ended: the pool runs it
    fn(*args)
    assert ran == ["s1"] and await step == "s1" and q.between_layers == 0


async def test_a_failing_step_fails_its_caller_not_the_prefill():
    clock, pool, _, q = busy_queue()

    def broken():
        raise RuntimeError("step failed")
    step = q.run(broken)
    q.give_way()                       # the prefill goes on
    with pytest.raises(RuntimeError, match="step failed"):
        await step


async def test_a_step_cancelled_by_its_caller_still_runs_once_and_harms_nothing():
    clock, pool, ran, q = busy_queue()
    step = q.run(timed_step(clock, 0.010, ran, "s1"))
    step.cancel()
    await asyncio.sleep(0)
    q.give_way()
    await asyncio.sleep(0)             # its result is dropped, not set on a cancelled future
    assert ran == ["s1"] and step.cancelled()


async def test_on_a_real_compute_thread_a_step_runs_between_two_layers_exactly_once():
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        q = StepQueue(pool, ratio=2.0)
        events: list[str] = []
        step_listed = threading.Event()

        def prefill():
            events.append("layer 0")
            assert step_listed.wait(10)
            q.give_way()
            events.append("layer 1")

        def step():
            events.append("step")
            return 7

        loop = asyncio.get_running_loop()
        chunk = loop.run_in_executor(pool, prefill)
        stepped = q.run(step)           # listed, and queued behind the chunk
        step_listed.set()
        await chunk
        assert await stepped == 7
        await loop.run_in_executor(pool, lambda: None)   # the pool's turn for it has passed
        assert events == ["layer 0", "step", "layer 1"]
    finally:
        pool.shutdown(wait=True)
