"""Record types of a run: request and node state the engine advances, and the result."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from roles.scheduling import Decision, ScheduleRequest

    from .store import LruShard
    from .trace import TraceRequest


@dataclass(eq=False)
class Req:
    """One request's life. Times are simulated seconds; -1.0 = not yet."""

    t: TraceRequest
    rid: str
    sreq: ScheduleRequest
    decision: Decision | None = None  # None: rejected (reason in `rejected`)
    rejected: str = ""
    prefix_tokens: int = 0
    local_prefix_tokens: int = 0
    transferred_tokens: int = 0
    ready_at: float = 0.0  # when its prefix pull (if any) has landed
    prefill_start: float = -1.0
    first_token: float = -1.0
    prefill_s: float = 0.0
    last_token: float = 0.0
    tokens_left: int = 0
    context: int = 0
    intervals: list[float] = field(default_factory=list)
    done_at: float = -1.0
    pinned: tuple[int, ...] = ()  # keys pinned on its prefill node until the first token
    pulled: tuple[int, ...] = ()  # keys its prefix pull really moves (the source may
    # have evicted some the scheduler's index still lists)
    # colocated: next position to prefill
    pos: int = 0
    # Leading blocks the decision counted as local: some may be stored by a
    # prefill queued ahead on the node only by the time this one starts.
    planned_local_blocks: int = 0


class PrefillNode:
    """A prefill node: FIFO of dispatched requests, one prefill at a time."""

    def __init__(self, nid: str, store: LruShard) -> None:
        self.nid = nid
        self.store = store
        self.queue: deque[Req] = deque()
        self.busy = False
        self.running: Req | None = None  # the prefill in progress
        self.wake_at = math.inf  # earliest WAKE already scheduled; inf: none
        # The node's own throughput figure for its load report, as a real
        # prefill node keeps it: an EWMA of measured computed tokens per
        # second; None until it has measured a prefill.
        self.tokens_per_s: float | None = None
        self.busy_s = 0.0
        self.served = 0


class DecodeNode:
    """A decode node (or a colocated node): a continuous batch stepped one step at a time."""

    def __init__(self, nid: str) -> None:
        self.nid = nid
        self.running: list[Req] = []
        self.joining: list[Req] = []  # KV arrived; enter `running` at the next step
        self.stepping = False
        self.context = 0  # sum of `running` requests' context tokens
        self.busy_s = 0.0
        self.steps = 0
        self.max_batch = 0
        # the last measured steps (step number, batch, context, seconds), for
        # the load report
        self.recent_steps: deque[tuple[int, int, int, float]] = deque(maxlen=16)
        # colocated only
        self.prefills: deque[Req] = deque()
        self.cur: Req | None = None


@dataclass
class SimResult:
    """A finished run: the config, the summary, one row per request, replicas,
    per-node totals and the load over time (mean per node, every sample_interval_s)."""

    config: dict
    summary: dict
    requests: list[dict]
    replicas: dict
    nodes: dict
    load: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"config": self.config, "summary": self.summary, "replicas": self.replicas,
                "nodes": self.nodes, "load": self.load, "requests": self.requests}
