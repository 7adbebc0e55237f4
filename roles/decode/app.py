"""Decode node wiring and its internal endpoints (messages: mooncaked.node.messages).

POST /internal/decode/reserve   ReservationRequest {request_id, total_tokens}
                                -> ReservationGrant {pages, segment, region, capability}
                                   (503 when out of pages)
POST /internal/decode/generate  DecodeStart {request_id, prompt_len, first_token, sampling,
                                             prompt_token_ids?}
                                -> NDJSON stream: a TokenLine {"token", "logprob",
                                   "finish_reason"} per line, or a last StreamError {"error"}
POST /internal/decode/start     DecodeStartFromPrefill -> Ok: the prefill node starts the
                                decode as soon as the KV has landed; the conductor's
                                generate then attaches to the tokens decoded meanwhile
POST /internal/decode/touch     RequestRef: keep a reservation alive while its prefill runs
POST /internal/decode/cancel    RequestRef -> Cancelled
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import orjson
from aiohttp import web

from kvstore.shard import StoreFullError
from model.tokenizer import load_tokenizer
from mooncaked.node.context import NodeContext
from mooncaked.node.errors import ApiError, read_json
from mooncaked.node.internal_client import bad_message, read_message, reply
from mooncaked.node.messages import (Cancelled, DecodeStart, DecodeStartFromPrefill,
                                     MessageError, Ok, RequestRef, ReservationGrant,
                                     ReservationRequest, Route, StreamError, TokenLine)
from roles.decode.batcher import DecodeBatcher
from roles.worker import add_membership
from roles.worker_node import WORKER, WorkerNode, add_worker_resources

log = logging.getLogger("mooncaked.decode")
BATCHER = web.AppKey("batcher", DecodeBatcher)


def reserve_pages(worker: WorkerNode, batcher: DecodeBatcher, request_id: str,
                  total_tokens: int, param: str) -> ReservationGrant:
    """Pages for ``total_tokens`` of ``request_id`` on this node, as a grant
    its prefill (here or on a peer) writes the KV into; ApiError 413 when
    the node could never hold them, 503 when it cannot now, 409 when the
    request holds a reservation already.  ``param``: the field to blame."""
    needed = -(-total_tokens // worker.layout.block_size)
    if needed > worker.shard.num_pages:
        # Not "busy" (503): this node could never hold it, however long one waits.
        raise ApiError(413, f"{param}: {total_tokens} tokens need {needed} pages; this decode "
                            f"node has {worker.shard.num_pages}", param=param)
    try:
        pages = batcher.reserve(request_id, total_tokens)
    except StoreFullError as exc:
        raise ApiError(503, f"decode node out of KV pages: {exc}") from None
    except ValueError as exc:
        raise ApiError(409, str(exc)) from None
    return ReservationGrant(pages=pages, segment=worker.engine.name, region=worker.region_id,
                            capability=batcher.capability(request_id))


async def reserve(request: web.Request) -> web.Response:
    req = await read_message(request, ReservationRequest, 1 << 20)
    return reply(reserve_pages(request.app[WORKER], request.app[BATCHER], req.request_id,
                               req.total_tokens, "decode.reserve.total_tokens"))


async def generate(request: web.Request) -> web.StreamResponse:
    body = await read_json(request, 1 << 20)
    batcher = request.app[BATCHER]
    try:
        request_id = RequestRef.from_wire(body, "decode.generate").request_id
    except MessageError as exc:
        raise bad_message(exc) from None
    try:
        start = DecodeStart.from_wire(body)
        queue = batcher.start(request_id, start.prompt_len, start.first_token, start.sampling,
                              start.prompt_token_ids)
    except KeyError as exc:
        raise ApiError(404, str(exc).strip("'\"")) from None
    except ValueError as exc:  # malformed, or more than the reservation holds: give it up
        batcher.release(request_id, "bad request")
        raise (bad_message(exc) if isinstance(exc, MessageError)
               else ApiError(400, f"bad generate request: {exc}")) from None
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    await write_tokens(resp, batcher, request_id, queue)
    return resp


async def write_tokens(resp: web.StreamResponse, batcher: DecodeBatcher, request_id: str,
                       queue: asyncio.Queue) -> None:
    """A TokenLine per token of ``queue`` (a sequence's tokens) into the
    prepared NDJSON ``resp``, or a last StreamError when it is released
    first; the sequence is released once its stream ends, however it ends."""
    reason = "client gone"
    try:
        while True:
            item = await queue.get()
            if item is None:  # released: cancelled or expired
                reason = "cancelled"
                await resp.write(orjson.dumps(StreamError(error="cancelled").to_wire()) + b"\n")
                break
            token, logprob, finish, top = item
            line = TokenLine(token=token, logprob=logprob, finish_reason=finish,
                             top_logprobs=top)
            await resp.write(orjson.dumps(line.to_wire()) + b"\n")
            if finish is not None:
                reason = finish
                break
        await resp.write_eof()
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("%s: conductor went away; cancelling", request_id)
        raise
    finally:
        batcher.release(request_id, reason)


async def start_from_prefill(request: web.Request) -> web.Response:
    """The prefill node's start (its KV WRITEs all acknowledged, so in the
    pages): decoding begins now; the conductor's generate attaches to it.
    Nothing is released on a refusal: the conductor's own start, which
    follows, meets the same refusal (or finds the request started) and
    reports it to the client."""
    msg = await read_message(request, DecodeStartFromPrefill, 1 << 20)
    batcher = request.app[BATCHER]
    start = msg.start
    try:
        if batcher.capability(start.request_id) != msg.capability:
            raise ApiError(403, f"decode.start.capability: not the capability of the "
                                f"reservation of {start.request_id}",
                           param="decode.start.capability")
        batcher.start(start.request_id, start.prompt_len, start.first_token, start.sampling,
                      start.prompt_token_ids, early=True)
    except KeyError:
        raise ApiError(404, f"no reservation for request {start.request_id}") from None
    except ValueError as exc:
        raise ApiError(409, f"decode of {start.request_id} not started here: {exc}") from None
    return reply(Ok())


async def touch(request: web.Request) -> web.Response:
    ref = await read_message(request, RequestRef, 1 << 20, "decode.touch")
    if not request.app[BATCHER].touch(ref.request_id):
        raise ApiError(404, f"no reservation for request {ref.request_id}")
    return reply(Ok())


async def cancel(request: web.Request) -> web.Response:
    ref = await read_message(request, RequestRef, 1 << 20, "decode.cancel")
    return reply(Cancelled(cancelled=request.app[BATCHER].release(ref.request_id, "cancelled")))


def install_write_guard(worker: WorkerNode, batcher: DecodeBatcher) -> None:
    """From now on a WRITE lands in the shard's region only into pages the
    batcher granted to the WRITE's capability (tcp; docs/transfer.md)."""
    worker.engine.set_write_guard(worker.region_id, batcher.grants)


def add_decode_service(app: web.Application, ctx: NodeContext) -> None:
    """Continuous batcher, reservations and the decode endpoints (append after
    ``add_worker_resources``: they run on its open worker)."""

    async def batcher_ctx(app: web.Application):
        cfg = ctx.config
        worker = app[WORKER]
        eos = load_tokenizer(cfg.model.model).eos_token_ids
        batcher = DecodeBatcher(worker, cfg.decode.max_batch, cfg.decode.reservation_timeout_s, eos,
                                contiguous_kv_bytes=cfg.decode.contiguous_kv_mb << 20)
        install_write_guard(worker, batcher)
        app[BATCHER] = batcher
        worker.start_decode_here = lambda rid, prompt_len, first, sampling, prompt_ids: \
            batcher.start(rid, prompt_len, first, sampling, prompt_ids, early=True)
        worker.reserve_here = lambda rid, total_tokens: reserve_pages(
            worker, batcher, rid, total_tokens, "prefill.reserve_here")

        async def decode_here(resp: web.StreamResponse, rid: str, prompt_len: int,
                              first: int) -> bool:
            queue = batcher.attach_early(rid, prompt_len, first)
            if queue is None:
                return False
            await write_tokens(resp, batcher, rid, queue)
            return True

        worker.decode_here = decode_here
        batcher.run()
        ctx.load_providers.append(batcher.load)
        ctx.status_providers["decode"] = lambda: batcher.load().to_wire()
        ctx.collection_sizes.append(lambda: {
            "decode_seqs": len(batcher.seqs), "decode_waiting": len(batcher.waiting),
            "decode_running": len(batcher.running), "write_grants": batcher.grants.live})
        ctx.capacity = dataclasses.replace(ctx.capacity, max_batch=cfg.decode.max_batch)
        yield
        await batcher.close()

    app.cleanup_ctx.append(batcher_ctx)
    app.router.add_post(Route.DECODE_RESERVE, reserve)
    app.router.add_post(Route.DECODE_GENERATE, generate)
    app.router.add_post(Route.DECODE_CANCEL, cancel)
    app.router.add_post(Route.DECODE_TOUCH, touch)
    app.router.add_post(Route.DECODE_START, start_from_prefill)


def setup_decode(app: web.Application, ctx: NodeContext) -> None:
    add_worker_resources(app, ctx)
    add_decode_service(app, ctx)
    add_membership(app, ctx)
