"""The benchmark client in a process of its own, at a raised CPU weight.

The client measures TTFT and token times on the machine that runs the
server under test.  A server that keeps every core busy (vLLM's CPU build
at 2x and 4x a trace's rate) used to delay the client's own sends and reads
by 0.1-1 s, so that server was offered a lower, burstier load than the
schedule and its latencies were read late.  On a
separate host, as in the paper, the client has cores of its own; here it
gets the next best thing: its own session, hence its own autogroup (the
kernel shares the cores between autogroups by the group's nice, whatever the
nice of the threads inside), at ``CLIENT_NICE``.  It needs little CPU, so a
high weight lets it run at once when it wakes and costs the server only
what the client really uses, the same for every server measured.

Invariant: the caller's own session and autogroup are left as they were
(the worker is a spawned child: ``setsid`` cannot fail there as it would in
a process-group leader, and raising the caller's autogroup would raise the
shell that started it).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

log = logging.getLogger("mooncaked.benchserve.isolated")

# Autogroup nice of the client's session: weight 9548 against a server
# group's 1024 at nice 0, i.e. the client runs first whenever it is ready.
CLIENT_NICE = -10

T = TypeVar("T")


@dataclass(frozen=True)
class ClientWeight:
    """What the worker applied to itself."""

    own_session: bool
    autogroup_nice: int | None   # None: not raised (see reason)
    reason: str = ""

    def describe(self) -> str:
        if self.autogroup_nice is not None:
            return f"own session, autogroup nice {self.autogroup_nice}"
        session = "own session" if self.own_session else "caller's session"
        return f"{session}, weight not raised: {self.reason}"


_applied: ClientWeight | None = None


def enter_own_session(nice: int = CLIENT_NICE) -> ClientWeight:
    """Make the calling process a session leader and set its autogroup's
    nice (lowering it needs CAP_SYS_NICE: without it, or without
    autogroups, the client runs at the default weight and says why)."""
    global _applied
    try:
        os.setsid()
    except OSError as exc:   # already a process-group leader
        _applied = ClientWeight(False, None, f"setsid: {exc.strerror}")
        return _applied
    try:
        with open("/proc/self/autogroup", "w") as group:
            group.write(str(nice))
        _applied = ClientWeight(True, nice)
    except OSError as exc:
        _applied = ClientWeight(True, None, f"/proc/self/autogroup: {exc.strerror}")
    return _applied


def applied_weight() -> ClientWeight | None:
    """In the worker: what ``enter_own_session`` applied (None elsewhere)."""
    return _applied


class IsolatedClient:
    """One spawned worker process in its own session at ``nice``: ``call``
    runs a picklable function there and returns its (picklable) result.
    A context manager; the worker ends with it."""

    def __init__(self, nice: int = CLIENT_NICE) -> None:
        self._pool = ProcessPoolExecutor(max_workers=1,
                                         mp_context=multiprocessing.get_context("spawn"),
                                         initializer=enter_own_session, initargs=(nice,))
        self.weight: ClientWeight = self.call(applied_weight)
        log.info("benchmark client: %s", self.weight.describe())

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "IsolatedClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
