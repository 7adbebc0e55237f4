"""Conductor wiring: membership, scheduling, OpenAI API, admin status."""

from __future__ import annotations

import time

from aiohttp import web

from roles.conductor.membership_api import setup_membership


def setup_conductor(app: web.Application, ctx) -> None:
    registry = setup_membership(app, ctx.config.node.heartbeat_timeout_s)

    def nodes_status() -> list[dict]:
        now = time.monotonic()
        return [r.to_dict(now) for r in registry.alive()]

    ctx.status_providers["peers"] = nodes_status
    ctx.status_providers["dead_peers"] = lambda: [r.to_dict(time.monotonic()) for r in registry.dead()]
