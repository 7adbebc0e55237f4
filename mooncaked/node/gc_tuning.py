"""The garbage collector of a long-running node.

A full (generation 2) collection walks every object the collector tracks.
After start-up a node holds hundreds of thousands that live as long as the
process (torch and its modules, aiohttp, the model's Python objects), and a
full collection then took 60-80 ms in a prefill node.  The event loop, and
through the GIL the compute thread, stop meanwhile: the prefill running then,
and every request queued behind it, finish that much later than predicted.

``freeze_startup`` moves what start-up built into the permanent generation,
out of every later collection's walk (objects made afterwards are collected
as before).  ``PauseWatch`` times each collection and logs the long ones, so
an operator can tell a collector pause from anything else.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

log = logging.getLogger("mooncaked.gc")

# A collection at least this long is logged and counted as a long pause.
LONG_PAUSE_S = 0.02


def freeze_startup() -> int:
    """Collect what start-up left as garbage, then freeze the rest; returns
    how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class PauseWatch:
    """Times every collection through ``gc.callbacks``."""

    def __init__(self, long_pause_s: float = LONG_PAUSE_S) -> None:
        self.long_pause_s = long_pause_s
        self.collections = 0
        self.long_pauses = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self._started: float | None = None

    def install(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed mid-collection
            return
        took = time.perf_counter() - self._started
        self._started = None
        self.collections += 1
        self.total_s += took
        self.max_s = max(self.max_s, took)
        if took >= self.long_pause_s:
            self.long_pauses += 1
            log.info("a generation %d collection paused the process %.1f ms (%d objects "
                     "freed)", info.get("generation", -1), took * 1000, info.get("collected", 0))

    def status(self) -> dict[str, Any]:
        return {"frozen_objects": gc.get_freeze_count(), "collections": self.collections,
                "long_pauses": self.long_pauses, "max_pause_ms": round(self.max_s * 1000, 3),
                "total_pause_s": round(self.total_s, 6)}
