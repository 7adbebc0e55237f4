"""Decode node wiring and its internal endpoints.

POST /internal/decode/reserve   {request_id, total_tokens}
                                -> {pages, segment, region}   (503 when out of pages)
POST /internal/decode/generate  {request_id, prompt_len, first_token, sampling}
                                -> NDJSON stream: {"token", "logprob", "finish_reason"} per line
POST /internal/decode/touch     {request_id}     keep a reservation alive while its prefill runs
POST /internal/decode/cancel    {request_id}
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from aiohttp import web

from kvstore.shard import StoreFullError
from model.sampling import SamplingParams
from model.tokenizer import load_tokenizer
from mooncaked.node.errors import ApiError, json_response, read_json
from roles.decode.batcher import DecodeBatcher
from roles.worker import add_membership
from roles.worker_node import WORKER, add_worker_resources

log = logging.getLogger("mooncaked.decode")
BATCHER = web.AppKey("batcher", DecodeBatcher)


async def _object(request: web.Request) -> dict:
    body = await read_json(request, 1 << 20)
    if not isinstance(body, dict) or not isinstance(body.get("request_id"), str):
        raise ApiError(400, "expected a JSON object with a string request_id")
    return body


async def reserve(request: web.Request) -> web.Response:
    body = await _object(request)
    total = body.get("total_tokens")
    if not isinstance(total, int) or total <= 0:
        raise ApiError(400, "total_tokens must be a positive integer")
    worker = request.app[WORKER]
    try:
        pages = request.app[BATCHER].reserve(body["request_id"], total)
    except StoreFullError as exc:
        raise ApiError(503, f"decode node out of KV pages: {exc}") from None
    except ValueError as exc:
        raise ApiError(409, str(exc)) from None
    return json_response({"pages": pages, "segment": worker.engine.name, "region": worker.region_id})


async def generate(request: web.Request) -> web.StreamResponse:
    body = await _object(request)
    batcher = request.app[BATCHER]
    request_id = body["request_id"]
    try:
        sampling = SamplingParams(**(body.get("sampling") or {}))
        queue = batcher.start(request_id, int(body["prompt_len"]), int(body["first_token"]), sampling)
    except KeyError as exc:
        raise ApiError(404, str(exc).strip("'\"")) from None
    except (TypeError, ValueError) as exc:
        batcher.release(request_id, "bad request")
        raise ApiError(400, f"bad generate request: {exc}") from None
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    reason = "client gone"
    try:
        while True:
            item = await queue.get()
            if item is None:  # released: cancelled or expired
                reason = "cancelled"
                await resp.write(orjson.dumps({"error": "cancelled"}) + b"\n")
                break
            token, logprob, finish = item
            await resp.write(orjson.dumps({"token": token, "logprob": logprob,
                                           "finish_reason": finish}) + b"\n")
            if finish is not None:
                reason = finish
                break
        await resp.write_eof()
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("%s: conductor went away; cancelling", request_id)
        raise
    finally:
        batcher.release(request_id, reason)
    return resp


async def touch(request: web.Request) -> web.Response:
    body = await _object(request)
    if not request.app[BATCHER].touch(body["request_id"]):
        raise ApiError(404, f"no reservation for request {body['request_id']}")
    return json_response({"ok": True})


async def cancel(request: web.Request) -> web.Response:
    body = await _object(request)
    return json_response({"cancelled": request.app[BATCHER].release(body["request_id"], "cancelled")})


def add_decode_service(app: web.Application, ctx, worker) -> None:
    """Continuous batcher, reservations and the decode endpoints."""

    async def batcher_ctx(app: web.Application):
        cfg = ctx.config
        eos = load_tokenizer(cfg.model.model).eos_token_ids
        batcher = DecodeBatcher(worker, cfg.decode.max_batch, cfg.decode.reservation_timeout_s, eos)
        app[BATCHER] = batcher
        batcher.run()
        ctx.load_providers.append(batcher.load)
        ctx.status_providers["decode"] = batcher.load
        ctx.capacity["max_batch"] = cfg.decode.max_batch
        yield
        await batcher.close()

    app.cleanup_ctx.append(batcher_ctx)
    app.router.add_post("/internal/decode/reserve", reserve)
    app.router.add_post("/internal/decode/generate", generate)
    app.router.add_post("/internal/decode/cancel", cancel)
    app.router.add_post("/internal/decode/touch", touch)


def setup_decode(app: web.Application, ctx) -> None:
    add_decode_service(app, ctx, add_worker_resources(app, ctx))
    add_membership(app, ctx)
