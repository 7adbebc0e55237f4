"""Conductor wiring: membership, cluster view + scheduler, dispatch, APIs.

GET  /admin/requests         recent requests with their timing breakdown
POST /admin/cache/match      {"prompt": str | [ids]} or {"messages": [...]}: cached prefix
                             tokens per prefill node, from the global index
GET /admin/requests/{id}     one request's trace (?tokens=1 adds the output token ids)
(OpenAI-compatible routes: roles.conductor.openai_api)
"""

from __future__ import annotations

import time

import aiohttp
from aiohttp import web

from model.config import load_model_config
from model.tokenizer import load_tokenizer
from kvstore.keys import block_keys
from mooncaked.errors import ApiError, json_response, read_json
from roles.conductor.cluster import CLUSTER, ClusterView, add_cache_routes
from roles.conductor.dispatch import Dispatcher
from roles.conductor.membership_api import setup_membership
from roles.conductor.metrics import ConductorMetrics
from roles.conductor.openai_api import OPENAI_BACKEND, add_openai_routes
from roles.conductor.openai_types import ApiLimits, GenerationRequest

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
        return self.dispatcher.generate(req.request_id, req.prompt_token_ids, req.sampling)


async def cache_match(request: web.Request) -> web.Response:
    """Where is this prompt's prefix cached? (operators; the replication tests)"""
    from roles.conductor.openai_parse import parse_tokenize

    body = await read_json(request, 8 << 20)
    backend = request.app[OPENAI_BACKEND]
    if isinstance(body, dict) and isinstance(body.get("prompt"), list):
        ids = body["prompt"]
        if not all(isinstance(t, int) for t in ids):
            raise ApiError(400, "prompt token ids must be integers")
    else:
        ids = parse_tokenize(body, backend)
    cluster = request.app[CLUSTER]
    if cluster.block_size is None:
        return json_response({"prompt_tokens": len(ids), "nodes": {}})
    keys = block_keys(ids, cluster.block_size, request.app[DISPATCHER].hash_seed)
    blocks = cluster.scheduler.index.longest_prefix_per_node(keys)
    return json_response({"prompt_tokens": len(ids), "block_size": cluster.block_size,
                          "nodes": {n: b * cluster.block_size for n, b in sorted(blocks.items())}})


def setup_conductor(app: web.Application, ctx) -> None:
    cfg = ctx.config
    registry = setup_membership(app, cfg.node.heartbeat_timeout_s)
    try:
        cluster = ClusterView(registry, cfg.conductor)
    except ValueError as exc:
        from mooncaked.runtime import StartupError
        raise StartupError(str(exc)) from None
    app[CLUSTER] = cluster
    metrics = ConductorMetrics(ctx.metrics)
    tokenizer = load_tokenizer(cfg.model.model)
    model_config = load_model_config(cfg.model.model)
    model_name = cfg.conductor.served_model_name or cfg.model.model

    async def dispatcher_ctx(app: web.Application):
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                     connector=aiohttp.TCPConnector(limit=0))
        dispatcher = Dispatcher(cluster, http, metrics, cfg.store.hash_seed,
                                tokenizer.eos_token_ids, cfg.node.cluster_token)
        app[DISPATCHER] = dispatcher
        app[OPENAI_BACKEND] = ClusterBackend(dispatcher, tokenizer, model_name,
                                             model_config.max_position)
        yield
        await http.close()

    app.cleanup_ctx.append(dispatcher_ctx)
    c = cfg.conductor
    add_openai_routes(app, OPENAI_BACKEND, ApiLimits(
        max_prompt_tokens=c.max_prompt_tokens, max_request_bytes=c.max_request_bytes,
        max_tokens_default=c.max_tokens_default))
    add_cache_routes(app)
    app.router.add_get("/admin/requests", list_requests)
    app.router.add_get("/admin/requests/{request_id}", get_request)
    app.router.add_post("/admin/cache/match", cache_match)

    def nodes_status() -> list[dict]:
        now = time.monotonic()
        return [r.to_dict(now) for r in registry.alive()]

    ctx.status_providers["peers"] = nodes_status
    ctx.status_providers["dead_peers"] = lambda: [r.to_dict(time.monotonic()) for r in registry.dead()]
    ctx.status_providers["scheduler"] = cluster.status
