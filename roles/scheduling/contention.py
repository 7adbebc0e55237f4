"""How much slower an engine prefills while other engines on its machine are busy.

Engines on one machine share what it has beside their accelerators: the
host CPU that runs their API servers, schedulers and output processing,
memory bandwidth, and on a CPU-only machine the cores that every other
process there (a client, a router) also runs on.  An engine's prefill
measured while ``k`` other engines of its machine had work can take a
multiple of the same prefill measured alone, and an engine idle beside a
busy one is not as fast as an idle machine.

The model, per machine and per busy level (``load_level`` of the number of
its other engines with work when the request was sent): the weighted
median of ``log(measured prefill / predicted prefill)``; the slowdown at
level ``k`` is ``exp(median_k - median_0)``, at least 1 (another engine's
work never speeds one up).  The engine scheduler multiplies a prediction's
prefill by the slowdown at the level it would run at and feeds its prefill
model the measured time divided by the slowdown it ran at, so the model
stays the speed of an engine computing beside idle neighbours.  On a
machine where neighbours do not slow each other, the medians agree and the
slowdown is 1.

Samples are aged by one half-life and windows are bounded, as the residual
model's (residuals.py); a slowdown is 1 until both its level's window and
level 0's hold ``min_samples`` of weight.  A sample whose prediction came
from an unfitted prior is not recorded (its ratio says how wrong the prior
was, not how busy the machine was).  Pure arithmetic: ``now`` is passed in.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .residuals import MIN_SAMPLES, WINDOW, check_windows, weighted_quantile


@dataclass(frozen=True)
class SlowdownStats:
    """One (machine, busy level) window at a given time (for status pages)."""

    samples: int
    weight: float
    median_log_ratio: float
    slowdown: float


class MachineContention:
    """Per (machine, busy level): measured over predicted prefill, as logs."""

    def __init__(self, half_life_s: float, min_samples: int = MIN_SAMPLES,
                 window: int = WINDOW) -> None:
        check_windows(half_life_s, min_samples, window)
        self.half_life_s = half_life_s
        self.min_samples = min_samples
        self.window = window
        # (machine, level) -> deque of (time, log ratio)
        self._windows: dict[tuple[str, int], deque[tuple[float, float]]] = {}

    def add(self, machine: str, level: int, measured_s: float, predicted_s: float,
            now: float) -> None:
        """One prefill measured at ``now`` on ``machine`` at busy ``level``."""
        if not (measured_s > 0 and predicted_s > 0) \
                or not math.isfinite(measured_s) or not math.isfinite(predicted_s):
            return
        key = (machine, level)
        win = self._windows.get(key)
        if win is None:
            win = self._windows[key] = deque(maxlen=self.window)
        win.append((now, math.log(measured_s / predicted_s)))

    def _weighted(self, machine: str, level: int, now: float) -> list[tuple[float, float]]:
        """``(log ratio, weight)`` of the window's samples, aged to ``now``."""
        return [(r, 0.5 ** (max(0.0, now - t) / self.half_life_s))
                for t, r in self._windows.get((machine, level), ())]

    def _median(self, machine: str, level: int, now: float) -> float | None:
        """The weighted median log ratio at (machine, level), None below min_samples."""
        pairs = self._weighted(machine, level, now)
        if sum(w for _, w in pairs) < self.min_samples * (1 - 1e-12):
            return None
        return weighted_quantile(pairs, 0.5)

    def slowdown(self, machine: str, level: int, now: float) -> float:
        """How many times longer a prefill takes on ``machine`` at busy
        ``level`` than at level 0 (>= 1; 1 until both windows are trusted)."""
        if level <= 0:
            return 1.0
        busy, alone = self._median(machine, level, now), self._median(machine, 0, now)
        if busy is None or alone is None:
            return 1.0
        return max(1.0, math.exp(busy - alone))

    def stats(self, now: float) -> dict[str, SlowdownStats]:
        """Every window at ``now``, keyed ``machine/level``."""
        out: dict[str, SlowdownStats] = {}
        for (machine, level), win in self._windows.items():
            pairs = self._weighted(machine, level, now)
            out[f"{machine}/{level}"] = SlowdownStats(
                len(win), sum(w for _, w in pairs), weighted_quantile(pairs, 0.5),
                self.slowdown(machine, level, now))
        return out
