"""One residual model for what the cost model misses.

A residual is what happened minus what the cost model predicted: TTFT
residuals in seconds, TBT residuals as ``log(measured / predicted)``.  Each
finished request adds one residual to three windows, a fallback chain from
least to most specific:

    cluster  ->  node  ->  (node, load level)

A query reads the most specific window holding at least ``min_samples``
samples, falling back up the chain; when not even the cluster's holds that
many, the residual is 0: the cost model alone (a handful of samples is not
a quantile).  A query at load level ``L`` reads, in the pooled windows (node,
cluster), only the samples recorded at level ``L`` or lighter: what the cost
model misses grows with the work beside a request, so samples from heavier
load would price an idle node by what overload did to it, and refuse it;
refused requests bring no samples that could correct that.

Samples are aged by ONE half-life: at query time (passed in; nothing here
reads a clock) a sample of age ``a`` weighs ``0.5 ** (a / half_life_s)``.
Windows are bounded (``WINDOW`` samples per key), so the model forgets both by
age and by count.  A sample whose prediction was priced by an unfitted prior
carries no information about the fitted model and gets no weight: it is not
recorded.

Node choice uses the weighted median (the residual that minimises the mean
absolute error); admission uses the weighted ``q``-quantile, a
split-conformal bound: a prediction plus the q-quantile of past residuals
exceeds the outcome for about a ``q`` share of requests like those seen.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Hashable

# Samples kept per key: enough for a 0.9-quantile to rest on ~10 samples
# above it, few enough that a node whose behaviour changed is relearned fast.
WINDOW = 128
# A key is trusted once it holds this many samples; below, its parent's is used.
MIN_SAMPLES = 8
DEFAULT_HALF_LIFE_S = 30.0
DEFAULT_ADMIT_QUANTILE = 0.9

CLUSTER: tuple = ("cluster",)


def load_level(in_flight: int) -> int:
    """The load level of ``in_flight`` requests: 0, 1, 2-3, 4-7, ... map to
    0, 1, 2, 3, ...  Doubling buckets: what the model misses grows with the
    work beside a request, by steps that a few levels resolve."""
    return max(0, int(in_flight)).bit_length()


def check_windows(half_life_s: float, min_samples: int, window: int) -> None:
    """ValueError unless samples age (a half-life > 0) and a window can be trusted."""
    if half_life_s <= 0:
        raise ValueError("half_life_s must be > 0")
    if min_samples < 1 or window < min_samples:
        raise ValueError("need 1 <= min_samples <= window")


def log_ratio(measured: float, predicted: float) -> float | None:
    """The TBT residual ``log(measured / predicted)``; None when either is not
    a positive number (nothing to learn from)."""
    if not (measured > 0 and predicted > 0) or math.isinf(measured) or math.isinf(predicted):
        return None
    return math.log(measured / predicted)


def weighted_quantile(samples: list[tuple[float, float]], q: float) -> float:
    """The lower weighted ``q``-quantile of ``(value, weight)`` pairs: the
    smallest value ``v`` with ``sum(w for x <= v) >= q * sum(w)``.  Pairs of
    weight <= 0 are ignored; 0.0 when none remain."""
    return weighted_quantiles(samples, (q,))[0]


def weighted_quantiles(samples: list[tuple[float, float]],
                       qs: tuple[float, ...]) -> tuple[float, ...]:
    """``weighted_quantile`` at each of ``qs``, the pairs sorted once."""
    pairs = sorted((v, w) for v, w in samples if w > 0)
    total = sum(w for _, w in pairs)
    if total <= 0:
        return tuple(0.0 for _ in qs)
    out = []
    for q in qs:
        target = q * total
        acc, value = 0.0, pairs[-1][0]
        for v, w in pairs:
            acc += w
            # Relative slack: sums of float weights must not miss an exact tie.
            if acc >= target * (1 - 1e-12):
                value = v
                break
        out.append(value)
    return tuple(out)


@dataclass(frozen=True)
class ResidualStats:
    """What one key's window says at a given time (for status pages)."""

    samples: int
    weight: float
    median: float
    quantile: float


class ResidualModel:
    """Windows of residuals keyed cluster / node / (node, load level)."""

    def __init__(self, half_life_s: float = DEFAULT_HALF_LIFE_S,
                 quantile: float = DEFAULT_ADMIT_QUANTILE,
                 min_samples: int = MIN_SAMPLES, window: int = WINDOW) -> None:
        check_windows(half_life_s, min_samples, window)
        if not 0 < quantile < 1:
            raise ValueError("quantile must be in (0, 1)")
        self.half_life_s = half_life_s
        self.quantile = quantile
        self.min_samples = min_samples
        self.window = window
        # key -> deque of (time, load level or None, residual)
        self._windows: dict[Hashable, deque[tuple[float, int | None, float]]] = {}
        self.prior_skipped = 0

    @staticmethod
    def chain(node: str | None, level: int | None) -> list[Hashable]:
        """Keys from most to least specific."""
        keys: list[Hashable] = []
        if node is not None:
            if level is not None:
                keys.append((node, level))
            keys.append((node,))
        keys.append(CLUSTER)
        return keys

    def add(self, node: str, level: int | None, residual: float, now: float,
            priced_by_prior: bool = False) -> None:
        """Record one residual observed at ``now`` for ``node`` at ``level``."""
        if priced_by_prior:
            self.prior_skipped += 1
            return
        if not math.isfinite(residual):
            return
        for key in self.chain(node, level):
            win = self._windows.get(key)
            if win is None:
                win = self._windows[key] = deque(maxlen=self.window)
            win.append((now, level, residual))

    def forget_node(self, node: str) -> None:
        """Drop a node's own windows (its samples stay in the cluster's)."""
        for key in [k for k in self._windows if k != CLUSTER and k[0] == node]:
            del self._windows[key]

    def _weighted(self, key: Hashable, now: float | None,
                  level: int | None = None) -> list[tuple[float, float]]:
        """``(residual, weight)`` of ``key``'s samples at ``now`` (None: all
        weigh 1), only those recorded at ``level`` or lighter when ``level``
        is given (a sample of unknown level always counts)."""
        win = self._windows.get(key, ())
        return [(r, 1.0 if now is None else 0.5 ** (max(0.0, now - t) / self.half_life_s))
                for t, lvl, r in win
                if level is None or lvl is None or lvl <= level]

    def key_for(self, node: str | None, level: int | None,
                now: float | None = None) -> Hashable | None:
        """The key a query for ``node`` at ``level`` reads at ``now``: the
        most specific whose samples at ``level`` or lighter, weighted by
        age, still count as ``min_samples``; None when not even the
        cluster's do.  (``now`` None: every sample counts whole.)

        Trust must age with the samples, not only their relative weights:
        a window that says "refuse" keeps its quantile however old it gets
        (the weights all shrink alike), and refusing brings no new samples,
        so a node would be refused for ever.  Aged below ``min_samples`` it
        falls back up the chain, and at last to the cost model alone."""
        read = self._read(node, level, now)
        return None if read is None else read[0]

    def _read(self, node: str | None, level: int | None, now: float | None
              ) -> tuple[Hashable, list[tuple[float, float]]] | None:
        """``key_for``'s key with its weighted samples at ``level`` or lighter."""
        for key in self.chain(node, level):
            pairs = self._weighted(key, now, level)
            if sum(w for _, w in pairs) >= self.min_samples * (1 - 1e-12):
                return key, pairs
        return None

    def residual(self, node: str | None, level: int | None, now: float,
                 q: float | None = None) -> float:
        """The weighted ``q``-quantile residual (the admission quantile when
        None) of the key a query for ``node`` at ``level`` reads; 0.0 with
        no samples."""
        return self.residuals(node, level, now, (self.quantile if q is None else q,))[0]

    def residuals(self, node: str | None, level: int | None, now: float,
                  qs: tuple[float, ...]) -> tuple[float, ...]:
        """``residual`` at each of ``qs`` from one reading of the window."""
        read = self._read(node, level, now)
        return tuple(0.0 for _ in qs) if read is None else weighted_quantiles(read[1], qs)

    def median(self, node: str | None, level: int | None, now: float) -> float:
        """The weighted median residual: what node choice adds to a prediction."""
        return self.residual(node, level, now, 0.5)

    def bound(self, node: str | None, level: int | None, now: float) -> float:
        """The weighted admission-quantile residual: what admission adds."""
        return self.residual(node, level, now, self.quantile)

    def stats(self, now: float) -> dict[str, ResidualStats]:
        """Every key's window at ``now``, keyed by a readable name."""
        out: dict[str, ResidualStats] = {}
        for key, win in self._windows.items():
            pairs = self._weighted(key, now)
            name = "/".join(str(k) for k in key)
            out[name] = ResidualStats(len(win), sum(w for _, w in pairs),
                                      weighted_quantile(pairs, 0.5),
                                      weighted_quantile(pairs, self.quantile))
        return out
