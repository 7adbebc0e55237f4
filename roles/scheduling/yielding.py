"""Prefill nodes that yield their cores: when a borrower gets to compute.

A prefill node started on decode nodes' CPUs at idle priority (``up
--borrow``) computes only while every decode node it yields to is idle.
Its progress is the gaps of their predicted busy intervals (borrowed.py),
scaled by a share learned from its reports (the CPU its requests really
got against what the model gave them), and the idle share that requests
not accepted yet will leave.  A mixin of NodeBookings (nodes.py) and so of
Scheduler, which holds the state these methods read; nothing here blocks,
sleeps or does I/O.
"""
from __future__ import annotations

from . import borrowed
from .state import NodeReport

# Requests accepted per decode node over this many seconds give the rate at
# which requests not accepted yet will keep it busy (borrowed.py).
ARRIVAL_WINDOW_S = 10.0
ARRIVALS_KEPT = 512


def _decayed(value: float, toward: float, seconds: float, half_life_s: float) -> float:
    """A learned ``value`` moved halfway back to ``toward`` every
    ``half_life_s`` over ``seconds`` without a new sample (none when < 0):
    how every figure learned here returns to its default while unfed."""
    return toward + (value - toward) * 0.5 ** (max(0.0, seconds) / half_life_s)


# A yielding prefill node's measured share of the progress its busy-interval
# model predicts (Scheduler.yield_share): learned only over a report interval
# of at least this many modelled seconds, bounded below (a node that got no
# CPU at all still prices finitely), and back halfway to 1 after this long
# without a measurement (it is measured again only once it has work).
YIELD_SHARE_MIN_MODELLED_S = 0.1
YIELD_SHARE_FLOOR = 0.02
YIELD_SHARE_HALF_LIFE_S = 10.0


class YieldingPrefill:
    """The borrower's progress model (see the module docstring)."""

    def decode_busy(self, node: str) -> list[borrowed.Interval]:
        """When decode node ``node`` is predicted to be computing: each
        sequence it reported from the report on for its remaining tokens,
        each booked one from its join for its decode steps, at its step
        time.  (A decode node with sequences steps back to back.)"""
        d = self.decode[node]
        step = self.step_seconds(node)
        running = d.running or {}
        spans = [(d.running_at, d.running_at + seq.remaining_tokens * step)
                 for seq in running.values()]
        for rid, b in d.booked.items():
            if rid in running:
                continue
            join = max(b.join_at, d.running_at) if d.running is not None else b.join_at
            spans.append((join, join + max(0, b.output_tokens - 1) * step))
        return borrowed.merge(spans)

    def yields(self, node: str) -> bool:
        """``node`` is priced as yielding its cores (price_yielded_work)."""
        return self.config.price_yielded_work and bool(self.prefill[node].yields_to)

    def yielded_busy(self, node: str) -> list[borrowed.Interval]:
        """When prefill node ``node`` cannot compute: every live decode node
        it yields to is busy (with one idle, it runs there).  Empty for a
        node that yields to none."""
        out: list[borrowed.Interval] | None = None
        for d in self.prefill[node].yields_to:
            if d not in self.decode or not self.decode[d].alive:
                continue
            spans = self.decode_busy(d)
            out = spans if out is None else borrowed.intersect(out, spans)
        return out or []

    def arrival_idle_share(self, node: str, now: float) -> float:
        """The share of time after ``now`` that requests not accepted yet
        leave decode node ``node`` idle: from the rate accepted over the
        last ARRIVAL_WINDOW_S and their decode steps at its step time."""
        arrivals = self._decode_arrivals.get(node)
        if not arrivals:
            return 1.0
        while arrivals and arrivals[0][0] < now - ARRIVAL_WINDOW_S:
            arrivals.popleft()
        if not arrivals:
            return 1.0
        steps = sum(max(0, out - 1) for _, out in arrivals) / len(arrivals)
        return borrowed.idle_share_of_arrivals(len(arrivals) / ARRIVAL_WINDOW_S,
                                               steps * self.step_seconds(node))

    def yielded_idle_rate(self, node: str, now: float) -> float:
        """The share of the time after ``now`` that prefill node ``node``
        gets in the gaps of its decode nodes' known busy intervals: with any
        of them idle it runs."""
        all_busy, known = 1.0, False
        for d in self.prefill[node].yields_to:
            if d in self.decode and self.decode[d].alive:
                all_busy *= 1.0 - self.arrival_idle_share(d, now)
                known = True
        return 1.0 - all_busy if known else 1.0

    def yield_share(self, node: str, now: float) -> float:
        """The share of its modelled progress that yielding node ``node``
        has lately been measured to get (1 until measured; back halfway to 1
        every YIELD_SHARE_HALF_LIFE_S without a measurement).

        The model (borrowed.py) knows only the decode work this conductor
        booked; the conductor's own process, a benchmark client or any other
        program on those cores takes its CPU too, unseen.  Without this
        share a starved node's work would count as done after its modelled
        time, its queue would be priced empty, and it would be sent more
        requests than it can start."""
        if node not in self._yield_share:
            return 1.0
        value, at = self._yield_share[node]
        return _decayed(value, 1.0, now - at, YIELD_SHARE_HALF_LIFE_S)

    def _learn_yield_share(self, node: str, report: NodeReport, now: float) -> None:
        """From two reports that both name the same requests running: the
        CPU seconds they got in between (their worked_s grew by it) over the
        progress the model gives that stretch (their running_s, the node's
        own clock, grew by its length).  Drops at once to what is measured
        (a starved node must stop taking work now), recovers halfway per
        measurement."""
        running = report.prefill_running_s or {}
        worked = report.prefill_worked_s or {}
        previous = self._yield_seen.get(node)
        self._yield_seen[node] = (dict(running), dict(worked))
        if previous is None or not worked or set(worked) != set(running):
            return
        before_running, before_worked = previous
        if set(before_worked) != set(worked) or set(before_running) != set(running):
            return  # a request started or ended in between: the stretch is not one pass
        gained = sum(worked[r] - before_worked[r] for r in worked)
        wall = sum(running[r] - before_running[r] for r in running)
        if wall <= 0:
            return
        modelled = borrowed.progress(self.yielded_busy(node), report.at - wall, report.at)
        if modelled < YIELD_SHARE_MIN_MODELLED_S:
            return
        measured = min(1.0, max(YIELD_SHARE_FLOOR, gained / modelled))
        share = self.yield_share(node, now)
        share = measured if measured < share else share + 0.5 * (measured - share)
        self._yield_share[node] = (share, now)
