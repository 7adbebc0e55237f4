"""Colocated role: one node runs both prefill and decode (the vLLM-like baseline).

It serves the prefill and decode endpoints over ONE worker: one store shard
(so only its own prefix cache is reused), one model, one compute thread — a
long prefill therefore stalls the decode steps of every running request,
which is exactly the interference that disaggregation removes.  KV "streamed"
to the decode side is a local copy between pages of the same shard.
"""

from __future__ import annotations

import dataclasses

from aiohttp import web

from mooncaked.node.context import NodeContext
from roles.decode.app import add_decode_service
from roles.prefill.app import add_prefill_service
from roles.worker import add_membership
from roles.worker_node import add_worker_resources


def setup_colocated(app: web.Application, ctx: NodeContext) -> None:
    add_worker_resources(app, ctx)
    add_prefill_service(app, ctx)
    add_decode_service(app, ctx)

    async def reserves_with_prefill(app: web.Application):
        # Announced before registering: the conductor then sends requests it
        # prefills and decodes here with reserve_here instead of reserving first.
        ctx.capacity = dataclasses.replace(ctx.capacity, reserves_with_prefill=True)
        yield

    app.cleanup_ctx.append(reserves_with_prefill)
    add_membership(app, ctx)
