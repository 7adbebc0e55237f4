"""Internal endpoints through which prefill/decode nodes join the cluster
(messages: mooncaked.node.messages; the cluster token, if any, was checked by
internal_auth_middleware).

POST /internal/nodes/register    NodeRegistration {node_id, role, url, capacity, transfer, load}
                                 -> RegistrationAck
POST /internal/nodes/heartbeat   Heartbeat {node_id, load}   -> 404 if unknown: re-register
POST /internal/nodes/deregister  Deregistration {node_id}
GET  /internal/segments/{name}   the transfer-engine segment descriptor a node registered
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from mooncaked.node.context import CTX
from mooncaked.node.errors import ApiError, json_response
from mooncaked.node.internal_client import read_message, reply
from mooncaked.node.messages import (Deregistration, Heartbeat, NodeRegistration, Ok,
                                     RegistrationAck, Route)
from mooncaked.node.membership import NodeRegistry
from mooncaked.node.tasks import cancel_and_wait

log = logging.getLogger("mooncaked.conductor.membership")
REGISTRY = web.AppKey("registry", NodeRegistry)


async def register(request: web.Request) -> web.Response:
    info = await read_message(request, NodeRegistration, 1 << 20)
    record = request.app[REGISTRY].register(info, time.monotonic())
    log.info("node joined: %s (%s) at %s", record.node_id, record.role, record.url)
    ctx = request.app[CTX]
    return reply(RegistrationAck(node_id=record.node_id,
                                 heartbeat_interval_s=ctx.config.node.heartbeat_interval_s))


async def heartbeat(request: web.Request) -> web.Response:
    beat = await read_message(request, Heartbeat, 1 << 20)
    if not request.app[REGISTRY].heartbeat(beat.node_id, beat.load, time.monotonic()):
        raise ApiError(404, f"unknown node {beat.node_id!r}: register first")
    return reply(Ok())


async def deregister(request: web.Request) -> web.Response:
    bye = await read_message(request, Deregistration, 1 << 20)
    if request.app[REGISTRY].deregister(bye.node_id):
        log.info("node left: %s", bye.node_id)
    return reply(Ok())


async def segment(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    for record in request.app[REGISTRY].alive():
        if record.transfer.get("name") == name or record.node_id == name:
            return json_response(record.transfer)
    raise ApiError(404, f"no live node publishes segment {name!r}")


async def _sweeper(app: web.Application):
    registry = app[REGISTRY]
    interval = min(1.0, registry.timeout_s / 4)

    async def loop() -> None:
        while True:
            await asyncio.sleep(interval)
            for record in registry.sweep(time.monotonic()):
                log.warning("node %s (%s) missed heartbeats for %.1fs: marked dead",
                            record.node_id, record.role, registry.timeout_s)

    task = asyncio.create_task(loop(), name="membership-sweeper")
    yield
    await cancel_and_wait(task)


def setup_membership(app: web.Application, timeout_s: float) -> NodeRegistry:
    registry = NodeRegistry(timeout_s)
    app[REGISTRY] = registry
    app.router.add_post(Route.NODE_REGISTER, register)
    app.router.add_post(Route.NODE_HEARTBEAT, heartbeat)
    app.router.add_post(Route.NODE_DEREGISTER, deregister)
    app.router.add_get(Route.SEGMENT, segment)
    app.cleanup_ctx.append(_sweeper)
    return registry
