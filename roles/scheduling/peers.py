"""Other systems' routers, re-expressed on our policy interface.

They are baselines for comparison. Each is our reading of the public
documentation of that router; the rule and defaults are stated in the
docstring. All of them route to a node and reuse only that node's own
cache (none plans a transfer), and all of them read the exact global
index instead of the router's own approximation of each worker's cache
(SGLang keeps a per-worker radix tree of routed prompts, llm-d/Dynamo
consume KV events like we do) -- which favours SGLang slightly.
"""
from __future__ import annotations

import math
import random
from typing import Callable

from .policies import PlanContext, Policy
from .state import PrefillPlan


class SGLangCacheAwarePolicy(Policy):
    """SGLang router `cache_aware` (sgl-router).

    Load = outstanding requests per worker. If the cluster is imbalanced,
    i.e. max-min > balance_abs_threshold (default 64) AND
    max > balance_rel_threshold (default 1.5) x min, route to the least
    loaded worker. Otherwise take the worker with the longest prefix
    match; if the match rate (matched / prompt) is below cache_threshold
    (default 0.3) route instead to the worker with the smallest cache
    (the SGLang tree size), to spread new prefixes.
    """

    name = "sglang_cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5) -> None:
        self.cache_threshold = cache_threshold
        self.abs = balance_abs_threshold
        self.rel = balance_rel_threshold

    def choose(self, ctx: PlanContext) -> PrefillPlan:
        loads = {n: ctx.outstanding(n) for n in ctx.nodes}
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > self.abs and hi > self.rel * lo:
            return ctx.plan(min(ctx.nodes, key=loads.__getitem__))
        best = max(ctx.nodes, key=lambda n: (ctx.local(n), -loads[n]))
        rate = ctx.req.prefix_tokens(ctx.local(best)) / ctx.req.prompt_tokens
        if rate > self.cache_threshold:
            return ctx.plan(best)
        return ctx.plan(min(ctx.nodes, key=ctx.cached_blocks))


class DynamoKVPolicy(Policy):
    """NVIDIA Dynamo KV router.

    cost(worker) = overlap_score_weight (default 1.0) x prefill blocks
    (blocks of this prompt the worker must compute + prefill blocks it has
    queued) + decode blocks (blocks of active requests on it + this one's).
    Temperature 0 (default) takes the argmin; > 0 samples from
    softmax(-cost / temperature) over costs normalised to [0, 1].
    Our prefill nodes do not decode, and the policy context does not carry
    per-node block counts, so two terms are approximated: queued prefill
    blocks = the node's queued seconds / the time of one block, and decode
    blocks = outstanding requests on the node x this request's blocks.
    """

    name = "dynamo_kv"

    def __init__(self, overlap_score_weight: float = 1.0, temperature: float = 0.0,
                 seed: int = 0) -> None:
        self.w = overlap_score_weight
        self.temperature = temperature
        self.rng = random.Random(seed)
        # blocks queued per node, tracked from our own decisions
        self.queued_blocks: dict[str, float] = {}

    def choose(self, ctx: PlanContext) -> PrefillPlan:
        bs = ctx.req.block_size
        total = len(ctx.req.block_keys)
        costs = {}
        for n in ctx.nodes:
            new_blocks = total - ctx.local(n)
            # queued prefill work in blocks, derived from its queue seconds
            # through the request's own per-block cost (an approximation of
            # Dynamo's token counting that is exact for equal-length prompts)
            per_block = ctx.prefill_s(bs, 0) or 1e-9
            queued = ctx.queue_time(n) / per_block
            costs[n] = self.w * (new_blocks + queued) + ctx.outstanding(n) * total
        if self.temperature <= 0:
            return ctx.plan(min(ctx.nodes, key=costs.__getitem__))
        hi, lo = max(costs.values()), min(costs.values())
        span = (hi - lo) or 1.0
        weights = [math.exp(-((costs[n] - lo) / span) / self.temperature) for n in ctx.nodes]
        return ctx.plan(self.rng.choices(ctx.nodes, weights)[0])


class LlmdWeightedPolicy(Policy):
    """llm-d inference scheduler: weighted scorers, highest total wins.

    precise prefix-cache scorer = matched blocks / prompt blocks (from KV
    events); queue scorer = (max_q - q) / (max_q - min_q) over outstanding
    requests (1 if all equal); kv-cache-utilization scorer = 1 - used
    fraction of the node's cache. Default weights as in llm-d's default
    profile: prefix 3, queue 2, kv-utilization 2.
    """

    name = "llmd_weighted"

    def __init__(self, prefix_weight: float = 3.0, queue_weight: float = 2.0,
                 kv_util_weight: float = 2.0, capacity_blocks: int = 0) -> None:
        self.wp, self.wq, self.wk = prefix_weight, queue_weight, kv_util_weight
        self.capacity_blocks = capacity_blocks

    def choose(self, ctx: PlanContext) -> PrefillPlan:
        total = len(ctx.req.block_keys)
        qs = {n: ctx.outstanding(n) for n in ctx.nodes}
        hi, lo = max(qs.values()), min(qs.values())

        def score(n: str) -> float:
            s = self.wp * ctx.local(n) / total
            s += self.wq * (1.0 if hi == lo else (hi - qs[n]) / (hi - lo))
            if self.capacity_blocks:
                s += self.wk * (1.0 - min(1.0, ctx.cached_blocks(n) / self.capacity_blocks))
            return s

        return ctx.plan(max(ctx.nodes, key=score))


PEER_POLICIES: dict[str, Callable[..., Policy]] = {
    SGLangCacheAwarePolicy.name: SGLangCacheAwarePolicy,
    DynamoKVPolicy.name: DynamoKVPolicy,
    LlmdWeightedPolicy.name: LlmdWeightedPolicy,
}
