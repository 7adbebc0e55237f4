"""Decode steps and prefill chunks sharing one compute thread (a colocated node).

The compute thread takes one call at a time from a FIFO pool, so a decode
step submitted while a prefill chunk runs would wait for the whole chunk:
on a machine whose cores are shared with other processes a chunk of a
thousand tokens takes a tenth of a second, and every running sequence's
next token waits that long.  A step submitted through ``StepQueue.run`` is
queued in the pool as before and also listed here; the prefill, on the
compute thread, calls ``give_way()`` at its yield points (each layer's
boundary, between two attention tiles, before each layer's MLP: a few
milliseconds apart however long the chunk), which runs the listed steps
right there
- at once while the prefill is on time: the conductor predicted its first
  token by a time (``PrefillRequest.budget``), and the prefill's remaining
  compute plus a step still ends before it.  Decode steps spend the slack
  of a prediction, not the time it promised;
- at once, too, for a step that decodes some reply's second token (the
  first came from its prefill, ``first_decode``): a reply is judged on
  the mean of its token intervals, and a short reply's mean is mostly its
  first interval, while the prefill loses one step per reply that starts
  decoding on this node;
- otherwise once the prefill has held the thread ``ratio`` times the
  latest step's time since the last step ended: a token then waits for
  about ``1 + ratio`` steps, and a late prefill keeps ``ratio / (1 +
  ratio)`` of the thread while steps keep coming.

Invariant: each step runs exactly once, on the compute thread: whichever of
the pool and a yield point claims it first (under the lock) runs it; the
other finds it claimed.  A step touches only its own sequences' pages and
fresh tensors, and the prefill's state at a yield point is its own local
tensors, so running one inside the other changes neither's result.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(eq=False)
class _Step:
    fn: Callable[..., Any]
    args: tuple
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    claimed: bool = False
    # It decodes the token after some reply's first (which its prefill made).
    first_decode: bool = False


class StepQueue:
    """Decode steps that a prefill on the same compute thread gives way to."""

    def __init__(self, pool: Executor, ratio: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not ratio >= 0:
            raise ValueError(f"ratio must be >= 0, got {ratio}")
        self.pool = pool
        self.ratio = ratio
        self.clock = clock
        self._waiting: deque[_Step] = deque()
        self._lock = threading.Lock()
        # How many waiting steps are first decodes: kept under the lock with
        # _waiting, read without it (an int, where iterating the deque while
        # the loop appends to it would raise).
        self._first_decodes_waiting = 0
        # The latest step's own seconds, and when it ended (perf_counter).
        self.last_step_s = 0.0
        self._last_end = 0.0
        # Steps run at a yield point of a prefill rather than after it,
        # and their seconds: a prefill's own compute time leaves them out.
        self.between_layers = 0
        self.between_layers_s = 0.0

    def run(self, fn: Callable[..., Any], *args: Any,
            first_decode: bool = False) -> asyncio.Future:
        """fn(*args) on the compute thread: in pool order, or earlier at a
        prefill's yield point (``give_way``).  Queued when called (on the
        event loop); the future has its result.  ``first_decode``: the step
        decodes some reply's second token (see the module)."""
        loop = asyncio.get_running_loop()
        step = _Step(fn, args, loop, loop.create_future(), first_decode=first_decode)
        with self._lock:
            self._waiting.append(step)
            self._first_decodes_waiting += first_decode
        self.pool.submit(self._run, step)
        return step.future

    def give_way(self, on_time: Callable[[float], bool] | None = None) -> None:
        """Called by a prefill at a yield point, on the compute thread: run
        the waiting steps if ``on_time(step_s)`` (the prefill, taking one
        more step of ``step_s`` seconds, still meets its predicted time), if
        one of them decodes a reply's second token, or if the prefill has had
        its share since the last one (immediately when none ran for a
        while).  ``ratio`` 0 turns giving way off."""
        if not self._waiting or self.ratio <= 0:
            return
        if self.clock() - self._last_end < self.ratio * self.last_step_s \
                and not (on_time is not None and on_time(self.last_step_s)) \
                and not self._first_decodes_waiting:
            return
        while self._waiting:
            with self._lock:
                if not self._waiting:
                    return
                step = self._waiting[0]
            if self._run(step):
                self.between_layers += 1
                self.between_layers_s += self.last_step_s

    def _run(self, step: _Step) -> bool:
        """Run ``step`` unless already run; on the compute thread."""
        with self._lock:
            if step.claimed:
                return False
            step.claimed = True
            try:
                self._waiting.remove(step)
                self._first_decodes_waiting -= step.first_decode
            except ValueError:
                pass
        t0 = self.clock()
        result: Any = None
        error: BaseException | None = None
        try:
            result = step.fn(*step.args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            error = exc
        end = self.clock()
        self.last_step_s, self._last_end = end - t0, end
        try:
            step.loop.call_soon_threadsafe(_settle, step.future, result, error)
        except RuntimeError:
            pass  # the loop has closed: nobody awaits the step any more
        return True


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting task was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
