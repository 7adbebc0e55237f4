"""Prefill node wiring and its internal endpoints (messages: mooncaked.node.messages).

POST /internal/prefill          PrefillRequest -> PrefillReply: run a prefill (on a
                                colocated node, reserving its decode pages first when
                                the request says reserve_here; with stream_decode too,
                                an NDJSON stream: the reply, then a TokenLine per
                                token decoded here, or a last StreamError)
POST /internal/prefill/cancel   RequestRef -> Cancelled
POST /internal/store/prefetch   PrefetchRequest -> PrefetchReply: replicate a prefix here
POST /internal/cpp/*            the pipeline stage endpoints (roles.prefill.cpp_routes)
plus the block leases peers use to READ our cached prefixes (store_leases).
"""

from __future__ import annotations

import dataclasses

import orjson
from aiohttp import web

from kvstore.shard import StoreFullError
from mooncaked.node.errors import ApiError
from mooncaked.node.context import NodeContext
from mooncaked.node.internal_client import read_message, reply
from mooncaked.node.messages import (Cancelled, PrefetchReply, PrefetchRequest, PrefillReply,
                                     PrefillRequest, RequestRef, ReservationGrant, Route)
from roles.cache_sync import CacheEventPusher
from roles.prefill.cpp_routes import CPP_STAGES, CppStages, add_cpp_routes
from roles.prefill.job import PrefillCancelled, prefetch
from roles.prefill.service import PrefillService, QueueFull
from roles.store_leases import add_lease_routes
from roles.worker import add_membership
from roles.worker_node import WORKER, WorkerNode, add_worker_resources
from rdma.types import TransferError

PREFILL = web.AppKey("prefill", PrefillService)
PUSHER = web.AppKey("pusher", CacheEventPusher)


async def prefill(request: web.Request) -> web.StreamResponse:
    worker = request.app[WORKER]
    spec = await read_message(request, PrefillRequest, 64 << 20, block_size=worker.layout.block_size)
    if spec.decode is None:
        # A colocated node decoding the request itself: it reserves now.  On
        # any failure below the conductor cancels the reservation, as one it
        # made; unclaimed, it expires (decode.reservation_timeout_s).
        if worker.reserve_here is None or spec.cpp is not None:
            raise ApiError(400, "prefill.reserve_here: this node does not decode requests it "
                                "prefills; send a decode reservation", param="prefill.reserve_here")
        spec = dataclasses.replace(spec, decode=worker.reserve_here(spec.request_id,
                                                                    spec.reserve_here))
    else:
        await check_decode_target(worker, spec.decode)
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
    # New blocks should reach the global index before the next decision: a
    # reply that lists them (result.stored) takes them to the conductor
    # itself, so the events are pushed beside it, not before it (the push
    # held every reply up by a conductor round trip: median 1 ms, p90 2.5 ms
    # on trace-gen at 2x).  A pipeline's reply lists none: pushed first.
    if result.cpp is None:
        request.app[PUSHER].kick()
    else:
        await request.app[PUSHER].flush()
    if not spec.stream_decode:
        return reply(result)
    return await _reply_then_decode(request, worker, spec, result)


async def _reply_then_decode(request: web.Request, worker: WorkerNode, spec: PrefillRequest,
                             result: PrefillReply) -> web.StreamResponse:
    """The reply as the first NDJSON line, then the tokens this node decodes
    for the request (PrefillRequest.stream_decode): the second token leaves
    with the first decode step, not after the conductor's DecodeStart has
    come and attached.  Ends after the reply where this node's prefill did
    not start the decode (decode_here: nothing to read)."""
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    await resp.write(orjson.dumps(result.to_wire()) + b"\n")
    assert worker.decode_here is not None   # stream_decode comes with reserve_here
    if not await worker.decode_here(resp, spec.request_id, len(spec.token_ids),
                                    result.first_token):
        await resp.write_eof()
    return resp


async def check_decode_target(worker: WorkerNode, grant: ReservationGrant) -> None:
    """400 for a WRITE target that cannot exist (a page past the decode region's
    end): refused before the prefill is computed, not as a failed transfer (502)
    after it.  A segment that cannot be resolved now is left to the transfer,
    which reports it as the network failure it most likely is."""
    try:
        desc = await worker.engine.resolve_segment(grant.segment)
    except Exception:  # noqa: BLE001 - the resolver's own failure: the transfer says more
        return
    if desc is None:
        return
    region = desc.region(grant.region)
    if region is None:
        raise ApiError(400, f"prefill.decode.region: segment {grant.segment!r} has no region "
                            f"{grant.region}", param="prefill.decode.region")
    num_pages = region.length // worker.full_layout.page_bytes
    bad = next((p for p in grant.pages if not 0 <= p < num_pages), None)
    if bad is not None:
        raise ApiError(400, f"prefill.decode.pages: page {bad} is outside region {grant.region} of "
                            f"segment {grant.segment!r} ({num_pages} pages)",
                       param="prefill.decode.pages")


async def prefetch_blocks(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    req = await read_message(request, PrefetchRequest, 64 << 20, block_size=worker.layout.block_size)
    held, error = await prefetch(worker, req.source_url, req.token_ids, req.block_keys,
                                 request.app[PREFILL].fetch_timeout_s)
    await request.app[PUSHER].flush()
    return reply(PrefetchReply(held_tokens=held, error=error))


async def cancel(request: web.Request) -> web.Response:
    ref = await read_message(request, RequestRef, 1 << 16, "prefill.cancel")
    return reply(Cancelled(cancelled=request.app[PREFILL].cancel(ref.request_id)))


def add_prefill_service(app: web.Application, ctx: NodeContext) -> None:
    """Prefill queue, cache-event pusher, block leases and the prefill endpoints
    (append after ``add_worker_resources``: they run on its open worker)."""

    async def service(app: web.Application):
        cfg = ctx.config
        worker = app[WORKER]
        svc = PrefillService(worker, cfg.model.prefill_chunk, cfg.prefill.max_queue,
                             cfg.prefill.fetch_timeout_s, cfg.prefill.prefix_cache,
                             cfg.prefill.cpp_chunk_timeout_s, cfg.prefill.batch_tokens,
                             cfg.prefill.batch_within_predictions)
        stages = None
        if worker.cpp:
            stages = CppStages(worker, cfg.model.prefill_chunk, cfg.prefill.cpp_chunk_timeout_s)
            app[CPP_STAGES] = stages
        pusher = CacheEventPusher(worker.shard, worker.client, ctx.conductor, ctx.node_id)
        app[PREFILL] = svc
        app[PUSHER] = pusher
        svc.start()
        pusher.start()
        ctx.load_providers.append(svc.load)
        ctx.status_providers["prefill"] = lambda: svc.load().to_wire()
        ctx.collection_sizes.append(lambda: {"prefill_jobs": len(svc.jobs),
                                             "prefill_running": len(svc.running)})
        yield
        await svc.close()
        if stages is not None:
            await stages.close()
        await pusher.close()

    app.cleanup_ctx.append(service)
    add_lease_routes(app)
    app.router.add_post(Route.PREFILL, prefill)
    app.router.add_post(Route.PREFILL_CANCEL, cancel)
    app.router.add_post(Route.PREFETCH, prefetch_blocks)
    add_cpp_routes(app)


def setup_prefill(app: web.Application, ctx: NodeContext) -> None:
    add_worker_resources(app, ctx)
    add_prefill_service(app, ctx)
    add_membership(app, ctx)
