"""Wall time of work on cores that another role has first call on.

A prefill node that borrows the decode nodes' cores at idle priority
(``mooncaked up --borrow``: SCHED_IDLE) computes only while they leave a
core idle, so the wall time of its work is the work plus the time the
decode nodes are busy meanwhile.  Measured in replays, a 2-token prompt
took 5 ms with decode idle and 114 ms behind a decode burst of 110 ms: a
fit on wall times turns that into a price that is wrong both ways.  So
its estimator is fitted on work (the CPU seconds its compute thread got)
and its queue and prefill are priced by walking the decode nodes'
predicted busy intervals.

The busy intervals known when a request is priced are those of requests
already accepted; requests accepted later join the decode nodes while it
still runs.  They are unknown one by one but not in sum: from ``after``
on, the gaps between known busy intervals pass at ``idle_rate`` (< 1), the
share of time that no request yet to come keeps the decode nodes busy
(``idle_share_of_arrivals``).

A colocated node's prefill shares one compute thread with the node's own
decode steps: while its decode is busy a prefill gets its share of the
thread (``busy_rate``: a chunk between two steps), outside at full speed.
A reply of a few tokens keeps the decode busy for a few steps, so a long
prefill behind it is slowed for those steps only.

Pure functions of intervals and times; an interval is ``(start, end)``
with ``start < end`` and a busy set is a sorted list of disjoint ones.
"""
from __future__ import annotations

import math
from typing import Iterable

Interval = tuple[float, float]


def idle_share_of_arrivals(rate_per_s: float, busy_s_each: float) -> float:
    """The share of time that requests arriving at random (Poisson) at
    ``rate_per_s``, each keeping a decode node busy for ``busy_s_each``,
    leave it idle: no request in decode at a given instant, e^(-rate x
    busy) (the empty probability of an M/G/infinity queue)."""
    return math.exp(-max(0.0, rate_per_s) * max(0.0, busy_s_each))


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted disjoint intervals (empty ones dropped)."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Where two busy sets are both busy (each sorted and disjoint)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def busy_within(busy: list[Interval], start: float, end: float) -> float:
    """Seconds of ``busy`` inside [start, end]."""
    total = 0.0
    for s, e in busy:
        if e <= start:
            continue
        if s >= end:
            break
        total += min(e, end) - max(s, start)
    return total


def _gaps(busy: list[Interval], start: float, after: float):
    """The idle stretches from ``start`` on, split at ``after``, as
    (gap start, gap end or inf, whether it is at/after ``after``)."""
    t = start
    for s, e in busy:
        if e <= t:
            continue
        if s > t:
            yield from _split(t, s, after)
        t = e
    yield from _split(t, math.inf, after)


def _split(a: float, b: float, after: float):
    if b <= after:
        yield a, b, False
    elif a >= after:
        yield a, b, True
    else:
        yield a, after, False
        yield after, b, True


def progress(busy: list[Interval], start: float, end: float,
             after: float = math.inf, idle_rate: float = 1.0, busy_rate: float = 0.0) -> float:
    """Work done in [start, end] by a task that runs at ``busy_rate`` of
    the time inside ``busy`` (0: not at all) and fully outside it (from
    ``after`` on, at ``idle_rate``)."""
    if end <= start:
        return 0.0
    done = 0.0
    for a, b, late in _gaps(busy, start, after):
        if a >= end:
            break
        done += (min(b, end) - a) * (idle_rate if late else 1.0)
    if busy_rate > 0:
        done += busy_rate * busy_within(busy, start, end)
    return done


def wall_for(busy: list[Interval], start: float, work: float,
             after: float = math.inf, idle_rate: float = 1.0, busy_rate: float = 0.0) -> float:
    """Seconds from ``start`` until a task that runs at ``busy_rate`` of
    the time inside ``busy`` and fully outside it (from ``after`` on, at
    ``idle_rate``) has done ``work`` seconds of it: ``work`` itself when
    nothing is busy."""
    if work <= 0:
        return 0.0
    left = work
    rate_floor = 1e-3  # a decode node busy all the time still yields a sliver
    t = start
    for a, b, late in _gaps(busy, start, after):
        # [t, a) is busy: the stretch between the previous gap and this one.
        if busy_rate > 0 and a > t:
            if (a - t) * busy_rate >= left:
                return t + left / busy_rate - start
            left -= (a - t) * busy_rate
        rate = max(rate_floor, idle_rate) if late else 1.0
        if (b - a) * rate >= left:
            return a + left / rate - start
        left -= (b - a) * rate
        t = b
    raise AssertionError("the last gap is unbounded")
