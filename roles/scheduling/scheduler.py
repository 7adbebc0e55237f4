"""The scheduler: index + estimators + policy + per-node accounting.

The only object the HTTP conductor and the simulator call. Time is always
an argument; nothing here blocks, sleeps or does I/O.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from .estimators import DecodeEstimator, PrefillEstimator, TransferEstimator
from .index import GlobalCacheIndex
from .policies import PlanContext, Policy
from .registry import make_policy
from .state import (Decision, DecodeNodeState, NodeReport, PendingPrefill, PrefillNodeState,
                    Rejection, ScheduleRequest)

# Recent TTFT prediction errors kept for status pages (totals are running sums).
RECENT_TTFT_ERRORS = 1024


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

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError("policy must be a non-empty string")
        if not isinstance(self.policy_params, dict):
            raise ValueError("policy_params must be a dict")
        for f in ("ttft_slo_s", "tbt_slo_s", "min_retry_after_s", "max_retry_after_s"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be > 0")
        if self.kv_bytes_per_token <= 0:
            raise ValueError("kv_bytes_per_token must be > 0")


@dataclass
class _Inflight:
    decision: Decision
    req: ScheduleRequest
    scheduled_at: float


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

    # ---- membership ---------------------------------------------------
    def add_prefill_node(self, node: str, cache_capacity_blocks: int = 0) -> None:
        self.prefill[node] = PrefillNodeState(node, cache_capacity_blocks=cache_capacity_blocks)
        self._outstanding.setdefault(node, 0)

    def add_prefill_group(self, group: str, members: tuple[str, ...],
                          estimator: PrefillEstimator, cache_capacity_blocks: int = 0) -> None:
        """A Chunked Pipeline Parallelism group scheduled as one prefill instance
        with its own estimator (pipeline fill + steady state)."""
        self.prefill[group] = PrefillNodeState(group, cache_capacity_blocks=cache_capacity_blocks,
                                               group_members=tuple(members))
        self._outstanding.setdefault(group, 0)
        self.node_estimators[group] = estimator

    def estimator_for(self, node: str | None) -> PrefillEstimator:
        return self.node_estimators.get(node, self.prefill_est) if node else self.prefill_est

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
        return PlanContext(
            req, now, nodes, matches,
            queue_time=lambda n: self.prefill[n].queue_time(now),
            prefill_s=self.prefill_est.seconds,
            transfer_s=lambda src, nbytes: self.transfer_est.seconds(src, nbytes, now),
            kv_bytes_per_token=self.config.kv_bytes_per_token,
            outstanding=lambda n: self._outstanding.get(n, 0),
            cached_blocks=self.index.blocks_on,
            node_prefill_s=lambda node, n, p: self.estimator_for(node).seconds(n, p),
            transferable=lambda node: not self.prefill[node].group_members)

    def select_decode(self, req: ScheduleRequest) -> tuple[DecodeNodeState | None, float]:
        """Least predicted TBT among live decode nodes with pages for the request."""
        tokens = req.prompt_tokens + req.expected_output_tokens
        best, best_tbt = None, math.inf
        for d in self.decode.values():
            if not d.alive or d.free_pages < d.pages_for(tokens):
                continue
            tbt = self.decode_est.seconds(d.batch_size + 1, d.context_tokens + tokens)
            if tbt < best_tbt:
                best, best_tbt = d, tbt
        return best, best_tbt

    def _reject(self, req: ScheduleRequest, reason: str, ttft: float, tbt: float,
                retry: float) -> Rejection:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1
        retry = min(self.config.max_retry_after_s, max(self.config.min_retry_after_s, retry))
        return Rejection(req.request_id, reason, ttft, tbt, retry)

    def schedule(self, req: ScheduleRequest, now: float) -> Decision | Rejection:
        if req.request_id in self.inflight:
            raise ValueError(f"request_id {req.request_id!r} is already scheduled")
        ctx = self._context(req, now)
        if ctx is None:
            return self._reject(req, "no_prefill_node", math.inf, math.inf, 1.0)
        plan = self.policy.choose(ctx)
        dnode, tbt = self.select_decode(req)
        cfg = self.config
        if dnode is None:
            return self._reject(req, "no_decode_capacity", plan.ttft, math.inf, 1.0)
        if cfg.reject and plan.ttft > cfg.ttft_slo_s:
            return self._reject(req, "ttft_slo", plan.ttft, tbt, plan.ttft - cfg.ttft_slo_s)
        if cfg.reject and tbt > cfg.tbt_slo_s:
            return self._reject(req, "tbt_slo", plan.ttft, tbt, 1.0)

        decision = Decision(req.request_id, plan.node, dnode.node_id,
                            req.prefix_tokens(plan.local_prefix_blocks), plan.prefix_tokens,
                            plan.transfer, plan.ttft, tbt, plan.t_queue, plan.t_transfer,
                            plan.t_prefill, self.policy.name)
        # Book the work so the next decision sees it before any heartbeat.
        self.prefill[plan.node].pending[req.request_id] = PendingPrefill(plan.t_prefill, now)
        self._outstanding[plan.node] = self._outstanding.get(plan.node, 0) + 1
        if plan.transfer is not None:
            self.transfer_est.reserve(plan.transfer.source, plan.transfer.bytes, now)
        tokens = req.prompt_tokens + req.expected_output_tokens
        pages = dnode.pages_for(tokens)
        dnode.reserved[req.request_id] = (pages, tokens)
        dnode.free_pages -= pages
        dnode.batch_size += 1
        dnode.context_tokens += tokens
        self.inflight[req.request_id] = _Inflight(decision, req, now)
        return decision

    # ---- feedback from execution ----------------------------------------
    def on_prefill_started(self, node: str, request_id: str, now: float) -> None:
        p = self.prefill[node].pending.get(request_id)
        if p is not None:
            p.started_at = now

    def on_prefill_finished(self, node: str, request_id: str, now: float,
                            actual_seconds: float,
                            actual_prefix_tokens: int | None = None) -> None:
        """Prefill done (first token out): refit and record the TTFT error.

        `actual_seconds <= 0` means "no measurement" (cancelled or failed
        prefill): the booking is released but nothing is learned from it.
        """
        if node in self.prefill:
            self.prefill[node].pending.pop(request_id, None)
        self._outstanding[node] = max(0, self._outstanding.get(node, 0) - 1)
        inf = self.inflight.get(request_id)
        if inf is None or actual_seconds <= 0:
            return
        # Fit on what happened: the prefix the node really reused (a failed
        # fetch or an eviction makes it shorter than planned), not the plan.
        prefix = inf.decision.prefix_tokens if actual_prefix_tokens is None \
            else actual_prefix_tokens
        self.estimator_for(node).observe(inf.req.prompt_tokens, prefix, actual_seconds)
        actual_ttft = now - inf.scheduled_at
        error = inf.decision.predicted_ttft_s - actual_ttft
        self.ttft_errors.append(error)
        self._ttft_error_count += 1
        self._ttft_error_sum += error
        self._ttft_error_abs_sum += abs(error)

    def on_transfer_finished(self, source: str, nbytes: int, seconds: float) -> None:
        self.transfer_est.observe(source, nbytes, seconds)

    def on_decode_finished(self, node: str, request_id: str, now: float) -> None:
        self.inflight.pop(request_id, None)
        d = self.decode.get(node)
        if d is None:
            return
        pages, tokens = d.reserved.pop(request_id, (0, 0))
        d.free_pages += pages
        d.batch_size = max(0, d.batch_size - 1)
        d.context_tokens = max(0, d.context_tokens - tokens)

    def on_node_report(self, node: str, report: NodeReport, now: float) -> None:
        """Heartbeat: replace our estimate of the node's load by its own."""
        if node in self.prefill and report.queued_prefill_s is not None:
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
            if report.recent_tbt_s is not None:
                d.recent_tbt_s = report.recent_tbt_s
                # Calibrate the TBT model on what the node measures.
                if report.batch_size:
                    self.decode_est.observe(report.batch_size, report.context_tokens or 0,
                                            report.recent_tbt_s)

    def estimator_error(self) -> dict[str, float]:
        """Mean and mean-absolute (predicted - actual) TTFT, seconds."""
        n = self._ttft_error_count
        if not n:
            return {"count": 0, "mean_s": 0.0, "mean_abs_s": 0.0}
        return {"count": n, "mean_s": self._ttft_error_sum / n,
                "mean_abs_s": self._ttft_error_abs_sum / n}
