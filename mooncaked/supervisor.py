"""When to restart a local cluster's node that died: back-off and crash-loop detection.

``mooncaked up`` treats its nodes the way systemd's ``Restart=on-failure``
treats a unit: a node that exits is started again after a back-off that
doubles with each quick failure, and the cluster gives up (exits non-zero)
only when one node keeps dying — ``crash_loop_restarts`` exits within
``crash_loop_window_s``.  A node that stayed up for ``healthy_after_s``
starts over at the initial back-off.

Pure bookkeeping: time is an argument, so tests drive it without sleeping.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 8.0
    # systemd's StartLimitBurst / StartLimitIntervalSec.
    crash_loop_restarts: int = 5
    crash_loop_window_s: float = 60.0
    # Up this long after a (re)start: the next failure is a fresh one.
    healthy_after_s: float = 30.0

    def __post_init__(self) -> None:
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        if self.crash_loop_restarts < 1 or self.crash_loop_window_s <= 0:
            raise ValueError("crash_loop_restarts and crash_loop_window_s must be positive")

    @staticmethod
    def restarts_after(exit_code: int) -> bool:
        """``Restart=on-failure``: a non-zero exit or a signal (negative code)
        is a failure; exit 0 is a node that was stopped on purpose."""
        return exit_code != 0


class CrashLoop(Exception):
    """A node exited too often too quickly: stop restarting it."""


@dataclass
class RestartTracker:
    """The restart history of one node.

    A node is running (``restart_at is None``), or exited and waiting out its
    back-off until ``restart_at``; ``down_since`` is its first exit not yet
    followed by a ready process (so repeated failed starts count as one outage)."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    started_at: float = 0.0
    restarts: int = 0
    restart_at: float | None = None
    down_since: float | None = None
    _exits: deque[float] = field(default_factory=deque)
    _backoff_s: float = 0.0

    def on_start(self, now: float) -> None:
        self.started_at = now
        self.restart_at = None

    def due(self, now: float) -> bool:
        """Its back-off is over: start it again."""
        return self.restart_at is not None and now >= self.restart_at

    def on_ready(self, now: float) -> float | None:
        """The (re)started node is ready: seconds it was down, None if it never was."""
        down, self.down_since = self.down_since, None
        return None if down is None else now - down

    def on_exit(self, now: float) -> float:
        """The node exited at ``now``: seconds to wait before starting it again.

        Raises CrashLoop on the exit that makes ``crash_loop_restarts`` within
        the window (the invariant: never more than that many restarts per
        window)."""
        p = self.policy
        if self.down_since is None:
            self.down_since = now
        self._exits.append(now)
        while self._exits and self._exits[0] < now - p.crash_loop_window_s:
            self._exits.popleft()
        if len(self._exits) >= p.crash_loop_restarts:
            raise CrashLoop(f"{len(self._exits)} exits within {p.crash_loop_window_s:g}s")
        if now - self.started_at >= p.healthy_after_s or self._backoff_s == 0.0:
            self._backoff_s = p.backoff_initial_s
        else:
            self._backoff_s = min(p.backoff_max_s, 2 * self._backoff_s)
        self.restarts += 1
        self.restart_at = now + self._backoff_s
        return self._backoff_s
