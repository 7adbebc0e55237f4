"""What the engine scheduler knows of one engine and of each request it sent there.

EngineScheduler (engines.py) owns these; nothing here decides anything.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from .decode_estimator import DecodeEstimator
from .estimators import PrefillEstimator
from .state import PrefillNodeState

# The prompt tokens one engine step prefills when the engine's own figure
# is not given: vLLM's OpenAI server default on CPUs (GPU defaults are
# larger).  Set too low, fewer waiting requests are counted as sharing a
# step, and those are priced as if each paid a step of its own.
DEFAULT_STEP_TOKENS = 2048


class EngineDecision(NamedTuple):
    """Where a request goes, with the parts of its predicted TTFT."""

    request_id: str
    engine: str
    prefix_tokens: int
    predicted_ttft_s: float
    predicted_tbt_s: float
    t_queue: float
    t_prefill: float
    # Expected seconds later requests spend recomputing what this request's
    # blocks evict at the engine (chosen on, not admitted on).
    eviction_s: float = 0.0
    # The engine's timeline played forward (engine_timeline.py): when it
    # would start its prefill there, which t_queue is at least.
    t_start: float = 0.0
    # Every engine priced for it, admitted or not: (engine, prefix tokens
    # it holds, predicted TTFT, cost), what the choice was made among.
    candidates: tuple[tuple[str, int, float, float], ...] = ()
    # Other engines of its machine with work when it was priced (as a load
    # level), and the prefill slowdown learned for that (contention.py),
    # by which t_prefill was multiplied.
    busy_level: int = 0
    slowdown: float = 1.0
    # Requests of ours there whose mean token interval its prefill would
    # push over the TBT SLO (``EngineScheduler.tbt_misses_caused``).
    tbt_misses: int = 0
    # Seconds the prefill work booked at the engine's busy neighbours (its
    # machine's other engines) would take longer with this engine busy too
    # (chosen on, not admitted on): 0 where it already has work.
    contention_s: float = 0.0
    # The request of ours whose engine step, still waiting to start there,
    # it joins; None: it starts a step of its own.
    step_leader: str | None = None
    # Seconds of its prefill's fixed part left out of t_prefill (before the
    # slowdown): they overlap work of ours ahead of it there
    # (EngineScheduler.engine_steps).
    overlap_s: float = 0.0

    @property
    def cost_s(self) -> float:
        """What the choice between engines minimises."""
        return self.predicted_ttft_s + self.eviction_s + self.contention_s


@dataclass
class EngineRequest:
    """One request of ours at an engine, from booking until it finishes."""

    prompt_tokens: int
    prefix_tokens: int
    sent_at: float
    model_ttft_s: float      # the cost model's TTFT, before the residual
    predicted_ttft_s: float  # with the median residual: what the choice was made on
    level: int               # the engine's load level when booked
    priced_by_prior: bool    # it or work booked ahead of it priced by an unfitted prior
    observed: bool           # its first token will be seen (a streamed response)
    # Chained keys of its prompt's full blocks (any block size the caller
    # keeps to): what the engine will hold once it has prefilled it.
    block_keys: tuple[int, ...] = ()
    # Full blocks it stores at the engine that the engine did not hold.
    new_blocks: int = 0
    # Tokens it is expected to generate: its max_tokens, else the mean
    # output of requests finished lately (what its blocks grow by).
    output_tokens: int = 0
    # Other engines of its machine with work when it was sent (a load level).
    busy_level: int = 0
    first_token_at: float | None = None
    # Tokens streamed back so far (the first included).
    tokens_out: int = 0
    ttft_s: float | None = None   # measured, once its first token came back
    batch: int = 0           # the engine's running batch when it started decoding
    context_tokens: int = 0
    # The engine step that prefills it (EngineScheduler.engine_steps):
    # None when it leads one, else the request leading the step it joined.
    step_leader: str | None = None
    # Seconds of its prefill's fixed part priced as overlapping work of
    # ours ahead of it there (EngineDecision.overlap_s).
    overlap_s: float = 0.0
    # Its step's first token came back: its prefill time was measured with
    # its step's (the first of them to answer), not on its own answer.
    step_measured: bool = False

    def generated(self, now: float, step_s: float) -> int:
        """Tokens it has generated once decoding: as streamed back, or for a
        response that shows none (not streamed), one per decode step since
        its first token."""
        if self.observed or step_s <= 0 or self.first_token_at is None:
            return max(1, self.tokens_out)
        return 1 + int((now - self.first_token_at) / step_s)


@dataclass
class EngineState:
    """The scheduler's view of one engine.

    Invariant: ``queue.pending`` holds exactly the requests of ``requests``
    with no first token yet (what is queued or prefilling there), in the
    order they were booked.
    """

    name: str
    prefill_est: PrefillEstimator
    # Its streams' mean token interval: what a client's TBT is judged on,
    # the gaps that shared a step with a prefill chunk included.
    decode_est: DecodeEstimator
    # Its streams' median token interval: the bare decode step, the time a
    # step adds beside the prefill work it carries.
    step_est: DecodeEstimator
    # The machine it runs on: engines of one machine slow each other
    # (contention.py).  Its own name when not known to share one.
    machine: str
    alive: bool = True
    stale: bool = False
    queue: PrefillNodeState = field(init=False)
    requests: dict[str, EngineRequest] = field(default_factory=dict)
    # From the engine's /metrics (all clients): requests running / waiting, KV use.
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    # Blocks its prefix cache holds at most (None: not reported).
    capacity_blocks: int | None = None
    metrics_at: float | None = None
    # Requests at the engine that others sent: counted at the last metrics
    # report as its figures less ours.
    foreign_running: int = 0
    foreign_waiting: int = 0
    last_first_token_at: float = -math.inf
    chosen_at: float = -math.inf
    # The most prompt tokens one engine step prefills (vLLM's
    # --max-num-batched-tokens): requests waiting together beyond it start
    # in the next step.
    step_tokens: int = DEFAULT_STEP_TOKENS

    def __post_init__(self) -> None:
        self.queue = PrefillNodeState(self.name)

    def ours_decoding(self) -> int:
        return sum(1 for r in self.requests.values() if r.first_token_at is not None)

    def pending_new_blocks(self) -> int:
        """Blocks our requests still queued or prefilling here will store
        that its events do not report yet (they report a block once
        computed)."""
        return sum(self.requests[rid].new_blocks for rid in self.queue.pending)

    def in_flight(self) -> int:
        return len(self.requests) + self.foreign_running + self.foreign_waiting
