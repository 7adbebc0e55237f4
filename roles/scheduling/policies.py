"""Prefill-node selection policies, pluggable by name.

A policy sees a `PlanContext` (the request, the live prefill nodes, each
node's prefix match from the global index, and the estimators through
`ctx.plan`) and returns a `PrefillPlan`. Decode selection and the SLO
check are common to all policies and live in the scheduler.

Non-Mooncake policies never plan transfers: their prefix is what the
chosen node holds locally (as an instance with a local prefix cache
would), so they differ only in how they pick the node.
"""
from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from typing import Callable

from .state import PrefillPlan, ScheduleRequest


class PlanContext:
    """Everything a policy may look at for one decision.

    `matches[node]` = leading blocks of the request held by that node
    (absent = 0); `pending[node]` = leading blocks that work booked on the
    node ahead of this request will have stored by the time it starts
    there (the node runs its queue in order); only live prefill nodes
    appear in `nodes`.  A node's local prefix counts both; only what it
    holds now can be pulled from it.
    `plan(node, transfer_blocks_from)` prices a choice with the
    estimators: T_queue + T_transfer + T_prefill.
    """

    def __init__(self, req: ScheduleRequest, now: float, nodes: list[str],
                 matches: dict[str, int], queue_time: Callable[[str], float],
                 prefill_s: Callable[[int, int], float],
                 transfer_s: Callable[[str, int], float],
                 kv_bytes_per_token: int, outstanding: Callable[[str], int],
                 cached_blocks: Callable[[str], int],
                 node_prefill_s: Callable[[str, int, int], float] | None = None,
                 transferable: Callable[[str], bool] | None = None,
                 wall_s: Callable[[str, float, float], float] | None = None,
                 extra_s: Callable[[str], float] | None = None,
                 start_waits_s: Callable[[str], float] | None = None,
                 pending: dict[str, int] | None = None) -> None:
        self.req = req
        self.now = now
        self.nodes = nodes
        self.matches = matches
        self.pending = pending or {}
        self.queue_time = queue_time
        self.prefill_s = prefill_s
        self.transfer_s = transfer_s
        self.kv_bytes_per_token = kv_bytes_per_token
        self.outstanding = outstanding  # requests sent to a node, not finished
        self.cached_blocks = cached_blocks
        # Per-node prefill time (a CPP group has its own estimator); defaults
        # to the cluster-wide one.
        self.node_prefill_s = node_prefill_s or (lambda node, n, p: prefill_s(n, p))
        # A CPP group holds each block's KV spread over its stages by layer:
        # it can neither serve a whole-block pull nor receive one.
        self.transferable = transferable or (lambda node: True)
        # wall_s(node, start, work): seconds from `start` until `node` has
        # done `work` seconds of work (queue_time and node_prefill_s are in
        # work); default: the work itself.  They differ on a node that
        # yields its cores to others (roles/scheduling/borrowed.py).
        self.wall_s = wall_s or (lambda node, start, work: work)
        # start_waits_s(node): the waits for the node's compute thread at the
        # start of each prefill queued there and of this one (wall seconds,
        # beside the work); default none.
        self.start_waits_s = start_waits_s or (lambda node: 0.0)
        # What choosing `node` costs beyond its plan's TTFT (the scheduler's
        # median residual of the node); default nothing.
        self.extra_s = extra_s or (lambda node: 0.0)

    def cost(self, plan: PrefillPlan) -> float:
        """What a policy that minimises TTFT compares: the plan's TTFT plus
        the chosen node's extra (``extra_s``)."""
        return plan.ttft + self.extra_s(plan.node)

    def local(self, node: str) -> int:
        return max(self.matches.get(node, 0), self.pending.get(node, 0))

    def plan(self, node: str, source: str | None = None, source_blocks: int = 0) -> PrefillPlan:
        """Price `node`, optionally pulling blocks [local, source_blocks) from `source`."""
        from .state import TransferPlan  # local import keeps the header short

        req = self.req
        local = self.local(node)
        t_queue = self.wall_s(node, self.now, self.queue_time(node)) + self.start_waits_s(node)
        transfer = None
        t_transfer = 0.0
        blocks = local
        if source is not None and source_blocks > local and self.transferable(node) \
                and self.transferable(source):
            tokens = req.prefix_tokens(source_blocks) - req.prefix_tokens(local)
            nbytes = tokens * self.kv_bytes_per_token
            transfer = TransferPlan(source, local, source_blocks, tokens, nbytes)
            t_transfer = self.transfer_s(source, nbytes)
            blocks = source_blocks
        prefix = req.prefix_tokens(blocks)
        work = self.node_prefill_s(node, req.prompt_tokens, prefix)
        t_prefill = self.wall_s(node, self.now + t_queue + t_transfer, work)
        return PrefillPlan(node, local, prefix, transfer, t_queue, t_transfer, t_prefill, work)


class Policy(ABC):
    name: str = ""

    @abstractmethod
    def choose(self, ctx: PlanContext) -> PrefillPlan:
        """Pick a prefill node; ctx.nodes is non-empty."""


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def choose(self, ctx: PlanContext) -> PrefillPlan:
        return ctx.plan(self.rng.choice(ctx.nodes))


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self.i = 0

    def choose(self, ctx: PlanContext) -> PrefillPlan:
        node = ctx.nodes[self.i % len(ctx.nodes)]
        self.i += 1
        return ctx.plan(node)


class LoadBalancePolicy(Policy):
    """Least queued prefill time; ignores caches when choosing."""

    name = "load_balance"

    def choose(self, ctx: PlanContext) -> PrefillPlan:
        return ctx.plan(min(ctx.nodes, key=ctx.queue_time))


class LocalCacheAwarePolicy(Policy):
    """Algorithm 1 without transfers: min T_queue + T_prefill(local prefix)."""

    name = "local_cache_aware"

    def choose(self, ctx: PlanContext) -> PrefillPlan:
        return min((ctx.plan(n) for n in ctx.nodes), key=ctx.cost)


class MooncakePolicy(Policy):
    """The paper's Algorithm 1 with cache load balancing.

    For every node: if best_len / node.prefix_len > threshold, price pulling
    the better prefix from the best holder (T_transfer), else recompute from
    the local prefix. Keep the node with the least
    T_transfer + T_queue + T_prefill. The chosen node keeps what it pulled
    (the executor stores all the request's blocks on it), which is how hot
    prefixes get replicated. Among several holders of the longest prefix the
    one whose NIC frees first is the source.
    """

    name = "mooncake"

    def __init__(self, kvcache_balancing_threshold: float = 1.0) -> None:
        if kvcache_balancing_threshold < 1.0:
            raise ValueError("kvcache_balancing_threshold must be >= 1.0")
        self.threshold = kvcache_balancing_threshold

    def choose(self, ctx: PlanContext) -> PrefillPlan:
        best_len = max(ctx.matches.values(), default=0)
        source = None
        if best_len:
            holders = [n for n, b in ctx.matches.items() if b == best_len and ctx.transferable(n)]
            source = min(holders, key=lambda n: ctx.transfer_s(n, 0)) if holders else None
        best: PrefillPlan | None = None
        best_cost = math.inf
        for node in ctx.nodes:
            local = ctx.local(node)
            ratio = math.inf if local == 0 else best_len / local
            if source is not None and ratio > self.threshold:
                plan = ctx.plan(node, source, best_len)
            else:
                plan = ctx.plan(node)
            cost = ctx.cost(plan)
            if best is None or cost < best_cost:
                best, best_cost = plan, cost
        assert best is not None
        return best


POLICIES: dict[str, Callable[..., Policy]] = {
    RandomPolicy.name: RandomPolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
    LoadBalancePolicy.name: LoadBalancePolicy,
    LocalCacheAwarePolicy.name: LocalCacheAwarePolicy,
    MooncakePolicy.name: MooncakePolicy,
}
