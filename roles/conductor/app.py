"""Conductor wiring: membership, cluster view + scheduler, dispatch, APIs, and
with ``[etcd]`` leader election and standby forwarding (roles.conductor.failover).

GET  /admin/requests         recent requests (refused ones too) with their timing breakdown
POST /admin/cache/match      {"prompt": str | [ids]} or {"messages": [...]}: cached prefix
                             tokens per prefill node, from the global index
POST /admin/cache/replicate  {"prompt": ..., "replicas": n} (bearer admin_token): make n
                             prefill nodes hold the prompt's prefix, pulling it from a holder
GET /admin/requests/{id}     one request's trace (?tokens=1 adds the output token ids)
(OpenAI-compatible routes: roles.conductor.openai_api; external engines' KV events and
Mooncake's Indexer API, /register /unregister /query /query_by_hash: roles.engines)
"""

from __future__ import annotations

import time

from aiohttp import web

from model.config import load_model_config
from model.tokenizer import load_tokenizer
from kvstore.keys import block_keys
from mooncaked.node.context import CTX, NodeContext
from mooncaked.node.errors import (ApiError, StartupError, json_response, read_json,
                                   require_bearer)
from mooncaked.node.internal_client import PREFETCH_TIMEOUT_S, InternalClient
from mooncaked.node.messages import PrefetchReply, PrefetchRequest, Route
from roles.conductor.cluster import CLUSTER, ClusterView, add_cache_routes
from roles.conductor.dispatch import Dispatcher
from roles.conductor.membership_api import setup_membership
from roles.conductor.metrics import ConductorMetrics, NodeLoadCollector
from roles.conductor.openai_api import OPENAI_BACKEND, add_openai_routes
from roles.conductor.openai_types import ApiLimits, GenerationRequest
from roles.engines.indexer_api import add_indexer_routes, engines_ctx

DISPATCHER = web.AppKey("dispatcher", Dispatcher)


async def list_requests(request: web.Request) -> web.Response:
    traces = request.app[DISPATCHER].traces
    return json_response({"requests": [t.summary() for t in reversed(traces.values())]})


async def get_request(request: web.Request) -> web.Response:
    trace = request.app[DISPATCHER].traces.get(request.match_info["request_id"])
    if trace is None:
        raise ApiError(404, "no such request in the recent-request log")
    return json_response(trace.summary(with_tokens=request.query.get("tokens") == "1"))


class ClusterBackend:
    """What the OpenAI front end talks to: generation runs across the cluster."""

    def __init__(self, dispatcher: Dispatcher, tokenizer, model_name: str, max_model_len: int) -> None:
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len

    def generate(self, req: GenerationRequest):
        # Return the dispatcher's own generator (not a wrapper), so the front
        # end's aclose() reaches it directly and frees the request's resources.
        return self.dispatcher.generate(req.request_id, req.prompt_token_ids, req.sampling,
                                        arrival_s=req.arrival_s or None)


def _prompt_ids(body, backend) -> list[int]:
    from roles.conductor.openai_parse import parse_tokenize

    if isinstance(body, dict) and isinstance(body.get("prompt"), list):
        ids = body["prompt"]
        if not all(isinstance(t, int) for t in ids):
            raise ApiError(400, "prompt token ids must be integers")
        return ids
    return parse_tokenize(body, backend)


async def cache_match(request: web.Request) -> web.Response:
    """Where is this prompt's prefix cached? (operators; the replication tests)"""
    body = await read_json(request, 8 << 20)
    ids = _prompt_ids(body, request.app[OPENAI_BACKEND])
    cluster = request.app[CLUSTER]
    if cluster.block_size is None:
        return json_response({"prompt_tokens": len(ids), "nodes": {}})
    keys = block_keys(ids, cluster.block_size, request.app[DISPATCHER].hash_seed)
    blocks = cluster.scheduler.index.longest_prefix_per_node(keys)
    return json_response({"prompt_tokens": len(ids), "block_size": cluster.block_size,
                          "nodes": {n: b * cluster.block_size for n, b in sorted(blocks.items())}})


async def cache_replicate(request: web.Request) -> web.Response:
    """The operator's change_replica: make n prefill nodes hold a hot prefix."""
    require_bearer(request, request.app[CTX].config.node.admin_token, "POST /admin/cache/replicate")
    body = await read_json(request, 8 << 20)
    replicas = body.get("replicas") if isinstance(body, dict) else None
    if not isinstance(replicas, int) or replicas < 1:
        raise ApiError(400, "replicas must be a positive integer", param="replicas")
    ids = _prompt_ids(body, request.app[OPENAI_BACKEND])
    cluster, dispatcher = request.app[CLUSTER], request.app[DISPATCHER]
    if cluster.block_size is None:
        raise ApiError(503, "no prefill nodes have joined yet")
    keys = block_keys(ids, cluster.block_size, dispatcher.hash_seed)
    if not keys:
        raise ApiError(400, f"the prompt has no full block of {cluster.block_size} tokens")
    held = cluster.scheduler.index.longest_prefix_per_node(keys)
    live = [r for r in cluster.registry.alive() if r.role in ("prefill", "colocated")]
    holders = sorted((r for r in live if held.get(r.node_id, 0) == len(keys)), key=lambda r: r.node_id)
    if not holders:
        raise ApiError(409, "no live prefill node holds the whole prefix: send a request with it first")
    targets = [r for r in live if held.get(r.node_id, 0) < len(keys)][:max(0, replicas - len(holders))]
    results = {}
    for i, target in enumerate(targets):
        source = holders[i % len(holders)]
        answer = await dispatcher.call_node(
            target.url + Route.PREFETCH,
            PrefetchRequest(token_ids=ids[:len(keys) * cluster.block_size], block_keys=keys,
                            source_url=source.url),
            PrefetchReply.from_wire, f"prefetch on {target.node_id}", timeout=PREFETCH_TIMEOUT_S)
        results[target.node_id] = {"from": source.node_id, **answer.to_wire()}
    return json_response({"holders_before": [r.node_id for r in holders], "replicated": results})


def setup_conductor(app: web.Application, ctx: NodeContext) -> None:
    cfg = ctx.config
    registry = setup_membership(app, cfg.node.heartbeat_timeout_s)
    try:
        cluster = ClusterView(registry, cfg.conductor)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    cluster.prefill_chunk = cfg.model.prefill_chunk
    app[CLUSTER] = cluster
    metrics = ConductorMetrics(ctx.metrics)
    ctx.metrics.register(NodeLoadCollector(cluster.status))
    tokenizer = load_tokenizer(cfg.model.model)
    model_config = load_model_config(cfg.model.model)
    model_name = cfg.conductor.served_model_name or cfg.model.model

    async def dispatcher_ctx(app: web.Application):
        # Every call the conductor makes to a node is internal: the client carries
        # the cluster token.  No connection limit: every running request holds a stream.
        client = InternalClient.open(cfg.node.cluster_token, connections=0)
        # Decode nodes expire untouched reservations after decode.reservation_timeout_s
        # (the cluster shares one config): touch them three times per period.
        dispatcher = Dispatcher(cluster, client, metrics, cfg.store.hash_seed,
                                tokenizer.eos_token_ids,
                                reservation_keepalive_s=cfg.decode.reservation_timeout_s / 3)
        app[DISPATCHER] = dispatcher
        scheduler = cluster.scheduler
        ctx.collection_sizes.append(lambda: {
            "dispatcher_traces": len(dispatcher.traces),
            "dispatcher_prefill_calls": len(dispatcher._prefill_calls),
            "dispatcher_abandoned": len(dispatcher._abandoned),
            "scheduler_inflight": len(scheduler.inflight),
            "scheduler_ttft_errors": len(scheduler.ttft_errors),
            "registry_nodes": len(registry.alive()) + len(registry.dead())})
        app[OPENAI_BACKEND] = ClusterBackend(dispatcher, tokenizer, model_name,
                                             model_config.max_position)
        yield
        await client.close()

    app.cleanup_ctx.append(dispatcher_ctx)
    c = cfg.conductor
    if not c.engines:   # with engines, they answer the OpenAI routes (below)
        add_openai_routes(app, OPENAI_BACKEND, ApiLimits(
            max_prompt_tokens=c.max_prompt_tokens, max_request_bytes=c.max_request_bytes,
            max_tokens_default=c.max_tokens_default))
    add_cache_routes(app)
    app.router.add_get("/admin/requests", list_requests)
    app.router.add_get("/admin/requests/{request_id}", get_request)
    app.router.add_post("/admin/cache/match", cache_match)
    app.router.add_post("/admin/cache/replicate", cache_replicate)
    # External engines' KV events and Mooncake's Indexer API (roles.engines).
    app.cleanup_ctx.append(engines_ctx(cfg.store.hash_seed))
    add_indexer_routes(app)
    if c.engines:
        from roles.engines.proxy import setup_engine_proxy
        setup_engine_proxy(app, ctx, cluster.scheduler.prefill_est, cluster.scheduler.decode_est,
                           metrics)

    def nodes_status() -> list[dict]:
        now = time.monotonic()
        return [r.to_dict(now) for r in registry.alive()]

    ctx.status_providers["peers"] = nodes_status
    ctx.status_providers["dead_peers"] = lambda: [r.to_dict(time.monotonic()) for r in registry.dead()]
    ctx.status_providers["scheduler"] = cluster.status
    if cfg.etcd.enabled:
        from roles.conductor.failover import setup_failover
        setup_failover(app, ctx, registry)
