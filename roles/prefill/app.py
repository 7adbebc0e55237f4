"""Prefill node wiring and its internal endpoints.

POST /internal/prefill          run a prefill (body: see PrefillSpec.from_json)
POST /internal/prefill/cancel   {request_id}
plus the block leases peers use to READ our cached prefixes (store_leases).
"""

from __future__ import annotations

from aiohttp import web

from kvstore.shard import StoreFullError
from mooncaked.node.errors import ApiError, json_response, read_json
from roles.cache_sync import CacheEventPusher
from roles.prefill.cpp import CppStages
from roles.prefill.job import PrefillCancelled, PrefillSpec, prefetch
from roles.prefill.service import PrefillService, QueueFull
from roles.store_leases import add_lease_routes
from roles.worker import add_membership
from roles.worker_node import WORKER, add_worker_resources
from rdma.types import TransferError

PREFILL = web.AppKey("prefill", PrefillService)
PUSHER = web.AppKey("pusher", CacheEventPusher)
CPP_STAGES = web.AppKey("cpp_stages", CppStages)


async def prefill(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    body = await read_json(request, 64 << 20)
    try:
        spec = PrefillSpec.from_json(body, worker.layout.block_size)
    except (KeyError, TypeError, ValueError) as exc:
        raise ApiError(400, f"bad prefill request: {exc}") from None
    try:
        result = await request.app[PREFILL].submit(spec)
    except QueueFull as exc:
        raise ApiError(503, str(exc)) from None
    except PrefillCancelled as exc:
        raise ApiError(409, f"prefill {spec.request_id} cancelled: {exc}") from None
    except StoreFullError as exc:
        raise ApiError(503, f"no KV pages free on this prefill node: {exc}") from None
    except TransferError as exc:
        raise ApiError(502, f"streaming KV to the decode node failed: {exc.reason}") from None
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    # New blocks should reach the global index before the next decision.
    await request.app[PUSHER].flush()
    return json_response(result.to_json())


async def prefetch_blocks(request: web.Request) -> web.Response:
    """POST /internal/store/prefetch {token_ids, block_keys, source_url}: replicate a prefix here."""
    worker = request.app[WORKER]
    body = await read_json(request, 64 << 20)
    try:
        tokens, keys, source = body["token_ids"], body["block_keys"], str(body["source_url"])
        if len(keys) != len(tokens) // worker.layout.block_size:
            raise ValueError("block_keys must hold one key per full block")
    except (KeyError, TypeError, ValueError) as exc:
        raise ApiError(400, f"bad prefetch request: {exc}") from None
    held, error = await prefetch(worker, source, tokens, keys, request.app[PREFILL].fetch_timeout_s)
    await request.app[PUSHER].flush()
    return json_response({"held_tokens": held, "error": error})


async def cancel(request: web.Request) -> web.Response:
    body = await read_json(request, 1 << 16)
    return json_response({"cancelled": request.app[PREFILL].cancel(str(body.get("request_id")))})


def _cpp_handler(name: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        stages = request.app.get(CPP_STAGES)
        if stages is None:
            raise ApiError(404, "this prefill node is not a pipeline stage")
        return await getattr(stages, name)(request)
    return handler


def add_prefill_service(app: web.Application, ctx, worker) -> None:
    """Prefill queue, cache-event pusher, block leases and the prefill endpoints."""

    async def service(app: web.Application):
        cfg = ctx.config
        svc = PrefillService(worker, cfg.model.prefill_chunk, cfg.prefill.max_queue,
                             cfg.prefill.fetch_timeout_s, cfg.prefill.prefix_cache,
                             cfg.prefill.cpp_chunk_timeout_s, cfg.prefill.batch_tokens)
        stages = None
        if worker.cpp:
            stages = CppStages(worker, cfg.model.prefill_chunk, cfg.prefill.cpp_chunk_timeout_s)
            app[CPP_STAGES] = stages
        pusher = CacheEventPusher(worker.shard, worker.http, cfg.node.conductor_url, ctx.node_id)
        app[PREFILL] = svc
        app[PUSHER] = pusher
        svc.start()
        pusher.start()
        ctx.load_providers.append(svc.load)
        ctx.status_providers["prefill"] = svc.load
        yield
        await svc.close()
        if stages is not None:
            await stages.close()
        await pusher.close()

    app.cleanup_ctx.append(service)
    add_lease_routes(app, worker)
    app.router.add_post("/internal/prefill", prefill)
    app.router.add_post("/internal/prefill/cancel", cancel)
    app.router.add_post("/internal/store/prefetch", prefetch_blocks)
    for path, name in (("prepare", "prepare"), ("start", "start"), ("chunk", "chunk"),
                       ("abort", "abort")):
        app.router.add_post(f"/internal/cpp/{path}", _cpp_handler(name))


def setup_prefill(app: web.Application, ctx) -> None:
    add_prefill_service(app, ctx, add_worker_resources(app, ctx))
    add_membership(app, ctx)
