"""What prefill and decode nodes share: joining the cluster through the conductor."""

from __future__ import annotations

from aiohttp import web

from mooncaked.node.context import NodeContext
from mooncaked.node.errors import StartupError
from mooncaked.node.membership import ConductorUnreachable, MembershipClient


def add_membership(app: web.Application, ctx: NodeContext) -> None:
    """Register with the conductor once every other resource is up (append last)."""

    async def membership(app: web.Application):
        node = ctx.config.node
        client = MembershipClient(
            conductor_url=node.conductor_url, info_fn=ctx.registration, load_fn=ctx.load,
            interval_s=node.heartbeat_interval_s, connect_timeout_s=node.conductor_connect_timeout_s,
            token=node.cluster_token)
        try:
            await client.start()
        except ConductorUnreachable as exc:
            await client.close()
            raise StartupError(str(exc)) from None
        ctx.status_providers["peers"] = lambda: [{"node_id": "conductor", "url": node.conductor_url,
                                                 "registered": client.registered}]
        yield
        await client.close()

    app.cleanup_ctx.append(membership)
