"""The scheduler: index + estimators + policy + residual model.

The only object the HTTP conductor and the simulator call. Time is always
an argument; nothing here blocks, sleeps or does I/O.  Decision and
admission live here; per-node bookings and state in nodes.py, the TBT of a
decode node in decode_pricing.py, learning from what happened in
outcomes.py, the knobs in config.py, what the cost model misses in
residuals.py.
"""
from __future__ import annotations

import math
from collections import deque

from . import borrowed
from .attainment import AdmissionQuantile
from .config import SchedulerConfig, scheduler_config
from .decode_estimator import DecodeEstimator
from .estimators import PrefillEstimator
from .index import GlobalCacheIndex
from .nodes import BATCH_WAIT_SAMPLES, RECENTLY_DONE_KEPT  # noqa: F401 (re-exported)
from .yielding import (ARRIVAL_WINDOW_S, ARRIVALS_KEPT, YIELD_SHARE_FLOOR,  # noqa: F401
                       YIELD_SHARE_HALF_LIFE_S, YIELD_SHARE_MIN_MODELLED_S)
from .policies import PlanContext, Policy
from .registry import make_policy
from .outcomes import Inflight, OutcomeLearning
from .residuals import ResidualModel, load_level
from .state import (BookedJoin, Decision, DecodeNodeState, PendingPrefill, PrefillNodeState,
                    PrefillPlan, Rejection, ScheduleRequest)
from .transfer_estimator import TransferEstimator

__all__ = ["Scheduler", "SchedulerConfig", "scheduler_config"]


# Recent TTFT prediction errors kept for status pages (totals are running sums).
RECENT_TTFT_ERRORS = 1024


class Scheduler(OutcomeLearning):
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
        self.inflight: dict[str, Inflight] = {}
        # In-flight request ids by the key of their first block: the
        # candidates whose prefill may be computing a new request's prefix
        # (pending_prefixes), found without walking every node's queue.
        self._inflight_by_first_block: dict[int, set[str]] = {}
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
        # Accepted requests per decode node: (when, expected output tokens).
        self._decode_arrivals: dict[str, deque[tuple[float, int]]] = {}
        # What the cost model misses: TTFT residuals (seconds) keyed by
        # prefill node; by decode node, TBT residuals (log measured /
        # predicted step, over a reply's intervals after its first) and
        # hand-off residuals (seconds its first interval took beyond a step:
        # the decode node taking the request over from its prefill).
        self.ttft_residuals = ResidualModel(config.residual_half_life_s, config.admit_quantile,
                                            config.residual_min_samples)
        self.tbt_residuals = ResidualModel(config.residual_half_life_s, config.admit_quantile,
                                           config.residual_min_samples)
        self.handoff_residuals = ResidualModel(config.residual_half_life_s, config.admit_quantile,
                                               config.residual_min_samples)
        # By prefill node: what the modelled share of a colocated node's
        # compute thread missed of what its prefills got while it decoded
        # (log modelled / measured share; NodeBookings.prefill_share).
        self.share_residuals = ResidualModel(config.residual_half_life_s, config.admit_quantile,
                                             config.residual_min_samples)
        # By prefill node and load level: how long a prefill waited for the
        # node's compute thread beside its work (on a colocated node, the
        # decode steps queued there ahead of its chunks), in seconds
        # (NodeBookings.start_waits_s).
        self.start_waits = ResidualModel(config.residual_half_life_s, config.admit_quantile,
                                         config.residual_min_samples)
        # The admission quantile of all three, steered by admitted requests' outcomes.
        self.admission = AdmissionQuantile(config.admit_quantile, config.slo_attainment)
        self._set_admit_quantile(self.admission.quantile)
        # Per prefill node: recent (predicted queue, batched-behind) pairs of
        # requests that waited, and the slope fitted on them (batch_wait_s).
        self._batch_waits: dict[str, deque[tuple[float, float]]] = {}
        self._batch_wait_slope: dict[str, float] = {}
        # Per yielding prefill node: its learned progress share (value, when
        # measured) and its previous report's (running_s, worked_s) by id.
        self._yield_share: dict[str, tuple[float, float]] = {}
        # Per colocated node: its recent prefills as (finished at, compute
        # seconds, request id), what the replies decoding there waited on.
        self._prefills_done: dict[str, deque[tuple[float, float, str]]] = {}
        self._yield_seen: dict[str, tuple[dict[str, float], dict[str, float]]] = {}

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
            # Worked out once per decision: when a yielding node's decode
            # nodes, or a colocated node's own decode, are stepping.
            if node not in busy:
                busy[node] = self.yielded_busy(node) if self.yields(node) \
                    else self.own_decode_busy(node)
            return busy[node]

        def wall_s(node: str, start: float, work: float) -> float:
            if not self.yields(node):
                return self.prefill_wall_s(node, start, work, self.prefill_share(node, now),
                                           busy_of(node))
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
            start_waits_s=lambda node: self.start_waits_s(node, level, now),
            extra_s=lambda node: self.ttft_residuals.median(node, level, now),
            pending=self.pending_prefixes(req))

    def pending_prefixes(self, req: ScheduleRequest) -> dict[str, int]:
        """Per prefill node, the leading blocks of ``req`` that prefills
        booked there and not finished will have stored before ``req`` could
        start: a node computes its queue in order and looks a prefix up when
        a request starts, so a request sent behind one computing its prefix
        reuses it instead of computing it again elsewhere.  Full blocks only
        (a prompt's partial last block is not kept)."""
        best: dict[str, int] = {}
        if not req.block_keys:
            return best
        for rid in self._inflight_by_first_block.get(req.block_keys[0], ()):
            inf = self.inflight[rid]
            node = inf.decision.prefill_node
            state = self.prefill.get(node)
            if state is None or rid not in state.pending:
                continue
            ahead = inf.req
            full = min(ahead.prompt_tokens // ahead.block_size, len(req.block_keys))
            n = 0
            while n < full and ahead.block_keys[n] == req.block_keys[n]:
                n += 1
            if n > best.get(node, 0):
                best[node] = n
        return best

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
                if self._admits(plan, ctx):
                    return plan
                ctx.nodes = overflow
                spill = self._choose_among(ctx)
                return spill if self._admits(spill, ctx) else plan
        return self._choose_among(ctx)

    def _choose_among(self, ctx: PlanContext) -> PrefillPlan:
        plan = self.policy.choose(ctx)
        if self.config.reject:
            plan = self._admissible_plan(ctx, plan)
        return plan

    def _admits(self, plan: PrefillPlan, ctx: PlanContext) -> bool:
        """The plan's TTFT (after the time the request already waited) plus
        the node's admission-quantile residual is within the SLO."""
        level = self.load_level()
        return ctx.req.waited_s + plan.ttft \
            + self.ttft_residuals.median(plan.node, level, ctx.now) \
            + self.batch_wait_s(plan.node, plan.t_queue) \
            <= self.ttft_admit_limit(plan.node, ctx.now, level)

    def _admissible_plan(self, ctx: PlanContext, plan: PrefillPlan) -> PrefillPlan:
        """With residuals learned per node, the policy's choice may exceed its
        own node's limit while the next best node, whose predictions hold
        better, admits the same request: the policy chooses again without the
        nodes that refused, and its first choice stands (to be rejected) when
        every node refuses.  Nothing changes while the choice is within its
        limit, so Algorithm 1 decides whenever the SLO is not at stake."""
        first = plan
        nodes = list(ctx.nodes)
        while not self._admits(plan, ctx):
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
        work = plan.t_prefill if plan.prefill_work_s is None else plan.prefill_work_s
        # The model's share of the thread over this prefill as priced (its
        # work over its wall time where the node's own decode steps),
        # before this request's booking joins the decode load.
        modelled_share = 1.0 if self.yields(plan.node) else self.priced_share(plan, work, now)
        cfg = self.config
        level = self.load_level()
        # From the request's arrival: the part already waited is known.
        model_ttft = req.waited_s + plan.ttft + self.batch_wait_s(plan.node, plan.t_queue)
        ttft = model_ttft + self.ttft_residuals.median(plan.node, level, now)
        # Its first token, and its join to a decode node, from now.
        first_in_s = ttft - req.waited_s
        dnode, tbt, tbt_model, tbt_chunks = self._decode_choice(req, now, first_in_s, plan.node)
        if dnode is None:
            return self._reject(req, "no_decode_capacity", ttft, math.inf, 1.0)
        ttft_limit = self.ttft_admit_limit(plan.node, now, level)
        if cfg.reject and ttft > ttft_limit:
            return self._reject(req, "ttft_slo", ttft, tbt, ttft - ttft_limit, ttft_limit)
        tbt_limit = cfg.tbt_slo_s
        # A reply of one token has no interval for a TBT to be judged on.
        if cfg.reject and tbt > tbt_limit and req.expected_output_tokens > 1:
            return self._reject(req, "tbt_slo", ttft, tbt, 1.0, tbt_limit)

        decision = Decision(req.request_id, plan.node, dnode.node_id,
                            req.prefix_tokens(plan.local_prefix_blocks), plan.prefix_tokens,
                            plan.transfer, ttft, tbt, plan.t_queue, plan.t_transfer,
                            plan.t_prefill, self.policy.name)
        # Book the work so the next decision sees it before any heartbeat.
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
        dnode.booked[req.request_id] = BookedJoin(now + first_in_s, req.prompt_tokens,
                                                  req.expected_output_tokens)
        dnode.free_pages -= pages
        if cfg.price_yielded_work:  # only what prices a yielding node reads them
            arrivals = self._decode_arrivals.setdefault(dnode.node_id,
                                                        deque(maxlen=ARRIVALS_KEPT))
            arrivals.append((now, req.expected_output_tokens))
        dnode.batch_size += 1
        dnode.context_tokens += tokens
        self.inflight[req.request_id] = Inflight(
            decision, req, now, model_ttft, level, tbt_model, tbt_chunks,
            priced_by_prior=prior_in_ttft, modelled_share=modelled_share)
        if req.block_keys:
            self._inflight_by_first_block.setdefault(req.block_keys[0], set()).add(req.request_id)
        return decision

    def priced_share(self, plan: PrefillPlan, work: float, now: float) -> float:
        """The cost model's share of the compute thread over ``plan``'s
        prefill: its ``work`` over the wall time the modelled share
        (``modelled_prefill_share``, no residual) gives it where the node's
        own decode steps; 1 where none overlaps it.  What a colocated
        prefill's measured share (its compute over its compute and the
        decode steps it gave way to) is compared with."""
        share = self.modelled_prefill_share(plan.node)
        if share >= 1.0 or work <= 0:
            return 1.0
        wall = self.prefill_wall_s(plan.node, now + plan.t_queue + plan.t_transfer, work, share)
        return min(1.0, work / wall) if wall > 0 else 1.0

    def ttft_admit_limit(self, node: str, now: float, level: int | None = None) -> float:
        """The highest predicted TTFT (cost model + median residual) admitted
        on ``node`` at ``level`` (the current load level when None): the SLO
        less the spread between the admission-quantile residual and the
        median, so that ``model + quantile residual <= SLO`` admits."""
        lvl = self.load_level() if level is None else level
        r = self.ttft_residuals
        headroom = r.bound(node, lvl, now) - r.median(node, lvl, now)
        return max(0.0, self.config.ttft_slo_s - headroom)

    def _set_admit_quantile(self, q: float) -> None:
        for model in (self.ttft_residuals, self.tbt_residuals, self.handoff_residuals):
            model.quantile = q

    def load_level(self) -> int:
        """The load level of the requests in flight now (residuals.load_level)."""
        return load_level(len(self.inflight))

