"""Event-loop stalls: when a node's loop does not turn, say where it was.

Every token a node streams, every RPC it answers and every KV send it
posts waits for its one event loop; a callback that runs long, or a loop
thread that waits for a core or for the GIL, holds all of them at once.
A client sees that as a burst: tokens decoded on time arrive together.

``LoopStallWatch`` keeps a beat on the loop (a task that notes the time
every ``tick_s``) and a watcher thread that checks it.  When the beat is
``threshold_s`` old, the watcher logs the loop thread's stack at that
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
# How often the loop beats and the watcher looks.
TICK_S = 0.01
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
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """On the loop's thread, with the loop running."""
        self._loop_thread = threading.get_ident()
        self._beat_at = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._beat(), name="loop-beat")
        self._thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    async def _beat(self) -> None:
        while True:
            self._beat_at = time.monotonic()
            await asyncio.sleep(self.tick_s)

    def _watch(self) -> None:
        reported_beat = None
        while not self._stop.wait(self.tick_s):
            beat = self._beat_at
            lag = time.monotonic() - beat - self.tick_s
            if lag < self.threshold_s:
                continue
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
