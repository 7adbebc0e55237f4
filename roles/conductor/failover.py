"""Several conductors on one etcd: the leader serves, standbys forward to it.

Every conductor runs a ``LeaderElection`` (``mooncaked.node.election``) and
answers the whole OpenAI API (``/v1/...``):
  * the leader serves requests itself; on winning it first loads every node
    record from etcd into its registry (so it can schedule before the nodes'
    next heartbeat) and on every round marks dead the nodes whose etcd record
    has expired.  The nodes move to it by themselves (they watch the leader
    key) and send it their cache snapshots, rebuilding its cache index;
  * a standby forwards each request to the leader and relays the answer,
    streaming included (chunk by chunk as the leader writes them).  If the
    leader dies mid-request the client gets a clear error: a 503 JSON error,
    or once a stream has started an in-band SSE error event then ``[DONE]``;
  * with etcd unreachable for a lease TTL a conductor cannot know who leads:
    a new request waits up to another TTL for etcd and is then refused with
    503 + Retry-After (requests already dispatched run to their end); the
    conductor serves again by itself once etcd answers.  A shorter blip (an
    etcd member lost) delays requests and refuses none.

Only ``/v1/`` is gated: admin, metrics and the nodes' /internal/ calls are
always answered locally.
"""

from __future__ import annotations

import logging
import time

import aiohttp
import orjson
from aiohttp import web

from mooncaked.node.context import NodeContext
from mooncaked.node.election import LeaderElection, new_incarnation
from mooncaked.node.errors import ApiError, StartupError, error_body
from mooncaked.node.etcd_store import ConductorRecord, EtcdStore, EtcdUnavailable, decode_node
from mooncaked.node.membership import NodeRegistry

log = logging.getLogger("mooncaked.conductor.failover")

ELECTION = web.AppKey("election", LeaderElection)
FORWARD_SESSION = web.AppKey("forward_session", aiohttp.ClientSession)
# Set on a forwarded request: a conductor that is not the leader either
# answers 503 instead of forwarding again (no loops between standbys).
FORWARDED_BY = "X-Mooncaked-Forwarded-By"
# Request headers a standby passes on, and answer headers it relays.
_REQUEST_HEADERS = ("Content-Type", "Accept", "Authorization", "User-Agent")
_ANSWER_HEADERS = ("Content-Type", "Cache-Control", "Retry-After")


class LeaderDuties:
    """What the leader does with etcd's node records each election round."""

    def __init__(self, store: EtcdStore, registry: NodeRegistry) -> None:
        self.store = store
        self.registry = registry

    async def __call__(self, elected: bool) -> None:
        records = {}
        for _key, raw in await self.store.get_prefix(self.store.keys.nodes):
            node = decode_node(raw)
            if node is not None:
                records[node.node_id] = node
        now = time.monotonic()
        if elected:
            # A new leader knows every live node at once; their heartbeats follow.
            for node in records.values():
                known = self.registry.get(node.node_id)
                if known is None or not known.alive:
                    self.registry.register(node, now)
            log.info("leading with %d nodes from etcd: %s", len(records), sorted(records))
        for record in self.registry.alive():
            if record.node_id not in records:
                self.registry.declare_dead(record.node_id)
                log.warning("node %s (%s): its etcd lease expired: marked dead",
                            record.node_id, record.role)


def _retry_after(election: LeaderElection) -> dict[str, str]:
    return {"Retry-After": str(max(1, election.ttl_s))}


@web.middleware
async def leader_gate(request: web.Request, handler):
    if not request.path.startswith("/v1/"):
        return await handler(request)
    election = request.app[ELECTION]
    # Refused once etcd has been out of reach for a lease TTL (before that who
    # leads cannot have changed) and stayed so for another TTL while this
    # request waited: an etcd blip (a member lost) delays requests, refuses none.
    if not election.current and not await election.wait_current(election.ttl_s):
        raise ApiError(503, "the cluster's metadata store (etcd) is unreachable: this conductor "
                            "takes no new requests until it is back; retry later",
                       code="etcd_unreachable", headers=_retry_after(election))
    if election.is_leader:
        return await handler(request)
    leader = election.leader
    if leader is None or leader == election.me or request.headers.get(FORWARDED_BY):
        raise ApiError(503, "no conductor leads the cluster right now (a failover is under way); "
                            "retry shortly", code="no_leader", headers=_retry_after(election))
    return await forward(request, leader, election)


async def forward(request: web.Request, leader: ConductorRecord,
                  election: LeaderElection) -> web.StreamResponse:
    """Relay one request to the leader and its answer back, as it comes."""
    session = request.app[FORWARD_SESSION]
    body = await request.read()
    headers = {h: request.headers[h] for h in _REQUEST_HEADERS if h in request.headers}
    headers[FORWARDED_BY] = election.me.conductor_id
    url = leader.url.rstrip("/") + request.rel_url.path_qs
    gone = ("the leading conductor %s at %s failed during this request; it was not completed "
            "(a failover is under way): retry")
    try:
        upstream = await session.request(request.method, url, data=body or None, headers=headers)
    except (aiohttp.ClientError, OSError) as exc:
        log.warning("forwarding to leader %s failed: %s", leader.url, exc)
        raise ApiError(503, f"the leading conductor {leader.conductor_id} at {leader.url} is "
                            "unreachable (a failover is under way); retry shortly",
                       code="leader_unreachable", headers=_retry_after(election)) from None
    async with upstream:
        relayed = {h: upstream.headers[h] for h in _ANSWER_HEADERS if h in upstream.headers}
        relayed.update({h: v for h, v in upstream.headers.items()
                        if h.lower().startswith("x-mooncaked-")})
        relayed["X-Mooncaked-Served-By"] = leader.conductor_id
        if not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
            try:
                payload = await upstream.read()
            except (aiohttp.ClientError, OSError):
                raise ApiError(503, gone % (leader.conductor_id, leader.url), code="leader_failed",
                               headers=_retry_after(election)) from None
            return web.Response(body=payload, status=upstream.status, headers=relayed)
        resp = web.StreamResponse(status=upstream.status, headers=relayed)
        await resp.prepare(request)
        try:
            async for piece in upstream.content.iter_any():
                await resp.write(piece)
        except (aiohttp.ClientError, OSError) as exc:
            if isinstance(exc, ConnectionResetError) and request.transport is None:
                raise  # our own client went away: nothing to tell it
            log.warning("leader %s failed mid-stream: %s", leader.url, exc)
            message = gone % (leader.conductor_id, leader.url)
            error = error_body(503, message, code="leader_failed")["error"]
            try:
                await resp.write(b"data: " + orjson.dumps({"error": error}) + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
            except ConnectionError:
                pass
        return resp


def setup_failover(app: web.Application, ctx: NodeContext, registry: NodeRegistry) -> None:
    """Leader election and the /v1/ gate for a conductor with ``[etcd]`` endpoints."""
    etcd = ctx.config.etcd
    try:
        store = EtcdStore(etcd)
    except EtcdUnavailable as exc:
        raise StartupError(str(exc)) from None
    me = ConductorRecord(conductor_id=ctx.node_id, url=ctx.url, incarnation=new_incarnation())
    election = LeaderElection(store, me, etcd.lease_ttl_s, LeaderDuties(store, registry))
    app[ELECTION] = election
    app.middlewares.append(leader_gate)

    async def election_ctx(app: web.Application):
        # Forwarded streams last as long as their generation: no total timeout.
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=max(1.0, etcd.request_timeout_s)))
        app[FORWARD_SESSION] = session
        # etcd may be down at start-up: the conductor starts anyway and
        # refuses /v1/ requests until the election has reached etcd.
        election.start()
        log.info("conductor %s campaigning in etcd %s (lease %ds)", me.conductor_id,
                 ",".join(etcd.endpoints), etcd.lease_ttl_s)
        yield
        await election.close()
        await session.close()

    app.cleanup_ctx.append(election_ctx)
    ctx.status_providers["election"] = election.status
