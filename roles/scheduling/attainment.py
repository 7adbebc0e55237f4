"""The admission quantile, learned from whether admitted requests met their SLOs.

Admission adds the ``q``-quantile of a node's residuals to its prediction
(residuals.py): per request, ``q`` is about the chance that a request it
admits meets the TTFT SLO.  What a user states is a share of the requests
the service accepts that meet both SLOs (``target``); per-request ``q``
and that share differ by the slack most requests have (at low load a
request predicted at 0.9 is rare, so q = 0.9 yields ~100% attainment and
refuses requests that would have met the SLO; at a burst the residuals
lag the load and q = 0.9 yields less than 90%).

So ``q`` is the one parameter of an online controller (adaptive conformal
inference, Gibbs and Candes 2021): after each admitted request that ran
to its end,

    q <- clip(q + step * (missed - (1 - target)), Q_MIN, Q_MAX)

Each miss raises ``q`` by ``step * target``, each success lowers it by
``step * (1 - target)``: it stands still where the share of misses among
admitted requests is ``1 - target``, whatever the trace's shape.  ``Q_MIN``
is the median: a request more likely to miss than to meet is never
admitted (the paper's rule on a point prediction); ``Q_MAX`` keeps the
quantile a quantile of a window of ~100 samples.

Pure: no clock, no I/O; one call per finished request.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

Q_MIN = 0.5
Q_MAX = 0.99
# Controller gain: 20 requests in a row within the SLOs lower q by 0.02 at
# the default target, one miss raises it by 0.019.
STEP = 0.02
# Outcomes kept for the status page's recent attainment.
RECENT = 200


@dataclass(frozen=True)
class AttainmentStats:
    quantile: float
    target: float
    observed: int          # admitted requests judged so far
    recent_attainment: float | None  # share of the last RECENT that met both SLOs


class AdmissionQuantile:
    """The admission quantile ``q``, steered so that a ``target`` share of
    admitted requests meets both SLOs.  ``target`` None: ``q`` stays at
    its start (a fixed split-conformal bound)."""

    def __init__(self, start: float, target: float | None, step: float = STEP) -> None:
        if not 0 < start < 1:
            raise ValueError("start must be in (0, 1)")
        if target is not None and not 0 < target < 1:
            raise ValueError("target must be in (0, 1)")
        if not step > 0:
            raise ValueError("step must be > 0")
        self.target = target
        self.step = step
        self.quantile = min(Q_MAX, max(Q_MIN, start)) if target is not None else start
        self.observed = 0
        self._recent: deque[bool] = deque(maxlen=RECENT)

    def observe(self, met: bool) -> float:
        """One admitted request's outcome; returns the new quantile."""
        self.observed += 1
        self._recent.append(bool(met))
        if self.target is not None:
            missed = 0.0 if met else 1.0
            q = self.quantile + self.step * (missed - (1.0 - self.target))
            self.quantile = min(Q_MAX, max(Q_MIN, q))
        return self.quantile

    def stats(self) -> AttainmentStats:
        recent = (sum(self._recent) / len(self._recent)) if self._recent else None
        return AttainmentStats(self.quantile, self.target if self.target is not None else 0.0,
                               self.observed, recent)


def met_slos(ttft_s: float, token_intervals: list[float] | tuple[float, ...],
             ttft_slo_s: float, tbt_slo_s: float) -> bool:
    """Whether a reply met both SLOs as a client measures them: its TTFT, and
    the mean of its intervals between tokens (a reply of one token has
    none and is judged on its TTFT alone)."""
    if ttft_s > ttft_slo_s:
        return False
    if not token_intervals:
        return True
    return sum(token_intervals) / len(token_intervals) <= tbt_slo_s
