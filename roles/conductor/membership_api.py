"""Internal endpoints through which prefill/decode nodes join the cluster.

POST /internal/nodes/register    {node_id, role, url, capacity, transfer, load}
POST /internal/nodes/heartbeat   {node_id, load}      -> 404 if unknown: re-register
POST /internal/nodes/deregister  {node_id}
GET  /internal/segments/{name}   transfer-engine segment descriptor of a node
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from mooncaked.node.context import CTX
from mooncaked.node.errors import ApiError, json_response, read_json
from mooncaked.node.membership import NodeRegistry
from mooncaked.node.tasks import cancel_and_wait

log = logging.getLogger("mooncaked.conductor.membership")
REGISTRY = web.AppKey("registry", NodeRegistry)


async def _body(request: web.Request) -> dict[str, Any]:
    # The cluster token (if any) was checked by internal_auth_middleware.
    data = await read_json(request, 1 << 20)
    if not isinstance(data, dict):
        raise ApiError(400, "expected a JSON object")
    return data


async def register(request: web.Request) -> web.Response:
    data = await _body(request)
    try:
        record = request.app[REGISTRY].register(data, time.monotonic())
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    log.info("node joined: %s (%s) at %s", record.node_id, record.role, record.url)
    ctx = request.app[CTX]
    return json_response({"node_id": record.node_id,
                          "heartbeat_interval_s": ctx.config.node.heartbeat_interval_s})


async def heartbeat(request: web.Request) -> web.Response:
    data = await _body(request)
    load = data.get("load") if isinstance(data.get("load"), dict) else {}
    if not request.app[REGISTRY].heartbeat(str(data.get("node_id")), load, time.monotonic()):
        raise ApiError(404, f"unknown node {data.get('node_id')!r}: register first")
    return json_response({"ok": True})


async def deregister(request: web.Request) -> web.Response:
    data = await _body(request)
    if request.app[REGISTRY].deregister(str(data.get("node_id"))):
        log.info("node left: %s", data.get("node_id"))
    return json_response({"ok": True})


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
    app.router.add_post("/internal/nodes/register", register)
    app.router.add_post("/internal/nodes/heartbeat", heartbeat)
    app.router.add_post("/internal/nodes/deregister", deregister)
    app.router.add_get("/internal/segments/{name}", segment)
    app.cleanup_ctx.append(_sweeper)
    return registry
