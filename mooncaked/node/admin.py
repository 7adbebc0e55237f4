"""Admin HTTP endpoints served by every node (on the API port for the conductor).

GET  /healthz       alive (200 while the process serves HTTP)
GET  /readyz        200 when taking new work, 503 while starting or draining
GET  /metrics       Prometheus text format
GET  /admin/status  role, version, uptime, config in force, peers, role details,
                    "collections": asyncio tasks, threads and the sizes of the
                    daemon's long-lived collections (what a soak watches)
POST /admin/drain   stop taking new work (bearer admin_token)
POST /admin/undrain take work again (bearer admin_token)
"""

from __future__ import annotations

import asyncio
import os
import threading

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mooncaked import __version__
from mooncaked.node.context import CTX
from mooncaked.node.errors import json_response, require_bearer


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    if ctx.taking_work:
        return json_response({"status": "ready"})
    state = "draining" if ctx.draining else "starting"
    return json_response({"status": state}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[CTX].metrics)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def status(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    out = {
        "role": ctx.role, "node_id": ctx.node_id, "url": ctx.url, "version": __version__,
        "pid": os.getpid(),
        "uptime_s": round(ctx.uptime_s(), 3), "ready": ctx.ready, "draining": ctx.draining,
        "config": ctx.config.redacted(),
    }
    for name, provider in ctx.status_providers.items():
        out[name] = provider()
    out.setdefault("peers", [])
    out["collections"] = collections(ctx)
    return json_response(out)


def collections(ctx) -> dict[str, int]:
    """Counts that must stay bounded in a long-running daemon: O(1) each."""
    sizes = {"asyncio_tasks": len(asyncio.all_tasks()), "threads": threading.active_count()}
    for provider in ctx.collection_sizes:
        sizes.update(provider())
    return sizes


async def drain(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    require_bearer(request, ctx.config.node.admin_token, "POST /admin/drain")
    ctx.draining = True
    return json_response({"draining": True})


async def undrain(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    require_bearer(request, ctx.config.node.admin_token, "POST /admin/undrain")
    ctx.draining = False
    return json_response({"draining": False})


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/status", status)
    app.router.add_post("/admin/drain", drain)
    app.router.add_post("/admin/undrain", undrain)
