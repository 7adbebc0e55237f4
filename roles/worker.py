"""What prefill and decode nodes share: joining the cluster through the conductor
(a fixed one, or with ``[etcd]`` whichever conductor etcd names the leader)."""

from __future__ import annotations

from aiohttp import web

from mooncaked.node.context import NodeContext
from mooncaked.node.errors import StartupError
from mooncaked.node.membership import ConductorUnreachable, MembershipClient


def add_membership(app: web.Application, ctx: NodeContext) -> None:
    """Register with the conductor once every other resource is up (append last)."""

    async def membership(app: web.Application):
        node, etcd = ctx.config.node, ctx.config.etcd
        discovery = None  # or: on_leader -> EtcdDiscovery
        if etcd.enabled:
            from mooncaked.node.discovery import EtcdDiscovery
            from mooncaked.node.etcd_store import EtcdStore, EtcdUnavailable

            try:
                store = EtcdStore(etcd)
            except EtcdUnavailable as exc:
                raise StartupError(str(exc)) from None

            def make_discovery(on_leader):
                return EtcdDiscovery(store, ctx.registration, etcd.lease_ttl_s, on_leader)
            discovery = make_discovery
        client = MembershipClient(
            conductor_url=ctx.conductor, info_fn=ctx.registration, load_fn=ctx.load,
            interval_s=node.heartbeat_interval_s, connect_timeout_s=node.conductor_connect_timeout_s,
            token=node.cluster_token, discovery=discovery)
        try:
            await client.start()
        except ConductorUnreachable as exc:
            await client.close()
            raise StartupError(str(exc)) from None
        ctx.status_providers["peers"] = lambda: [{"node_id": "conductor", "url": client.conductor_url,
                                                 "registered": client.registered}]
        if client.discovery is not None:
            ctx.status_providers["etcd"] = client.discovery.status
        yield
        await client.close()

    app.cleanup_ctx.append(membership)
