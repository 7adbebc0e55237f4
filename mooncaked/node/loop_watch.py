"""Event-loop stalls: when a node's loop does not turn, say where it was.

Every token a node streams, every RPC it answers and every KV send it
posts waits for its one event loop; a callback that runs long, or a loop
thread that waits for a core or for the GIL, holds all of them at once.
A client sees that as a burst: tokens decoded on time arrive together.

``LoopStallWatch`` keeps a beat on the loop (a callback that notes the
time every ``tick_s``) and a watcher thread that checks it.  When the beat
is ``threshold_s`` late, the watcher logs the loop thread's stack at that
moment, once per stall: a stack inside a callback names the code that
blocks; a stack at the selector says the loop was ready but got no core
(or no GIL) to run on.  Counts and the longest stall go to
``/admin/status`` (``loop``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from typing import Any

log = logging.getLogger("mooncaked.loop")

# A beat this old is a stall, logged with the loop thread's stack.
STALL_S = 0.05
# How often the loop beats.  Every beat wakes an idle loop, and every look
# wakes the watcher thread (which then wants the GIL the loop holds): an
# idle node pays for both on every core it shares, so the beat is as slow
# as half the threshold allows, and the watcher sleeps until the latest
# beat would be a stall instead of polling.
TICK_S = 0.025
# Frames of the loop thread's stack a stall log line shows (innermost last).
STACK_FRAMES = 6


class LoopStallWatch:
    """Watches the running loop from a thread of its own (see the module docstring)."""

    def __init__(self, threshold_s: float = STALL_S, tick_s: float = TICK_S) -> None:
        if not 0 < tick_s < threshold_s:
            raise ValueError("need 0 < tick_s < threshold_s")
        self.threshold_s = threshold_s
        self.tick_s = tick_s
        self.stalls = 0
        self.longest_s = 0.0
        self._beat_at = time.monotonic()
        self._loop_thread = 0
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """On the loop's thread, with the loop running."""
        self._loop_thread = threading.get_ident()
        self._beat_at = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(self.tick_s, self._beat)
        self._thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._timer is not None:
            self._timer.cancel()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _beat(self) -> None:
        # A plain timer callback re-armed each time: no task or future per beat.
        self._beat_at = time.monotonic()
        if self._loop is not None and not self._stop.is_set():
            self._timer = self._loop.call_later(self.tick_s, self._beat)

    def _watch(self) -> None:
        reported_beat = None
        wait = self.tick_s + self.threshold_s
        while not self._stop.wait(wait):
            beat = self._beat_at
            lag = time.monotonic() - beat - self.tick_s
            if lag < self.threshold_s:
                # On time: no stall can start before this beat is threshold late.
                wait = max(self.threshold_s - lag, self.tick_s)
                continue
            wait = self.tick_s   # a stall: follow it to its end for its length
            if beat == reported_beat:   # the stall already logged, still going
                self.longest_s = max(self.longest_s, lag)
                continue
            reported_beat = beat
            self.stalls += 1
            self.longest_s = max(self.longest_s, lag)
            log.warning("event loop stalled %.0f ms (so far) in: %s", lag * 1000, self.where())

    def where(self) -> str:
        """The loop thread's stack now, innermost frame last, on one line."""
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return "(loop thread gone)"
        frames = traceback.extract_stack(frame)[-STACK_FRAMES:]
        return " <- ".join(f"{f.name} ({_short(f.filename)}:{f.lineno})"
                           for f in reversed(frames))

    def status(self) -> dict[str, Any]:
        return {"stalls": self.stalls, "longest_stall_ms": round(self.longest_s * 1000, 1),
                "threshold_ms": self.threshold_s * 1000}


def _short(path: str) -> str:
    """A source path from its package on (``roles/decode/app.py``)."""
    parts = path.replace("\\", "/").split("/")
    for i, part in enumerate(parts):
        if part in ("roles", "mooncaked", "model", "kvstore", "rdma", "aiohttp", "asyncio"):
            return "/".join(parts[i:])
    return "/".join(parts[-2:])
