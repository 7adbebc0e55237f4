"""A colocated node's decode tokens on its prefill's own answer
(``PrefillRequest.stream_decode``), through the conductor's Dispatcher.

A real ``Dispatcher`` over a real ``ClusterView`` talks over HTTP to one
stand-in node that prefills and decodes (it announces
``reserves_with_prefill``): its prefill route answers the reply as the first
NDJSON line, then the scripted token lines (or ends after the reply, as a
node that did not start the decode itself); its generate route streams its
own script.  Expected events are written out by hand.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from mooncaked.node.internal_client import InternalClient
from mooncaked.node.membership import NodeRegistry
from mooncaked.node.messages import (DecodeStart, MessageError, NodeCapacity, NodeRegistration,
                                     PrefillReply, PrefillRequest, PrefillTimings, Route,
                                     StreamError, TokenLine)
from mooncaked.node.sections import ConductorSection
from roles.conductor.cluster import ClusterView
from roles.conductor.dispatch import Dispatcher
from roles.conductor.metrics import ConductorMetrics
from roles.conductor.openai_types import Scheduled, Token
from tests.test_inproc_dispatch import (BLOCK, EOS, PAGES, PROMPT, SEED, _body,
                                        _recording_cancel, run, sampling, tokens_of)

NDJSON = {"Content-Type": "application/x-ndjson"}
GENERATED = [TokenLine(token=8, logprob=-0.8).to_wire(),
             TokenLine(token=9, logprob=-0.9, finish_reason="length").to_wire()]


@dataclass
class FakeColocated:
    """Prefill answers ``reply``; with stream_decode, as the first line of a
    stream that goes on with ``streamed`` (None: ends after the reply).
    Generate streams ``generated``."""
    reply: PrefillReply = field(default_factory=lambda: PrefillReply(
        first_token=17, logprob=-0.5, computed_tokens=40,
        timings=PrefillTimings(queue_s=0.001, compute_s=0.004)))
    streamed: list | None = field(default_factory=lambda: [
        TokenLine(token=23, logprob=-1.0).to_wire(),
        TokenLine(token=5, logprob=-1.5).to_wire(),
        TokenLine(token=42, logprob=-2.0, finish_reason="length").to_wire()])
    generated: list = field(default_factory=lambda: list(GENERATED))
    prefills: list[PrefillRequest] = field(default_factory=list)
    generates: list[DecodeStart] = field(default_factory=list)
    prefill_cancels: list[str] = field(default_factory=list)
    decode_cancels: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        async def prefill(request: web.Request) -> web.StreamResponse:
            spec = PrefillRequest.from_wire(await _body(request), block_size=BLOCK)
            self.prefills.append(spec)
            if not spec.stream_decode:
                return web.json_response(self.reply.to_wire())
            resp = web.StreamResponse(headers=NDJSON)
            await resp.prepare(request)
            await resp.write(orjson.dumps(self.reply.to_wire()) + b"\n")
            for line in self.streamed or []:
                await resp.write(orjson.dumps(line) + b"\n")
            await resp.write_eof()
            return resp

        async def generate(request: web.Request) -> web.StreamResponse:
            self.generates.append(DecodeStart.from_wire(await _body(request)))
            resp = web.StreamResponse(headers=NDJSON)
            await resp.prepare(request)
            for line in self.generated:
                await resp.write(orjson.dumps(line) + b"\n")
            await resp.write_eof()
            return resp

        app = web.Application()
        app.router.add_post(Route.PREFILL, prefill)
        app.router.add_post(Route.PREFILL_CANCEL, _recording_cancel(self.prefill_cancels))
        app.router.add_post(Route.DECODE_GENERATE, generate)
        app.router.add_post(Route.DECODE_CANCEL, _recording_cancel(self.decode_cancels))
        return app


@pytest.fixture
async def colocated_for():
    """``await colocated_for(node)``: a dispatcher whose only node is ``node``,
    registered as a colocated node that reserves with its prefill."""
    servers: list[TestServer] = []
    clients: list[InternalClient] = []

    async def make(node: FakeColocated) -> tuple[Dispatcher, ClusterView]:
        server = TestServer(node.app(), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        registry = NodeRegistry(timeout_s=60.0)
        cluster = ClusterView(registry, ConductorSection())
        client = InternalClient.open(connections=0)
        clients.append(client)
        dispatcher = Dispatcher(cluster, client, ConductorMetrics(CollectorRegistry()), SEED,
                                [EOS])
        capacity = NodeCapacity(pages=PAGES, block_size=BLOCK, kv_bytes_per_token=1024,
                                reserves_with_prefill=True)
        registry.register(NodeRegistration(node_id="colocated-0", role="colocated",
                                           url=str(server.make_url("")).rstrip("/"),
                                           capacity=capacity), time.monotonic())
        return dispatcher, cluster

    yield make
    for client in clients:
        await client.close()
    for server in servers:
        await server.close()


def assert_nothing_booked(cluster: ClusterView) -> None:
    sched = cluster.scheduler
    assert sched.inflight == {}
    assert sched.prefill["colocated-0"].pending == {}
    d = sched.decode["colocated-0"]
    assert (d.free_pages, d.batch_size, d.context_tokens, d.reserved) == (PAGES, 0, 0, {})


async def test_the_tokens_come_on_the_prefills_own_answer(colocated_for):
    node = FakeColocated()
    dispatcher, cluster = await colocated_for(node)
    events: list = []
    assert await run(dispatcher.generate("req-s", PROMPT, sampling()), events) is None
    assert [type(e) for e in events] == [Scheduled, Token, Token, Token, Token]
    assert tokens_of(events) == [(17, -0.5, 0, None), (23, -1.0, 0, None), (5, -1.5, 0, None),
                                 (42, -2.0, 0, "length")]
    (spec,) = node.prefills
    assert spec.stream_decode and spec.decode is None
    assert spec.reserve_here == len(PROMPT) + 4
    assert node.generates == []   # no DecodeStart: the answer carried the tokens
    trace = dispatcher.traces["req-s"]
    assert trace.status == "ok" and trace.output_token_ids == [17, 23, 5, 42]
    assert len(trace.token_times) == 4
    assert_nothing_booked(cluster)


async def test_an_answer_that_ends_after_the_reply_falls_back_to_decode_start(colocated_for):
    """The node did not start the decode itself: the conductor's DecodeStart
    (with the first token) starts it, and its stream carries the tokens."""
    node = FakeColocated(streamed=None)
    dispatcher, cluster = await colocated_for(node)
    events: list = []
    assert await run(dispatcher.generate("req-b", PROMPT, sampling()), events) is None
    assert tokens_of(events) == [(17, -0.5, 0, None), (8, -0.8, 0, None), (9, -0.9, 0, "length")]
    (start,) = node.generates
    assert (start.request_id, start.prompt_len, start.first_token) == ("req-b", len(PROMPT), 17)
    assert dispatcher.traces["req-b"].status == "ok"
    assert_nothing_booked(cluster)


@pytest.mark.parametrize("streamed, message", [
    ([TokenLine(token=23, logprob=-1.0).to_wire()], "ended before the request finished"),
    ([StreamError(error="cancelled").to_wire()], "decode node ended the stream: cancelled"),
])
async def test_an_answer_cut_after_its_reply_is_502_and_cancels(colocated_for, streamed,
                                                                message):
    """Tokens that stop without a finish, or the node's StreamError: the
    client gets 502 (no DecodeStart: the node had started the decode), and
    the reservation is cancelled on the way out."""
    node = FakeColocated(streamed=streamed)
    dispatcher, cluster = await colocated_for(node)
    events: list = []
    error = await run(dispatcher.generate("req-x", PROMPT, sampling()), events)
    assert error is not None and error.status == 502 and message in error.message
    assert node.generates == []
    assert node.decode_cancels == ["req-x"]
    assert_nothing_booked(cluster)


async def test_a_first_token_that_finishes_closes_the_answer_unread(colocated_for):
    node = FakeColocated(reply=PrefillReply(first_token=EOS, logprob=-0.1))
    dispatcher, cluster = await colocated_for(node)
    events: list = []
    assert await run(dispatcher.generate("req-e", PROMPT, sampling()), events) is None
    assert tokens_of(events) == [(EOS, -0.1, 0, "stop")]
    assert node.generates == []
    assert node.decode_cancels == ["req-e"]   # the reservation is released
    assert_nothing_booked(cluster)


def test_stream_decode_needs_a_reservation_made_here():
    """Only a prefill that reserves its decode pages itself can stream them."""
    wire = {"request_id": "r", "token_ids": [1, 2, 3], "block_keys": [],
            "decode": {"pages": [1], "segment": "s", "region": 0}, "stream_decode": True}
    with pytest.raises(MessageError, match="stream_decode"):
        PrefillRequest.from_wire(wire)
    wire = {"request_id": "r", "token_ids": [1, 2, 3], "block_keys": [], "reserve_here": 8,
            "stream_decode": True}
    assert PrefillRequest.from_wire(wire).stream_decode
    # Left out of the wire when off, as every field added later.
    assert "stream_decode" not in PrefillRequest.from_wire({**wire, "stream_decode": False}
                                                           ).to_wire()

