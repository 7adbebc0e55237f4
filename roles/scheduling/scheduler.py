"""The scheduler: index + estimators + policy + per-node accounting.

The only object the HTTP conductor and the simulator call. Time is always
an argument; nothing here blocks, sleeps or does I/O.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from . import borrowed
from .estimators import DecodeEstimator, PrefillEstimator, TransferEstimator
from .index import GlobalCacheIndex
from .policies import PlanContext, Policy
from .registry import make_policy
from .state import (BookedJoin, Decision, DecodeLoad, DecodeNodeState, NodeReport,
                    PendingPrefill, PrefillNodeState, PrefillPlan, Progress, Rejection,
                    ScheduleRequest, wall_progress)

# Recent TTFT prediction errors kept for status pages (totals are running sums).
RECENT_TTFT_ERRORS = 1024
# Steps counted between two instants are (t1 - t0) / step; this keeps a
# whole number of steps (2.5 s at 0.1 s) from rounding down to one fewer.
_STEP_EPS = 1e-9
# Finished prefills remembered per node, to recognise them in a report taken before.
RECENTLY_DONE_KEPT = 256
# Per-node TTFT errors behind the learned admission headroom: how many
# finished requests before it replaces slo_admit_fraction, and how many are kept.
NODE_ERROR_SAMPLES = 16
NODE_ERROR_WINDOW = 64
# Rounds of "project the load at this step time, predict the step time".
DECODE_FIXED_POINT_ROUNDS = 4
# Requests accepted per decode node over this many seconds give the rate at
# which requests not accepted yet will keep it busy (borrowed.py).
ARRIVAL_WINDOW_S = 10.0
ARRIVALS_KEPT = 512
# Learned TBT ratios (SchedulerConfig.tbt_ratio_quantile) are kept within
# these bounds, and return halfway to 1 every this many seconds without a
# finished request on the node (it is refused work while its ratio is high,
# so nothing else would bring it back).
TBT_RATIO_BOUNDS = (0.5, 20.0)
TBT_RATIO_HALF_LIFE_S = 3.0
# SchedulerConfig.ttft_bias_rule's choices, and the "median" rule's step as a
# share of the samples' recent mean distance from the bias.
TTFT_BIAS_RULES = ("mean", "median")
TTFT_BIAS_MEDIAN_STEP = 0.2


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
# Per prefill node: the last (predicted queue, measured batched-behind)
# pairs the batch-wait slope is fitted on (Scheduler.batch_wait_s).
BATCH_WAIT_SAMPLES = 64


@dataclass
class SchedulerConfig:
    """Scheduling knobs (filled from TOML / --set by the conductor)."""

    policy: str = "mooncake"
    policy_params: dict = field(default_factory=dict)
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    reject: bool = True  # early rejection on predicted SLO violation
    min_retry_after_s: float = 1.0
    max_retry_after_s: float = 60.0
    kv_bytes_per_token: int = 327_680  # LLaMA3-70B bf16: 80 * 2 * 1024 * 2
    # > 0: learn the TTFT the estimators cannot see (RPCs, the wait for the
    # decode reservation, cores shared with other processes) as an EWMA of
    # measured minus predicted TTFT, added to every prediction (never < 0).
    # 0: predictions are the estimators' alone (the simulator's default).
    ttft_bias_alpha: float = 0.0
    # The learned bias halves every this many seconds without a new sample,
    # so that rejecting everything (no samples) cannot keep it up forever.
    ttft_bias_half_life_s: float = 10.0
    # How the bias follows the samples: "mean", an EWMA (weight
    # ttft_bias_alpha); "median", a step towards each sample of
    # TTFT_BIAS_MEDIAN_STEP times their recent mean distance from it (an
    # EWMA of weight ttft_bias_alpha), which settles where half the samples
    # lie above: what minimises the mean absolute error.  What the
    # estimators miss is skewed (RPCs of a few ms, now and then a stall of
    # tens): the mean sat ~1 ms above what most requests missed at low load.
    ttft_bias_rule: str = "mean"
    # Non-empty: the bias is also learned per load level, the number of
    # requests in flight (admitted, decode not finished) when a request is
    # scheduled, split at these counts ((1, 2, 4): 0, 1, 2-3, 4 or more).
    # What the estimators miss grows with the load beside the request - the
    # relaying of other requests' tokens, reservations and RPCs queued on
    # busy event loops: on trace-gen at 4x it was 4.7 ms with nothing else in
    # flight and 7-11 ms with one to three requests (stop 26), so one bias
    # over all loads sat too high for the quiet requests and too low for the
    # busy ones.  A level without a record of its own uses the node's bias.
    ttft_bias_load_bounds: tuple[int, ...] = ()
    # Admit only predictions within this share of each SLO: on shared cores a
    # prediction just under the SLO is a coin flip.
    slo_admit_fraction: float = 1.0
    # Learn, per decode node, how much longer than predicted the TBT that
    # finished requests measured (the paper's TBT, their longest 10% token
    # intervals, against the predicted step): predictions are scaled by a
    # high quantile of recent ratios (tbt_ratio_quantile) once a node has
    # NODE_ERROR_SAMPLES of them.  The decode fit follows the mean step; the
    # SLO is on the slowest intervals, which work the model cannot see (other
    # programs on the decode cores, the token path) stretches most.  Off: 0.
    tbt_ratio_quantile: float = 0.0
    # > 0: once a prefill node has NODE_ERROR_SAMPLES finished requests, its
    # TTFT headroom is this many times its recent mean absolute TTFT error
    # (instead of slo_admit_fraction): a node whose predictions hold within
    # 20 ms need not refuse what is predicted 100 ms under the SLO, and a
    # noisy one keeps more.
    ttft_margin_errors: float = 0.0
    # That learned headroom returns halfway to slo_admit_fraction's every
    # this many seconds in which the node finished nothing.  Without it a node
    # whose record is bad enough (an estimator still cold, a burst on shared
    # cores) refuses everything, so it never finishes a request that would
    # renew its record: it would refuse for ever.
    ttft_margin_half_life_s: float = 5.0
    # How a prefill report that names its requests sets the queue: False, the
    # node's own seconds figure; True, the sum of this scheduler's estimates
    # of the named requests (fitted on measured prefills, so with a fixed
    # per-request cost a tokens/s figure lacks), the node's figure only when
    # it names requests this scheduler did not book (another conductor's).
    queue_from_bookings: bool = False
    # The baseline of the paper's early-rejection experiment: predict TBT from
    # the load decode nodes last reported (plus this request), ignoring work
    # accepted but still in prefill. Admission then lags the decode load by a
    # prefill and oscillates; off = prediction at join time.
    reject_on_current_load: bool = False
    # Each prefill node's time fitted on its own prefills (started from the
    # cluster-wide fit when it joins): nodes of unequal speed (a slower host,
    # a node borrowing cores another role has first call on) are priced as
    # they run.  The cluster-wide fit keeps learning from every node and is
    # what a newly joined node starts from.  Off: one fit for all.
    per_node_prefill_fit: bool = False
    # A prefill node that yields its cores to decode nodes (its yields_to)
    # is fitted on the CPU seconds it computed and priced by walking their
    # predicted busy intervals plus the share of time requests not accepted
    # yet will keep them busy (borrowed.py).  Off: fitted and priced on its
    # wall times like any node.  Off by default: in stop 23's replays it
    # priced the borrower right on average but not per request (what it
    # waits for is mostly decode work of requests that arrive later), and
    # the mean absolute TTFT error did not fall (docs/bench.md).
    price_yielded_work: bool = False
    # > 0: policies that minimise TTFT choose by each node's predicted TTFT
    # plus its learned bias plus this many times its recent mean absolute
    # TTFT error (once it has NODE_ERROR_SAMPLES): between two nodes
    # predicted alike, the one whose predictions hold wins (a borrower,
    # whose TTFT hangs on decode work still to arrive, only when it is
    # clearly ahead).  0: by the predicted TTFT alone, as in Algorithm 1.
    choose_error_margin: float = 0.0
    # A prefill node that yields its cores to decode nodes (its yields_to)
    # takes only overflow: a request goes to it only when no other prefill
    # node's plan is within its TTFT admit limit.  Its speed hangs on decode
    # work that may not have arrived yet, so its TTFT predictions hold far
    # worse than a node with cores of its own (stop 24: 27-91 ms mean
    # absolute error against 9-35 ms on the Synthetic replays); used for
    # overflow only it adds capacity where the alternative is a 429, and
    # costs accuracy nowhere else.  Off: chosen like any node, by the policy.
    yielding_overflow_only: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError("policy must be a non-empty string")
        if not isinstance(self.policy_params, dict):
            raise ValueError("policy_params must be a dict")
        for f in ("ttft_slo_s", "tbt_slo_s", "min_retry_after_s", "max_retry_after_s",
                  "ttft_bias_half_life_s", "ttft_margin_half_life_s"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be > 0")
        if self.kv_bytes_per_token <= 0:
            raise ValueError("kv_bytes_per_token must be > 0")
        if not 0 <= self.ttft_bias_alpha <= 1:
            raise ValueError("ttft_bias_alpha must be in [0, 1]")
        if self.ttft_bias_rule not in TTFT_BIAS_RULES:
            raise ValueError(f"ttft_bias_rule must be one of {', '.join(TTFT_BIAS_RULES)}")
        if not 0 < self.slo_admit_fraction <= 1:
            raise ValueError("slo_admit_fraction must be in (0, 1]")
        if not 0 <= self.tbt_ratio_quantile <= 1:
            raise ValueError("tbt_ratio_quantile must be in [0, 1]")
        if self.ttft_margin_errors < 0:
            raise ValueError("ttft_margin_errors must be >= 0")
        if self.choose_error_margin < 0:
            raise ValueError("choose_error_margin must be >= 0")
        bounds = tuple(self.ttft_bias_load_bounds)
        if any(not isinstance(b, int) or b < 1 for b in bounds) or list(bounds) != sorted(set(bounds)):
            raise ValueError("ttft_bias_load_bounds must be increasing counts >= 1")
        self.ttft_bias_load_bounds = bounds


@dataclass
class _Inflight:
    decision: Decision
    req: ScheduleRequest
    scheduled_at: float
    ttft_bias_s: float = 0.0  # included in decision.predicted_ttft_s
    load_level: int = 0       # Scheduler.load_level when it was scheduled
    tbt_model_s: float = 0.0  # the decode model's TBT, before the node's learned ratio
    # Its prediction, or that of work booked ahead of it, came from an
    # estimator no measurement had refitted yet (the built-in guess or a
    # profile): its error says how wrong that prior was, not how far the
    # node's fitted predictions stray, and is kept out of the node's error
    # record (the learned admission headroom).
    priced_by_prior: bool = False


class Scheduler:
    def __init__(self, config: SchedulerConfig, prefill_estimator: PrefillEstimator,
                 transfer_estimator: TransferEstimator, decode_estimator: DecodeEstimator,
                 policy: Policy | None = None, index: GlobalCacheIndex | None = None) -> None:
        self.config = config
        self.index = index if index is not None else GlobalCacheIndex()
        self.prefill_est = prefill_estimator
        self.transfer_est = transfer_estimator
        self.decode_est = decode_estimator
        self.policy = policy if policy is not None else make_policy(config.policy,
                                                                    **config.policy_params)
        self.prefill: dict[str, PrefillNodeState] = {}
        self.decode: dict[str, DecodeNodeState] = {}
        self.inflight: dict[str, _Inflight] = {}
        self._outstanding: dict[str, int] = {}
        # Estimator feedback, (predicted - actual) TTFT per finished request:
        # running totals over every request, and the most recent ones (bounded:
        # a long-running conductor must not grow with traffic).
        self.ttft_errors: deque[float] = deque(maxlen=RECENT_TTFT_ERRORS)
        self._ttft_error_count = 0
        self._ttft_error_sum = 0.0
        self._ttft_error_abs_sum = 0.0
        self.rejections: dict[str, int] = {}
        # Prefill instances with their own estimator (CPP groups).
        self.node_estimators: dict[str, PrefillEstimator] = {}
        # Recent absolute TTFT errors per prefill node (ttft_margin_errors).
        self._node_ttft_errors: dict[str, deque[float]] = {}
        self._node_ttft_error_at: dict[str, float] = {}   # when the newest one came
        # Accepted requests per decode node: (when, expected output tokens).
        self._decode_arrivals: dict[str, deque[tuple[float, int]]] = {}
        # Learned TTFT the estimators miss (SchedulerConfig.ttft_bias_alpha):
        # over every node (what a node without a record of its own gets), and
        # per prefill node, (value, when last updated).
        self._ttft_bias_s = 0.0
        self._ttft_bias_at = 0.0
        self._node_ttft_bias: dict[str, tuple[float, float]] = {}
        # ... and per (prefill node, load level) (ttft_bias_load_bounds), as
        # (offset from the node's bias, when last updated): a level not seen
        # for a while returns to the node's bias, not to 0.
        self._level_ttft_offset: dict[tuple[str, int], tuple[float, float]] = {}
        # The "median" rule's step scale: recent mean |sample - bias|, per
        # prefill node, per (node, load level) and (key None) over all.
        self._ttft_bias_spread: dict[str | tuple[str, int] | None, float] = {}
        # Per prefill node: recent (predicted queue, batched-behind) pairs of
        # requests that waited, and the slope fitted on them (batch_wait_s).
        self._batch_waits: dict[str, deque[tuple[float, float]]] = {}
        self._batch_wait_slope: dict[str, float] = {}
        # Per decode node: recent (measured / predicted) TBT ratios, and when
        # the newest came (tbt_ratio_quantile).
        self._tbt_ratios: dict[str, deque[float]] = {}
        self._tbt_ratio_at: dict[str, float] = {}
        # ... and (the quantile asked for, its value) until the next ratio comes.
        self._tbt_ratio_learned: dict[str, tuple[float, float]] = {}
        # Per yielding prefill node: its learned progress share (value, when
        # measured) and its previous report's (running_s, worked_s) by id.
        self._yield_share: dict[str, tuple[float, float]] = {}
        self._yield_seen: dict[str, tuple[dict[str, float], dict[str, float]]] = {}

    # ---- membership ---------------------------------------------------
    def add_prefill_node(self, node: str, cache_capacity_blocks: int = 0,
                         yields_to: tuple[str, ...] = ()) -> None:
        """``yields_to``: decode nodes whose cores it borrows at idle
        priority (it computes only while they leave one idle)."""
        self.prefill[node] = PrefillNodeState(node, cache_capacity_blocks=cache_capacity_blocks,
                                              yields_to=tuple(yields_to))
        self._outstanding.setdefault(node, 0)
        if self.config.per_node_prefill_fit and node not in self.node_estimators:
            # A node that comes back keeps what it had learned of itself.
            self.node_estimators[node] = self.prefill_est.fork()

    def add_prefill_group(self, group: str, members: tuple[str, ...],
                          estimator: PrefillEstimator, cache_capacity_blocks: int = 0) -> None:
        """A Chunked Pipeline Parallelism group scheduled as one prefill instance
        with its own estimator (pipeline fill + steady state)."""
        self.prefill[group] = PrefillNodeState(group, cache_capacity_blocks=cache_capacity_blocks,
                                               group_members=tuple(members))
        self._outstanding.setdefault(group, 0)
        self.node_estimators[group] = estimator

    def estimator_for(self, node: str | None) -> PrefillEstimator:
        """The estimator that prices ``node``: its own fit once it has one,
        else the cluster-wide fit.  Until then its own copy would price it
        at whatever the cluster knew when it joined (at start, the prior):
        a node priced slower than the rest is not chosen, and so would never
        gather the samples that correct its price."""
        own = self.node_estimators.get(node) if node else None
        return own if own is not None and own.fitted_since_fork() else self.prefill_est

    def add_decode_node(self, node: str, page_budget: int, page_tokens: int) -> None:
        self.decode[node] = DecodeNodeState(node, page_budget, page_tokens)

    def mark_dead(self, node: str) -> None:
        """A dead node takes no work and its cache leaves the index."""
        if node in self.prefill:
            self.prefill[node].alive = False
        if node in self.decode:
            self.decode[node].alive = False
        self.index.remove_node(node)

    # ---- cache index feed ---------------------------------------------
    def on_events(self, node: str, seq: int, stored: Iterable[int],
                  evicted: Iterable[int]) -> bool:
        """Apply a shard's event batch; False means: ask the node to resync."""
        return self.index.apply_events(node, seq, stored, evicted)

    def on_blocks_ahead(self, node: str, seq: int, keys: Iterable[int]) -> bool:
        """Blocks a finished prefill stored, from its reply, ahead of the
        event batch ``seq`` that reports them (GlobalCacheIndex.add_ahead)."""
        return self.index.add_ahead(node, seq, keys)

    def resync(self, node: str, keys: Iterable[int], next_seq: int | None = None) -> None:
        self.index.resync(node, keys, next_seq)

    # ---- the decision -------------------------------------------------
    def _context(self, req: ScheduleRequest, now: float) -> PlanContext | None:
        # Candidates take new work; a draining node (accepting=False) is not a
        # candidate but its cache still counts: peers may pull from it.
        nodes = [n for n, s in self.prefill.items() if s.alive and s.accepting]
        if not nodes:
            return None
        alive = {n for n, s in self.prefill.items() if s.alive}
        matches = {n: b for n, b in self.index.longest_prefix_per_node(req.block_keys).items()
                   if n in alive}
        busy: dict[str, list[borrowed.Interval]] = {}
        level = self.load_level()

        def busy_of(node: str) -> list[borrowed.Interval]:
            # Worked out once per decision, and only for a node priced as yielding.
            if node not in busy:
                busy[node] = self.yielded_busy(node) if self.yields(node) else []
            return busy[node]

        def wall_s(node: str, start: float, work: float) -> float:
            if not self.yields(node):
                return work
            # At ``share`` of the modelled progress, work w takes the wall
            # time the model gives w / share.
            return borrowed.wall_for(busy_of(node), start, work / self.yield_share(node, now),
                                     after=now, idle_rate=self.yielded_idle_rate(node, now))

        return PlanContext(
            req, now, nodes, matches,
            queue_time=lambda n: self.prefill[n].queue_time(
                now, self.progress_fn(n, busy_of(n), now)),
            prefill_s=self.prefill_est.seconds,
            transfer_s=lambda src, nbytes: self.transfer_est.seconds(src, nbytes, now),
            kv_bytes_per_token=self.config.kv_bytes_per_token,
            outstanding=lambda n: self._outstanding.get(n, 0),
            cached_blocks=self.index.blocks_on,
            node_prefill_s=lambda node, n, p: self.estimator_for(node).seconds(n, p),
            transferable=lambda node: not self.prefill[node].group_members,
            wall_s=wall_s,
            extra_s=(lambda node: self.ttft_bias(now, node, level) + self.config.choose_error_margin
                     * self.node_mean_abs_error(node)) if self.config.choose_error_margin > 0
            else None)

    # ---- prefill nodes that yield their cores -----------------------------
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

    def progress_fn(self, node: str, busy: list[borrowed.Interval] | None = None,
                    now: float | None = None) -> Progress:
        """Work ``node`` does between two instants (see PrefillNodeState.queue_time):
        for a yielding node, the gaps of its decode nodes' busy intervals at
        its learned ``yield_share`` (as of ``now``; unscaled when None)."""
        if not self.yields(node):
            return wall_progress
        spans = self.yielded_busy(node) if busy is None else busy
        share = 1.0 if now is None else self.yield_share(node, now)
        return lambda start, end: share * borrowed.progress(spans, start, end)

    def yield_share(self, node: str, now: float) -> float:
        """The share of its modelled progress that yielding node ``node``
        has lately been measured to get (1 until measured; back halfway to 1
        every YIELD_SHARE_HALF_LIFE_S without a measurement).

        The model (borrowed.py) knows only the decode work this conductor
        booked; the conductor's own process, a benchmark client or any other
        program on those cores takes its CPU too, unseen.  Measured in a
        replay beside a package install: a 1,486-token prefill got 0.16 s of
        CPU in 2.25 s, while the model, counting it done after its 0.2 s of
        work, priced the node's queue at 0 and sent it four more requests
        (TTFT 2.4-11 s against predictions of 0.2-0.9 s)."""
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

    def step_seconds(self, node: str) -> float:
        """The decode node's step time as last measured (its reported TBT),
        else the estimator's for its current batch: the pace at which its
        running sequences are expected to finish."""
        d = self.decode[node]
        if d.recent_tbt_s > 0:
            return d.recent_tbt_s
        return self.decode_est.seconds(max(1, d.batch_size), d.context_tokens) or 1e-3

    def predict_decode_load(self, node: str, at: float,
                            step_s: float | None = None) -> DecodeLoad:
        """Batch size and context tokens of a decode node at time `at`.

        Every sequence decodes one token per step of `step_s` seconds
        (default `step_seconds`). A sequence the node reported (as of
        `running_at`) is still in the batch at `at` if it has tokens left
        to generate by then; a booked request not in the report joins at
        its predicted join time, or at the report's time if that report
        came later and did not name it (it is late, not gone), and stays
        for its `output_tokens - 1` decode steps. Context grows by one
        token per step.
        """
        d = self.decode[node]
        step = step_s if step_s is not None else self.step_seconds(node)
        step = max(step, 1e-9)
        batch = context = 0
        running = d.running or {}
        for seq in running.values():
            steps = max(0.0, at - d.running_at) / step + _STEP_EPS
            if seq.remaining_tokens > steps:
                batch += 1
                context += seq.context_tokens + int(steps)
        for rid, b in d.booked.items():
            if rid in running:
                continue
            join = max(b.join_at, d.running_at) if d.running is not None else b.join_at
            if join > at:
                continue
            steps = (at - join) / step + _STEP_EPS
            if b.output_tokens - 1 > steps:
                batch += 1
                context += b.prompt_tokens + int(steps)
        return DecodeLoad(batch, context)

    def current_decode_load(self, node: str) -> DecodeLoad:
        """The decode node's load as it last reported it, less the sequences
        finished since: what "reject on current load" sees. Requests booked
        to it and not in a report yet are not counted."""
        running = self.decode[node].running or {}
        return DecodeLoad(len(running), sum(s.context_tokens for s in running.values()))

    def _tbt_at_join(self, node: str, at: float, prompt_tokens: int) -> float:
        """Predicted step time once a request of `prompt_tokens` joins `node` at `at`.

        Sequences are projected at the measured step time, but a batch that
        grows also slows down and so keeps its sequences longer: the step
        time is raised to the predicted one and the load projected again
        until the two agree (monotone, so a few rounds reach the fixed point).
        """
        step = self.step_seconds(node)
        tbt = step
        for _ in range(DECODE_FIXED_POINT_ROUNDS):
            load = self.predict_decode_load(node, at, step)
            tbt = self.decode_est.seconds(load.batch + 1, load.context_tokens + prompt_tokens + 1)
            if tbt <= step * 1.01:
                break
            step = tbt
        return tbt

    def select_decode(self, req: ScheduleRequest, now: float | None = None,
                      join_in_s: float = 0.0) -> tuple[DecodeNodeState | None, float]:
        """The decode node with the least predicted TBT (``_decode_choice``)
        and that TBT."""
        best, tbt, _ = self._decode_choice(req, now, join_in_s)
        return best, tbt

    def tbt_ratio(self, node: str, now: float) -> float:
        """What requests that finished on decode node ``node`` lately
        measured as their TBT over what the model predicted for them: the
        tbt_ratio_quantile of the last NODE_ERROR_SAMPLES ratios (1 until it
        has that many, or with the quantile 0), moving halfway back to 1
        every TBT_RATIO_HALF_LIFE_S without a new one: a node refused work
        for its ratio is tried again soon, and measured again."""
        q = self.config.tbt_ratio_quantile
        ratios = self._tbt_ratios.get(node)
        if q <= 0 or ratios is None or len(ratios) < NODE_ERROR_SAMPLES:
            return 1.0
        cached_q, learned = self._tbt_ratio_learned.get(node, (None, 1.0))
        if cached_q != q:  # sorted once per new ratio (or quantile), not per decision
            ordered = sorted(ratios)
            learned = ordered[min(len(ordered) - 1, int(q * len(ordered)))]
            self._tbt_ratio_learned[node] = (q, learned)
        return _decayed(learned, 1.0, now - self._tbt_ratio_at[node], TBT_RATIO_HALF_LIFE_S)

    def _decode_choice(self, req: ScheduleRequest, now: float | None = None, join_in_s: float = 0.0
                       ) -> tuple[DecodeNodeState | None, float, float]:
        """Least predicted TBT among live decode nodes with pages for the
        request: (node, its TBT scaled by its learned ``tbt_ratio``, the
        model's TBT before that).

        With `now`, TBT is predicted from the load each node will have when
        the request joins it, `join_in_s` (its predicted TTFT) from now; the
        paper's prediction-based early rejection. Without, from the current
        batch plus this request.
        """
        tokens = req.prompt_tokens + req.expected_output_tokens
        best, best_tbt, best_model = None, math.inf, math.inf
        for d in self.decode.values():
            if not d.alive or not d.accepting or d.free_pages < d.pages_for(tokens):
                continue
            if now is None:
                tbt = self.decode_est.seconds(d.batch_size + 1, d.context_tokens + tokens)
            elif self.config.reject_on_current_load:
                load = self.current_decode_load(d.node_id)
                tbt = self.decode_est.seconds(load.batch + 1,
                                              load.context_tokens + req.prompt_tokens + 1)
            else:
                tbt = self._tbt_at_join(d.node_id, now + join_in_s, req.prompt_tokens)
            scaled = tbt if now is None else tbt * self.tbt_ratio(d.node_id, now)
            if scaled < best_tbt:
                best, best_tbt, best_model = d, scaled, tbt
        return best, best_tbt, best_model

    def _choose(self, ctx: PlanContext) -> PrefillPlan:
        """The policy's plan; with yielding_overflow_only, among the nodes
        with cores of their own first, and on a yielding node only when none
        of those admits the request and a yielding node does (else the
        first plan stands, to be rejected)."""
        if self.config.yielding_overflow_only:
            overflow = [n for n in ctx.nodes if self.prefill[n].yields_to]
            own = [n for n in ctx.nodes if not self.prefill[n].yields_to]
            if overflow and own:
                ctx.nodes = own
                plan = self._choose_among(ctx)
                if self._admits(plan, ctx.now):
                    return plan
                ctx.nodes = overflow
                spill = self._choose_among(ctx)
                return spill if self._admits(spill, ctx.now) else plan
        return self._choose_among(ctx)

    def _choose_among(self, ctx: PlanContext) -> PrefillPlan:
        plan = self.policy.choose(ctx)
        if self.config.reject and self.config.ttft_margin_errors > 0:
            plan = self._admissible_plan(ctx, plan)
        return plan

    def _admits(self, plan: PrefillPlan, now: float) -> bool:
        """The plan's TTFT, with the node's learned bias, is within the
        node's admit limit."""
        return plan.ttft + self.ttft_bias(now, plan.node, self.load_level()) \
            + self.batch_wait_s(plan.node, plan.t_queue) <= self.ttft_admit_limit(plan.node, now)

    def _admissible_plan(self, ctx: PlanContext, plan: PrefillPlan) -> PrefillPlan:
        """With TTFT limits learned per node (ttft_margin_errors), the
        policy's choice may exceed its own node's limit while the next best
        node, whose predictions hold better, admits the same request: the
        policy chooses again without the nodes that refused, and its first
        choice stands (to be rejected) when every node refuses.  Nothing
        changes while the choice is within its limit, so Algorithm 1 decides
        whenever the SLO is not at stake."""
        first = plan
        nodes = list(ctx.nodes)
        while not self._admits(plan, ctx.now):
            nodes.remove(plan.node)
            if not nodes:
                return first
            ctx.nodes = nodes
            plan = self.policy.choose(ctx)
        return plan

    def _reject(self, req: ScheduleRequest, reason: str, ttft: float, tbt: float,
                retry: float, limit: float = math.inf) -> Rejection:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1
        retry = min(self.config.max_retry_after_s, max(self.config.min_retry_after_s, retry))
        return Rejection(req.request_id, reason, ttft, tbt, retry, limit)

    def schedule(self, req: ScheduleRequest, now: float) -> Decision | Rejection:
        if req.request_id in self.inflight:
            raise ValueError(f"request_id {req.request_id!r} is already scheduled")
        ctx = self._context(req, now)
        if ctx is None:
            return self._reject(req, "no_prefill_node", math.inf, math.inf, 1.0)
        plan = self._choose(ctx)
        cfg = self.config
        # The bias moves the chosen node's prediction, not the choice (which
        # stays Algorithm 1's queue + transfer + prefill).
        level = self.load_level()
        bias = self.ttft_bias(now, plan.node, level)
        ttft = plan.ttft + bias + self.batch_wait_s(plan.node, plan.t_queue)
        dnode, tbt, tbt_model = self._decode_choice(req, now, ttft)
        if dnode is None:
            return self._reject(req, "no_decode_capacity", ttft, math.inf, 1.0)
        ttft_limit = self.ttft_admit_limit(plan.node, now)
        if cfg.reject and ttft > ttft_limit:
            return self._reject(req, "ttft_slo", ttft, tbt, ttft - ttft_limit, ttft_limit)
        tbt_limit = cfg.tbt_slo_s * cfg.slo_admit_fraction
        if cfg.reject and tbt > tbt_limit:
            return self._reject(req, "tbt_slo", ttft, tbt, 1.0, tbt_limit)

        decision = Decision(req.request_id, plan.node, dnode.node_id,
                            req.prefix_tokens(plan.local_prefix_blocks), plan.prefix_tokens,
                            plan.transfer, ttft, tbt, plan.t_queue, plan.t_transfer,
                            plan.t_prefill, self.policy.name)
        # Book the work so the next decision sees it before any heartbeat.
        work = plan.t_prefill if plan.prefill_work_s is None else plan.prefill_work_s
        pending = self.prefill[plan.node].pending
        by_prior = not self.estimator_for(plan.node).fitted_since_fork()
        # Its prediction holds the prior's error if its own price or the
        # price of any work booked ahead of it came from the prior.
        prior_in_ttft = by_prior or any(p.priced_by_prior for p in pending.values())
        pending[req.request_id] = PendingPrefill(work, now, expected_start=now + plan.t_queue,
                                                 priced_by_prior=by_prior)
        self._outstanding[plan.node] = self._outstanding.get(plan.node, 0) + 1
        if plan.transfer is not None:
            self.transfer_est.reserve(plan.transfer.source, plan.transfer.bytes, now)
        tokens = req.prompt_tokens + req.expected_output_tokens
        pages = dnode.pages_for(tokens)
        dnode.reserved[req.request_id] = (pages, tokens)
        dnode.booked[req.request_id] = BookedJoin(now + ttft, req.prompt_tokens,
                                                  req.expected_output_tokens)
        dnode.free_pages -= pages
        if cfg.price_yielded_work:  # only what prices a yielding node reads them
            arrivals = self._decode_arrivals.setdefault(dnode.node_id,
                                                        deque(maxlen=ARRIVALS_KEPT))
            arrivals.append((now, req.expected_output_tokens))
        dnode.batch_size += 1
        dnode.context_tokens += tokens
        self.inflight[req.request_id] = _Inflight(
            decision, req, now, bias, level, tbt_model, priced_by_prior=prior_in_ttft)
        return decision

    # ---- feedback from execution ----------------------------------------
    def on_prefill_started(self, node: str, request_id: str, now: float) -> None:
        p = self.prefill[node].pending.get(request_id)
        if p is not None:
            p.started_at = now

    def on_prefill_finished(self, node: str, request_id: str, now: float,
                            actual_seconds: float,
                            actual_prefix_tokens: int | None = None,
                            actual_queue_s: float | None = None,
                            actual_work_s: float | None = None,
                            actual_batched_ahead_s: float = 0.0,
                            actual_batched_behind_s: float | None = None,
                            actual_ttft_s: float | None = None) -> None:
        """Prefill done (first token out): refit and record the TTFT error.

        `actual_ttft_s`: the request's measured TTFT, when the caller counts
        it from earlier than the decision (the HTTP conductor: from the
        request's arrival, before its body was read and tokenized); None:
        from the decision to ``now``.

        `actual_queue_s`, when the node measured it, is the time the request
        waited in the node's queue: the learned TTFT bias then holds only what
        neither the queue nor the prefill explains (RPCs, the reservation).

        `actual_work_s`, the CPU seconds its compute took: what a node that
        yields its cores (``yields_to``) is fitted on, since its wall time
        holds whatever the decode nodes ran meanwhile.

        `actual_batched_ahead_s`: in a batched pass, the part of the pass
        spent on the requests ahead of this one in it.  Its first token
        waited for it, but its queue estimate already held their work: the
        bias must not learn it a second time.

        `actual_batched_behind_s`: the part spent on the requests behind it
        in the pass (0: none; None: not measured, nothing learned): what
        batch_wait_s is fitted on, and not the bias's to learn either.

        `actual_seconds <= 0` means "no measurement" (cancelled or failed
        prefill): the booking is released but nothing is learned from it.
        """
        done = None
        if node in self.prefill:
            st = self.prefill[node]
            done = st.pending.pop(request_id, None)
            if done is not None:
                st.recently_done[request_id] = None
                while len(st.recently_done) > RECENTLY_DONE_KEPT:
                    del st.recently_done[next(iter(st.recently_done))]
            if done is not None and done.in_report:
                # The node moves on to the next named request now: what is
                # left of the reported work is the rest of the named ones.
                progress = self.progress_fn(node, now=now)
                st.reported_queue_s = sum(p.remaining_s(now, progress=progress)
                                          for p in st.pending.values() if p.in_report)
                st.reported_at = now
        self._outstanding[node] = max(0, self._outstanding.get(node, 0) - 1)
        inf = self.inflight.get(request_id)
        if inf is None or actual_seconds <= 0:
            return
        # Fit on what happened: the prefix the node really reused (a failed
        # fetch or an eviction makes it shorter than planned), not the plan.
        prefix = inf.decision.prefix_tokens if actual_prefix_tokens is None \
            else actual_prefix_tokens
        fitted = actual_seconds
        if node in self.prefill and self.yields(node) and actual_work_s is not None \
                and actual_work_s > 0:
            fitted = actual_work_s
        if done is not None and done.estimate_s > 0:
            # What a late request's rest is read from (late_rest_s).
            self.prefill[node].late_ratios.append(fitted / done.estimate_s)
        own = self.node_estimators.get(node)
        if own is not None:
            own.observe(inf.req.prompt_tokens, prefix, fitted)
        # A node's own fit also feeds the cluster-wide one (what prices a node
        # without its own fit yet); a CPP group's pipeline times are not a node's.
        group = node in self.prefill and self.prefill[node].group_members
        if own is None or not group:
            self.prefill_est.observe(inf.req.prompt_tokens, prefix, fitted)
        if actual_batched_behind_s is not None and node in self.prefill:
            self._learn_batch_wait(node, inf.decision.t_queue, actual_batched_behind_s)
        actual_ttft = now - inf.scheduled_at if actual_ttft_s is None else actual_ttft_s
        error = inf.decision.predicted_ttft_s - actual_ttft
        alpha = self.config.ttft_bias_alpha
        if alpha:
            # What the estimators missed for this request, less their
            # prefill error (the refit above learns that) and, when measured,
            # their queue error (the node's reports correct that): its TTFT
            # minus the measured prefill, the queue, the predicted transfer.
            d = inf.decision
            queue = d.t_queue if actual_queue_s is None else actual_queue_s
            missed = actual_ttft - actual_seconds - actual_batched_ahead_s - queue - d.t_transfer \
                - (actual_batched_behind_s or 0.0)
            # Per node too: what one node's replies wait for (a borrower's
            # event loop behind decode bursts) is not another's.  (Its old
            # value is read first: without a record of its own it is the
            # bias over all nodes as it was before this sample.)
            node_bias = self.ttft_bias(now, node)
            if self.config.ttft_bias_load_bounds:
                # The level's offset follows what its requests miss beyond
                # the node's bias as it stood for them (measured against
                # the node's bias after this sample, the node's own step
                # would cancel the level's).
                key = (node, inf.load_level)
                level_bias = self._biased(key, self.ttft_bias(now, node, inf.load_level), missed)
                self._level_ttft_offset[key] = (level_bias - node_bias, now)
            self._node_ttft_bias[node] = (self._biased(node, node_bias, missed), now)
            self._ttft_bias_s = self._biased(None, self.ttft_bias(now), missed)
            self._ttft_bias_at = now
        self.ttft_errors.append(error)
        if not inf.priced_by_prior:
            # Seen on the Synthetic trace at 4x: the first ~15 requests after
            # start, priced by the built-in guess at twice their time, were
            # 0.1-0.6 s off, then 5-60 ms once the fit had run; in a record
            # of 64 they held the admit limit near 0.63 s (SLO 1 s) until
            # 64 requests later, refusing prompts the node served in time.
            self._node_ttft_errors.setdefault(node, deque(maxlen=NODE_ERROR_WINDOW)).append(
                abs(error))
            self._node_ttft_error_at[node] = now
        self._ttft_error_count += 1
        self._ttft_error_sum += error
        self._ttft_error_abs_sum += abs(error)

    def _biased(self, key: str | tuple[str, int] | None, bias: float, missed: float) -> float:
        """The bias of ``key`` (a prefill node, a (node, load level); None:
        over all) after the sample ``missed``, by ttft_bias_rule; never below 0."""
        alpha = self.config.ttft_bias_alpha
        if self.config.ttft_bias_rule == "mean":
            return max(0.0, (1 - alpha) * bias + alpha * missed)
        # A new key starts from the spread of what it refines (a load level
        # from its node's, a node from the one over all): started from 0 its
        # steps would be too small to move for tens of samples.
        known = self._ttft_bias_spread
        start = known.get(key[0] if isinstance(key, tuple) else None, known.get(None, 0.0))
        spread = (1 - alpha) * known.get(key, start) + alpha * abs(missed - bias)
        self._ttft_bias_spread[key] = spread
        step = TTFT_BIAS_MEDIAN_STEP * spread
        return max(0.0, bias + step if missed > bias else bias - step)

    def node_mean_abs_error(self, node: str) -> float:
        """The node's recent mean absolute TTFT error; 0 until it has
        NODE_ERROR_SAMPLES finished requests."""
        errors = self._node_ttft_errors.get(node)
        if errors is None or len(errors) < NODE_ERROR_SAMPLES:
            return 0.0
        return sum(errors) / len(errors)

    def ttft_admit_limit(self, node: str, now: float) -> float:
        """The highest predicted TTFT admitted on ``node`` at ``now``: the SLO
        less its learned headroom (ttft_margin_errors x its recent mean
        absolute error), else the SLO x slo_admit_fraction.  The learned
        headroom moves back toward the default one while the node finishes
        nothing (ttft_margin_half_life_s)."""
        cfg = self.config
        default = cfg.ttft_slo_s * (1 - cfg.slo_admit_fraction)
        errors = self._node_ttft_errors.get(node)
        if cfg.ttft_margin_errors <= 0 or errors is None or len(errors) < NODE_ERROR_SAMPLES:
            return cfg.ttft_slo_s - default
        learned = cfg.ttft_margin_errors * sum(errors) / len(errors)
        margin = _decayed(learned, default, now - self._node_ttft_error_at[node],
                          cfg.ttft_margin_half_life_s)
        return max(0.0, cfg.ttft_slo_s - margin)

    def batch_wait_s(self, node: str, t_queue_s: float) -> float:
        """What a request predicted to wait ``t_queue_s`` in ``node``'s queue
        is expected to wait beyond its queue and its own prefill: the work of
        the requests that join its batched pass meanwhile (a pass ends for
        all its requests at once).

        Learned per node as slope x queue: what arrives while a request
        waits grows with the wait.  Seen on a trace of short chats at 4x its
        rate: requests that waited 80 ms or more then waited 11-16 ms more
        (median) for the requests behind them in their pass, 0.10-0.17 x
        their queue, while those that hardly waited met none; on a trace of
        long prompts (not batched) it stays near 0."""
        if t_queue_s <= 0:
            return 0.0
        return self._batch_wait_slope.get(node, 0.0) * t_queue_s

    def _learn_batch_wait(self, node: str, t_queue_s: float, behind_s: float) -> None:
        """One sample of batch_wait_s's slope: the least-absolute-error line
        through 0 over the node's recent samples, i.e. the median of
        behind / queue weighted by the queue (a request that hardly waited
        says little about the slope)."""
        if t_queue_s <= 0:
            return
        samples = self._batch_waits.setdefault(node, deque(maxlen=BATCH_WAIT_SAMPLES))
        samples.append((t_queue_s, max(0.0, behind_s)))
        ratios = sorted((b / q, q) for q, b in samples)
        half, seen = sum(q for q, _ in samples) / 2.0, 0.0
        for ratio, weight in ratios:
            seen += weight
            if seen >= half:
                self._batch_wait_slope[node] = ratio
                break

    def load_level(self) -> int:
        """Which of ttft_bias_load_bounds' levels the requests in flight now
        fall in (0: below the first bound)."""
        return bisect.bisect_right(self.config.ttft_bias_load_bounds, len(self.inflight))

    def ttft_bias(self, now: float, node: str | None = None, level: int | None = None) -> float:
        """The learned TTFT bias at `now` (0 unless ttft_bias_alpha > 0): of
        prefill node ``node`` once it has finished a request (else over all),
        plus what requests scheduled at load level ``level`` missed beyond
        that (decaying to nothing while none of that level finishes)."""
        half_life = self.config.ttft_bias_half_life_s
        if node is not None:
            value, at = self._node_ttft_bias.get(node, (self._ttft_bias_s, self._ttft_bias_at))
        else:
            value, at = self._ttft_bias_s, self._ttft_bias_at
        bias = _decayed(value, 0.0, now - at, half_life)
        if node is not None and level is not None and (node, level) in self._level_ttft_offset:
            offset, at = self._level_ttft_offset[(node, level)]
            bias = max(0.0, bias + _decayed(offset, 0.0, now - at, half_life))
        return bias

    def on_transfer_finished(self, source: str, nbytes: int, seconds: float) -> None:
        self.transfer_est.observe(source, nbytes, seconds)

    def on_decode_finished(self, node: str, request_id: str, now: float,
                           measured_tbt_s: float | None = None) -> None:
        """The request left decode node ``node``; ``measured_tbt_s``: its TBT
        as the paper defines it (mean of its longest 10% token intervals), when
        it streamed to the end, which the node's TBT ratio learns from."""
        inf = self.inflight.pop(request_id, None)
        if measured_tbt_s is not None and measured_tbt_s > 0 and inf is not None \
                and inf.decision.decode_node == node and inf.tbt_model_s > 0:
            low, high = TBT_RATIO_BOUNDS
            ratio = min(high, max(low, measured_tbt_s / inf.tbt_model_s))
            # The newest NODE_ERROR_SAMPLES only: what stretches the TBT (a
            # program busy on its cores) comes and goes within seconds.
            self._tbt_ratios.setdefault(node, deque(maxlen=NODE_ERROR_SAMPLES)).append(ratio)
            self._tbt_ratio_at[node] = now
            self._tbt_ratio_learned.pop(node, None)
        d = self.decode.get(node)
        if d is None:
            return
        pages, tokens = d.reserved.pop(request_id, (0, 0))
        d.booked.pop(request_id, None)
        if d.running is not None:
            d.running.pop(request_id, None)  # a report older than the finish may name it
        d.free_pages += pages
        d.batch_size = max(0, d.batch_size - 1)
        d.context_tokens = max(0, d.context_tokens - tokens)

    def on_node_report(self, node: str, report: NodeReport, now: float) -> None:
        """Heartbeat: replace our estimate of the node's load by its own."""
        if node in self.prefill and self.config.queue_from_bookings \
                and report.prefill_requests is not None:
            s = self.prefill[node]
            named = report.prefill_requests
            running = report.prefill_running_s or {}
            worked = (report.prefill_worked_s or {}) if self.yields(node) else {}
            if self.yields(node):
                self._learn_yield_share(node, report, now)
            for rid, p in s.pending.items():
                p.in_report = rid in named
                if rid in worked:
                    # It has done this much of its work; what it does from
                    # here depends on when the decode nodes let it run.
                    p.started_at, p.worked_before_s = report.at, max(0.0, worked[rid])
                elif rid in running:
                    p.started_at = report.at - max(0.0, running[rid])
            # A running request counts what is left of its estimate: counted
            # whole, every report restarted it and a long prefill made the
            # queue look up to its full length too long for its whole run.
            ours = sum(p.remaining_s(report.at) for p in s.pending.values() if p.in_report)
            # Named requests of ours whose answer came after the report was
            # taken are done, not someone else's: only a request this
            # scheduler never booked (another conductor's) calls for the
            # node's own figure, which prices tokens at a rate that short
            # prompts drag down (a fixed cost per request).
            foreign = named - s.pending.keys() - s.recently_done.keys()
            if not foreign or report.queued_prefill_s is None:
                s.reported_queue_s = ours
            else:
                s.reported_queue_s = max(ours, report.queued_prefill_s)
            s.reported_at = report.at
        elif node in self.prefill and report.queued_prefill_s is not None:
            s = self.prefill[node]
            s.reported_queue_s, s.reported_at = report.queued_prefill_s, report.at
            if report.prefill_requests is not None:
                # The node says which requests its figure holds: every other
                # booking (not delivered yet, e.g. still waiting for its decode
                # reservation) stays counted until a report covers it.
                s.pending = {r: p for r, p in s.pending.items()
                             if r not in report.prefill_requests}
            else:
                # No ids: work booked before the report counts as in the figure.
                s.pending = {r: p for r, p in s.pending.items() if p.sent_at > report.at}
        d = self.decode.get(node)
        if d is not None:
            if report.batch_size is not None:
                d.batch_size = report.batch_size
            if report.context_tokens is not None:
                d.context_tokens = report.context_tokens
            if report.free_pages is not None:
                d.free_pages = report.free_pages
            if report.decode_sequences is not None:
                # The node's word replaces ours: a sequence it no longer
                # names has finished there (or not joined yet: then its
                # booking counts it).
                d.running = dict(report.decode_sequences)
                d.running_at = report.at
            if report.decode_steps and max(st.step for st in report.decode_steps) \
                    < d.last_step_seen:
                d.last_step_seen = -1  # the node restarted its step counter
            new_steps = [st for st in report.decode_steps if st.step > d.last_step_seen]
            for st in new_steps:
                # Fit the TBT model on the steps the node measured.
                self.decode_est.observe(st.batch, st.context_tokens, st.seconds)
                d.last_step_seen = max(d.last_step_seen, st.step)
            if report.recent_tbt_s is not None:
                d.recent_tbt_s = report.recent_tbt_s
                # No per-step figures: calibrate on the node's recent TBT.
                if report.batch_size and not report.decode_steps:
                    self.decode_est.observe(report.batch_size, report.context_tokens or 0,
                                            report.recent_tbt_s)

    def estimator_error(self) -> dict[str, float]:
        """Mean and mean-absolute (predicted - actual) TTFT, seconds."""
        n = self._ttft_error_count
        if not n:
            return {"count": 0, "mean_s": 0.0, "mean_abs_s": 0.0}
        return {"count": n, "mean_s": self._ttft_error_sum / n,
                "mean_abs_s": self._ttft_error_abs_sum / n}
