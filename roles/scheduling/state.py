"""Cluster view and decision types of the conductor's scheduling core.

Everything here is plain data: no I/O, no clock. Times are seconds on
whatever clock the caller drives (wall clock in the HTTP conductor, the
simulated clock in the simulator); the core never reads a clock itself.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

# Work a prefill node does between two instants: `end - start` on cores of
# its own; less where it yields its cores to others (borrowed.progress).
Progress = Callable[[float, float], float]


def wall_progress(start: float, end: float) -> float:
    """The Progress of a node on cores of its own: the time between."""
    return max(0.0, end - start)


# A prefill node's last measured / estimated prefill times, from which a
# late request's expected rest is read (PrefillNodeState.late_rest_s).
LATE_RATIOS_KEPT = 64


@dataclass(frozen=True)
class ScheduleRequest:
    """What the conductor knows about a request when it schedules it.

    `block_keys[i]` is the chained hash of prompt block i (block_size tokens;
    the last block may be partial), so equal keys at equal positions mean
    equal whole prefixes.
    """

    request_id: str
    block_keys: tuple[int, ...]
    prompt_tokens: int
    block_size: int
    expected_output_tokens: int = 0
    # Seconds the request has already waited when it is scheduled (its body
    # read and tokenizing): its TTFT counts from its arrival, as its
    # client's does, so the prediction adds this known part to the rest.
    waited_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prompt_tokens <= 0:
            raise ValueError("prompt_tokens must be > 0")
        if not self.waited_s >= 0:
            raise ValueError("waited_s must be >= 0")
        if self.block_size <= 0:
            raise ValueError("block_size must be > 0")
        if self.expected_output_tokens < 0:
            raise ValueError("expected_output_tokens must be >= 0")
        want = -(-self.prompt_tokens // self.block_size)
        if len(self.block_keys) != want:
            raise ValueError(
                f"block_keys: expected ceil({self.prompt_tokens}/{self.block_size})"
                f" = {want} keys, got {len(self.block_keys)}")

    def prefix_tokens(self, n_blocks: int) -> int:
        """Tokens reusable from a prefix of n_blocks cached blocks.

        At least one token is always computed: the last prompt position must
        run through the model to produce the first output token.
        """
        return min(n_blocks * self.block_size, self.prompt_tokens - 1)


@dataclass
class PendingPrefill:
    """Work sent to a prefill node and not finished yet.

    `in_report`: the node's latest report names it, so that report's figure
    counts it (see PrefillNodeState); kept only with queue_from_bookings.
    """

    estimate_s: float
    sent_at: float
    started_at: float | None = None
    in_report: bool = False
    # When it should start by the queue predicted at booking (FIFO: when the
    # work booked before it is done); None: unknown (counted whole until a
    # report says it runs).
    expected_start: float | None = None
    # Work the node said it had done on it by `started_at` (a node that
    # yields its cores reports CPU seconds, not time since it started).
    worked_before_s: float = 0.0
    # Its estimate came from a prior no measurement had refitted yet.
    priced_by_prior: bool = False

    def remaining_s(self, now: float, use_expected_start: bool = False,
                    progress: Progress = wall_progress) -> float:
        """Its estimate less the work done on it: since the node said it
        started, or (``use_expected_start``, for work no report covers yet)
        since it was expected to start; all of it before that."""
        return max(0.0, self.estimate_s - self.work_done_s(now, use_expected_start, progress))

    def work_done_s(self, now: float, use_expected_start: bool = False,
                    progress: Progress = wall_progress) -> float:
        """The work done on it by ``now``, as remaining_s counts it (0 before
        it started); at or past ``estimate_s`` it is late."""
        start = self.started_at
        if start is None and use_expected_start:
            start = self.expected_start
        if start is None or now <= start:
            return self.worked_before_s
        return self.worked_before_s + progress(start, now)


@dataclass
class PrefillNodeState:
    """The conductor's view of one prefill node (or, later, one CPP group).

    Queue time = what the node last reported (decayed by the time since the
    report, since the node kept working) + estimates of work sent after
    that report. Invariant: every entry of `pending` was sent after
    `reported_at` or has not been accounted for by any report yet.
    """

    node_id: str
    alive: bool = True
    cache_capacity_blocks: int = 0
    # False while the node drains: no new prefills, but its cache is still
    # served to peers (it stays in the index and may be a transfer source).
    accepting: bool = True
    reported_queue_s: float = 0.0
    reported_at: float = 0.0
    pending: dict[str, PendingPrefill] = field(default_factory=dict)
    # Requests of ours whose prefill finished lately (bounded, oldest first):
    # a report taken before their answer arrived still names them.
    recently_done: dict[str, None] = field(default_factory=dict)
    # Seam for Chunked Pipeline Parallelism: a group of nodes acting as one
    # prefill instance. Empty means a single node.
    group_members: tuple[str, ...] = ()
    # Decode nodes whose cores this node borrows at idle priority: it
    # computes only while they leave a core idle (roles/scheduling/borrowed.py).
    # Its estimates, queue and reports are then in work seconds.
    yields_to: tuple[str, ...] = ()
    # A colocated node (also a decode node): the most tokens of a prefill
    # chunk while decode sequences run there, a step between two chunks; 0 =
    # not colocated, or chunks of unknown size.
    interleave_tokens: int = 0
    # How many decode steps' time a chunk holds the thread before it gives
    # way to a waiting step (0: the whole chunk; see NodeBookings.chunk_s).
    interleave_step_ratio: float = 0.0
    # Measured / estimated time of its latest prefills (oldest first).
    late_ratios: deque[float] = field(default_factory=lambda: deque(maxlen=LATE_RATIOS_KEPT))

    def queue_time(self, now: float, progress: Progress = wall_progress) -> float:
        """Seconds of work queued at ``now``; ``progress`` is how much of it
        the node gets through between two instants."""
        backlog = max(0.0, self.reported_queue_s - progress(self.reported_at, now))
        for p in self.pending.values():
            # Named by the report: in reported_queue_s, which decays as a
            # whole.  Not yet: it runs from its expected start on (counted
            # whole until the next report, a request sent to an idle node
            # made the queue look its full length for up to a heartbeat).
            if not p.in_report:
                backlog += p.remaining_s(now, use_expected_start=True, progress=progress)
        return max(backlog, self.late_floor_s(now, progress))

    def late_floor_s(self, now: float, progress: Progress = wall_progress) -> float:
        """The least queue a late request implies: the expected rest of the
        first booked request that is past its estimate and unanswered, plus
        the work booked after it, which the node (FIFO) has not started.

        Without it a late request's part of the queue counted 0 while the
        node was still busy with it: on a replay a 1,038-token prefill ran
        177 ms against 108 predicted (the host was slow), and a request sent
        in that overrun was predicted no queue and waited 53 ms."""
        floor, late = 0.0, False
        for p in self.pending.values():  # in booking order
            if late:
                # Whole, unless a report says it started (a batched pass).
                floor += p.remaining_s(now, progress=progress)
                continue
            done = p.work_done_s(now, use_expected_start=not p.in_report, progress=progress)
            if p.estimate_s > 0 and done >= p.estimate_s:
                late, floor = True, self.late_rest_s(p.estimate_s, done)
        return floor

    def late_rest_s(self, estimate_s: float, done_s: float) -> float:
        """Expected work left on a request estimated at ``estimate_s`` that
        has had ``done_s`` >= estimate_s: over this node's recent prefills
        that took longer than done_s / estimate_s of their estimate, the
        median of the rest.  Later than any of them: as much again as it is
        late, at most its estimate.

        The median, not the mean: most late prefills are a few percent late,
        while the first passes after a start ran 2-3x theirs and stay among
        the recent ones for LATE_RATIOS_KEPT prefills; with the mean, on a
        replay's first seconds, every prefill a few ms late was given ~60%
        of its estimate more, and the requests queued behind it were
        predicted 80-100 ms too much."""
        x = done_s / estimate_s
        rests = [r - x for r in self.late_ratios if r > x]
        if rests:
            return estimate_s * statistics.median(rests)
        return min(done_s - estimate_s, estimate_s)


class RunningSeq(NamedTuple):
    """A sequence a decode node reports in its batch (or queued to join it).

    `context_tokens`: KV positions it holds at the report; `remaining_tokens`:
    how many more tokens it may generate (max_tokens minus generated: EOS
    can only end it earlier, so the figure is an upper bound).
    """

    context_tokens: int
    remaining_tokens: int


class DecodeStep(NamedTuple):
    """One measured decode step: `seconds` for a batch holding `context_tokens`."""

    step: int  # the node's step counter: a report repeats steps already seen
    batch: int
    context_tokens: int
    seconds: float


@dataclass
class BookedJoin:
    """A request sent to a decode node that the node has not reported yet.

    It joins the node's batch when its prefill ends: predicted at `join_at`
    (= scheduled time + predicted TTFT), then holds `prompt_tokens` of
    context growing by one per step for `output_tokens - 1` steps (the first
    token comes from the prefill node).
    """

    join_at: float
    prompt_tokens: int
    output_tokens: int


class DecodeLoad(NamedTuple):
    """Predicted load of a decode node at one instant."""

    batch: int
    context_tokens: int


@dataclass
class DecodeNodeState:
    """The conductor's view of one decode node.

    `batch_size` and `context_tokens` include requests dispatched to it and
    not yet finished; `free_pages` is the page budget left for new KV.

    For the load at a future instant (`Scheduler.predict_decode_load`):
    `running` is the node's own per-sequence report as of `running_at`
    (None until a node reports one), `booked` every request dispatched
    here and not finished. Invariant: a request is counted once: from the
    report when the report names it, else from its booking.
    """

    node_id: str
    page_budget: int
    page_tokens: int
    alive: bool = True
    accepting: bool = True  # False while draining: finishes its sequences, takes no new one
    batch_size: int = 0
    context_tokens: int = 0
    free_pages: int = -1  # -1: start equal to page_budget
    recent_tbt_s: float = 0.0
    # request id -> (pages, context tokens) reserved for it
    reserved: dict[str, tuple[int, int]] = field(default_factory=dict)
    booked: dict[str, BookedJoin] = field(default_factory=dict)
    running: dict[str, RunningSeq] | None = None
    running_at: float = 0.0
    last_step_seen: int = -1

    def __post_init__(self) -> None:
        if self.page_budget <= 0:
            raise ValueError("page_budget must be > 0")
        if self.page_tokens <= 0:
            raise ValueError("page_tokens must be > 0")
        if self.free_pages < 0:
            self.free_pages = self.page_budget

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)


class NodeReport(NamedTuple):
    """A heartbeat from a node, as the HTTP conductor receives it.

    For a prefill node `queued_prefill_s` is its own estimate of the
    seconds of prefill work it holds at time `at` (queued + remaining of
    the running one). For a decode node the batch fields are used.
    """

    at: float
    queued_prefill_s: float | None = None
    batch_size: int | None = None
    context_tokens: int | None = None
    free_pages: int | None = None
    recent_tbt_s: float | None = None
    # Prefill node: the requests its `queued_prefill_s` holds (queued or
    # running); None when the node does not say.
    prefill_requests: frozenset[str] | None = None
    # Prefill node: seconds each request it is computing has been running at
    # `at`, by request id (a subset of prefill_requests); None: not said.
    prefill_running_s: dict[str, float] | None = None
    # Prefill node: CPU seconds its compute thread has spent on each of
    # them by `at` (what a node that yields its cores has done of its work).
    prefill_worked_s: dict[str, float] | None = None
    # Decode node: its sequences (running or queued to join the batch) by
    # request id, and recent measured steps; None when the node does not say.
    decode_sequences: dict[str, RunningSeq] | None = None
    decode_steps: tuple[DecodeStep, ...] = ()


class TransferPlan(NamedTuple):
    """Pull blocks [from_block, to_block) of the request from `source`."""

    source: str
    from_block: int
    to_block: int
    tokens: int
    bytes: int


class PrefillPlan(NamedTuple):
    """A policy's choice of prefill node, with its predicted components."""

    node: str
    local_prefix_blocks: int
    prefix_tokens: int  # tokens not recomputed (local + transferred)
    transfer: TransferPlan | None
    t_queue: float
    t_transfer: float
    t_prefill: float
    # The prefill's work in the node's estimator's seconds, what its queue
    # counts; None: t_prefill (they differ on a node that yields its cores).
    prefill_work_s: float | None = None

    @property
    def ttft(self) -> float:
        return self.t_queue + self.t_transfer + self.t_prefill


class Decision(NamedTuple):
    request_id: str
    prefill_node: str
    decode_node: str
    local_prefix_tokens: int
    prefix_tokens: int
    transfer: TransferPlan | None
    predicted_ttft_s: float
    predicted_tbt_s: float
    t_queue: float
    t_transfer: float
    t_prefill: float
    policy: str


class Rejection(NamedTuple):
    request_id: str
    reason: str  # "ttft_slo" | "tbt_slo" | "no_prefill_node" | "no_decode_capacity"
    predicted_ttft_s: float
    predicted_tbt_s: float
    retry_after_s: float
    # The admit limit the prediction exceeded (the TTFT limit of the chosen
    # prefill node for "ttft_slo", the TBT limit for "tbt_slo"); inf when no
    # prediction was compared with one.
    limit_s: float = math.inf

    def message(self) -> str:
        """What a client is told: the prediction and the limit it exceeded
        (an admit limit is the SLO less the spread the residual model adds),
        so a 429 under light load can be told apart from one under overload."""
        ttft, tbt = self.predicted_ttft_s, self.predicted_tbt_s * 1000
        if self.reason == "ttft_slo":
            what = (f"predicted TTFT {ttft:.3g}s over the admit limit {self.limit_s:.3g}s, "
                    f"TBT {tbt:.3g}ms")
        elif self.reason == "tbt_slo":
            what = (f"predicted TTFT {ttft:.3g}s, TBT {tbt:.3g}ms over the admit limit "
                    f"{self.limit_s * 1000:.3g}ms")
        elif math.isinf(ttft):
            what = f"no {self.reason[3:].replace('_', ' ')}"
        else:
            what = f"predicted TTFT {ttft:.3g}s, TBT {tbt:.3g}ms"
        return f"rejected ({self.reason}): {what}; retry later"
