"""The conductor's Dispatcher (roles/conductor/dispatch.py) in one process.

A real ``Dispatcher`` over a real ``ClusterView`` / ``Scheduler`` /
``NodeRegistry`` (built as ``setup_conductor`` builds them) talks over HTTP to
stand-in prefill and decode nodes: small aiohttp apps serving the internal
routes with the real message classes, answering from a script and recording
every body they get.  Expected values are written out by hand: the events a
request yields, the bodies each node receives (block keys recomputed here
straight from xxh3), the capacity the Scheduler books (pages for prompt +
max_tokens) and gets back on every path out.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import json
import re
import time
from dataclasses import dataclass, field

import orjson
import pytest
import xxhash
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from model.sampling import SamplingParams
from mooncaked.node.errors import ApiError, error_response
from mooncaked.node.internal_client import InternalClient
from mooncaked.node.membership import NodeRegistry
from mooncaked.node.messages import (Cancelled, DecodeStart, MessageError, NodeCapacity,
                                     NodeRegistration, Ok, PrefillReply, PrefillRequest,
                                     PrefillTimings, RequestRef, ReservationGrant,
                                     ReservationRequest, Route, StreamError, TokenLine)
from mooncaked.node.sections import ConductorSection
from roles.conductor.cluster import ClusterView
from roles.conductor.dispatch import PREFILL_REPLY_ALLOWANCE_S, Dispatcher
from roles.conductor.metrics import ConductorMetrics
from roles.conductor.openai_types import Scheduled, Token
from roles.scheduling.state import ScheduleRequest

BLOCK = 16
PAGES = 64          # each node's announced page budget
SEED = 12345        # the conductor's store.hash_seed
EOS = 2
PROMPT = list(range(100, 140))   # 40 tokens: two full blocks and 8 tokens over
GRANT = ReservationGrant(pages=[40, 3, 41, 7], segment="decode-seg", region=2)


def sampling(max_tokens: int = 4, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.7, "top_k": 5, "seed": 11, "max_tokens": max_tokens,
                             "stop_token_ids": [999], "logprobs": True, **kw})


def chain_keys(tokens: list[int], seed: int) -> list[int]:
    """The documented block-key chain, written out: xxh3(le_u64(parent) || le_u32 tokens)."""
    keys, parent = [], 0
    for i in range(len(tokens) // BLOCK):
        data = parent.to_bytes(8, "little") + b"".join(
            t.to_bytes(4, "little") for t in tokens[i * BLOCK:(i + 1) * BLOCK])
        parent = xxhash.xxh3_64_intdigest(data, seed=seed)
        keys.append(parent)
    return keys


# ---- stand-in nodes ------------------------------------------------------------

async def _body(request: web.Request) -> dict:
    return await request.json()


def _recording_cancel(cancels: list[str]):
    """A cancel route that records the request ids it gets."""
    async def cancel(request: web.Request) -> web.Response:
        cancels.append(RequestRef.from_wire(await _body(request)).request_id)
        return web.json_response(Cancelled(cancelled=True).to_wire())
    return cancel


@dataclass
class FakePrefill:
    """/internal/prefill answers ``reply`` (or ``status``), optionally after
    ``hold`` is set; every body is recorded."""
    reply: PrefillReply = field(default_factory=lambda: PrefillReply(
        first_token=17, logprob=-0.5, local_hit_tokens=16, computed_tokens=24,
        timings=PrefillTimings(queue_s=0.001, compute_s=0.004)))
    status: int = 200
    hold: asyncio.Event | None = None
    received: list[PrefillRequest] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    gone: asyncio.Event = field(default_factory=asyncio.Event)   # the caller hung up

    def app(self) -> web.Application:
        async def prefill(request: web.Request) -> web.StreamResponse:
            self.received.append(PrefillRequest.from_wire(await _body(request), block_size=BLOCK))
            self.started.set()
            try:
                if self.hold is not None:
                    await self.hold.wait()
            except asyncio.CancelledError:
                self.gone.set()
                raise
            if self.status != 200:
                return error_response(self.status, "prefill failed on purpose")
            return web.json_response(self.reply.to_wire())

        app = web.Application()
        app.router.add_post(Route.PREFILL, prefill)
        app.router.add_post(Route.PREFILL_CANCEL, _recording_cancel(self.cancels))
        return app


@dataclass
class FakeDecode:
    """reserve -> ``GRANT``; generate streams ``lines`` (NDJSON dicts, or the
    byte string of a raw line) then, with ``hang``, waits for the caller to go
    away; ``generate_status`` answers generate with an error instead."""
    lines: list = field(default_factory=lambda: [
        TokenLine(token=23, logprob=-1.0).to_wire(), TokenLine(token=5, logprob=-1.5).to_wire(),
        TokenLine(token=42, logprob=-2.0, finish_reason="length").to_wire()])
    reserve_status: int = 200
    generate_status: int = 200
    hang: bool = False
    reserves: list[ReservationRequest] = field(default_factory=list)
    generates: list[DecodeStart] = field(default_factory=list)
    touches: list[str] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    generate_started: asyncio.Event = field(default_factory=asyncio.Event)
    stream_closed: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        async def reserve(request: web.Request) -> web.Response:
            self.reserves.append(ReservationRequest.from_wire(await _body(request)))
            if self.reserve_status != 200:
                return error_response(self.reserve_status, "decode node out of KV pages")
            return web.json_response(GRANT.to_wire())

        async def generate(request: web.Request) -> web.StreamResponse:
            self.generates.append(DecodeStart.from_wire(await _body(request)))
            self.generate_started.set()
            if self.generate_status != 200:
                return error_response(self.generate_status, "no reservation")
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            try:
                for line in self.lines:
                    await resp.write(line if isinstance(line, bytes) else orjson.dumps(line) + b"\n")
                if self.hang:
                    await asyncio.Event().wait()
                await resp.write_eof()
            finally:
                self.stream_closed.set()
            return resp

        async def touch(request: web.Request) -> web.Response:
            self.touches.append(RequestRef.from_wire(await _body(request)).request_id)
            return web.json_response(Ok().to_wire())

        app = web.Application()
        app.router.add_post(Route.DECODE_RESERVE, reserve)
        app.router.add_post(Route.DECODE_GENERATE, generate)
        app.router.add_post(Route.DECODE_TOUCH, touch)
        app.router.add_post(Route.DECODE_CANCEL, _recording_cancel(self.cancels))
        return app


@dataclass
class Conductor:
    dispatcher: Dispatcher
    cluster: ClusterView
    prefill: FakePrefill
    decode: FakeDecode
    prom: CollectorRegistry

    @property
    def sched(self):
        return self.cluster.scheduler

    def running_gauge(self) -> float:
        return self.prom.get_sample_value("mooncaked:num_requests_running")

    def assert_capacity_returned(self) -> None:
        """Nothing booked: no request in flight, every decode page back, no queued prefill."""
        sched = self.sched
        assert sched.inflight == {}
        assert sched.prefill["prefill-0"].pending == {}
        assert sched.prefill["prefill-0"].queue_time(time.monotonic()) == 0.0
        d = sched.decode["decode-0"]
        assert (d.free_pages, d.batch_size, d.context_tokens, d.reserved) == (PAGES, 0, 0, {})
        assert self.running_gauge() == 0.0


@pytest.fixture
async def conductor_for():
    """``await conductor_for(prefill, decode, **ConductorSection fields)``: a
    conductor's dispatch path over the two stand-in nodes (``prefill_url``
    overrides where the prefill node is said to listen)."""
    servers: list[TestServer] = []
    clients: list[InternalClient] = []

    async def serve(app: web.Application) -> str:
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    async def make(prefill: FakePrefill | None = None, decode: FakeDecode | None = None, *,
                   prefill_url: str | None = None, keepalive_s: float = 20.0,
                   **section) -> Conductor:
        prefill = prefill or FakePrefill()
        decode = decode or FakeDecode()
        registry = NodeRegistry(timeout_s=60.0)
        cluster = ClusterView(registry, ConductorSection(**section))
        prom = CollectorRegistry()
        client = InternalClient.open(connections=0)
        clients.append(client)
        dispatcher = Dispatcher(cluster, client, ConductorMetrics(prom), SEED, [EOS],
                                reservation_keepalive_s=keepalive_s)
        capacity = NodeCapacity(pages=PAGES, block_size=BLOCK, kv_bytes_per_token=1024)
        now = time.monotonic()
        registry.register(NodeRegistration(node_id="prefill-0", role="prefill",
                                           url=prefill_url or await serve(prefill.app()),
                                           capacity=capacity), now)
        registry.register(NodeRegistration(node_id="decode-0", role="decode",
                                           url=await serve(decode.app()), capacity=capacity), now)
        return Conductor(dispatcher, cluster, prefill, decode, prom)

    yield make
    for client in clients:
        await client.close()
    for server in servers:
        await server.close()


async def run(gen, events: list) -> ApiError | None:
    """Drain ``gen`` into ``events``; the ApiError it ends with, if any."""
    try:
        async for event in gen:
            events.append(event)
    except ApiError as exc:
        return exc
    return None


def tokens_of(events: list) -> list[tuple]:
    return [(e.token_id, e.logprob, e.cached_tokens, e.finish_reason) for e in events
            if isinstance(e, Token)]


# ---- the whole request ---------------------------------------------------------

async def test_events_in_order_and_every_node_gets_the_right_body(conductor_for):
    c = await conductor_for()
    params = sampling(max_tokens=4)
    gen = c.dispatcher.generate("req-1", PROMPT, params)
    scheduled = await gen.__anext__()
    assert isinstance(scheduled, Scheduled)
    assert {k: scheduled.trace[k] for k in ("request_id", "prefill_node", "decode_node", "policy",
                                            "prefix_tokens_planned", "transfer")} == {
        "request_id": "req-1", "prefill_node": "prefill-0", "decode_node": "decode-0",
        "policy": "mooncake", "prefix_tokens_planned": 0, "transfer": None}
    # Booked while it runs: ceil((40 + 4) / 16) = 3 pages, one sequence of 44 tokens,
    # and the prefill estimate c0 + n*40 + n2*40^2 of the default coefficients.
    d = c.sched.decode["decode-0"]
    assert (d.free_pages, d.batch_size, d.context_tokens) == (PAGES - 3, 1, 44)
    # (At its booking time: it is expected to start at once and the queue
    # counts down from then.)
    booked = c.sched.prefill["prefill-0"].pending["req-1"]
    assert c.sched.prefill["prefill-0"].queue_time(booked.sent_at) == pytest.approx(
        0.01 + 2.5e-4 * 40 + 1.7e-8 * 40 * 40)
    assert c.running_gauge() == 1.0
    tbt_model = c.sched.inflight["req-1"].tbt_model_s
    events = [scheduled]
    assert await run(gen, events) is None

    # First token from the prefill node, the rest from the decode stream, in order;
    # every token carries the prefill's cached tokens (16 local).
    assert tokens_of(events) == [(17, -0.5, 16, None), (23, -1.0, 16, None), (5, -1.5, 16, None),
                                 (42, -2.0, 16, "length")]
    assert c.decode.reserves == [ReservationRequest(request_id="req-1", total_tokens=44)]
    (spec,) = c.prefill.received
    assert spec.request_id == "req-1" and spec.token_ids == PROMPT
    assert spec.block_keys == chain_keys(PROMPT, SEED) and len(spec.block_keys) == 2
    assert spec.decode == GRANT                       # the KV goes into the granted pages
    assert spec.sampling == params and spec.fetch is None and spec.cpp is None
    assert c.decode.generates == [DecodeStart(request_id="req-1", prompt_len=40, first_token=17,
                                              sampling=params)]
    # Finished normally: nothing to cancel anywhere; the reservation was still fresh.
    assert (c.prefill.cancels, c.decode.cancels, c.decode.touches) == ([], [], [])
    c.assert_capacity_returned()
    trace = c.dispatcher.traces["req-1"]
    assert (trace.status, trace.cached_tokens, trace.local_hit_tokens, trace.completion_tokens,
            trace.output_token_ids) == ("ok", 16, 16, 4, [17, 23, 5, 42])
    assert trace.prefill_compute_s == 0.004 and trace.prefill_queue_s == 0.001
    # The decode node learned from the stream's token intervals: the first
    # (the hand-off from prefill) as seconds beyond the model's step, the
    # mean of the others as a log-ratio over it.
    times = trace.token_times
    first = times[1] - times[0]
    assert trace.handoff_s == first and trace.summary()["handoff_s"] == round(first, 6)
    steps_mean = (times[-1] - times[1]) / (len(times) - 2)
    stats = c.sched.residual_stats(times[-1])
    assert stats["tbt_log_ratio"]["decode-0"].samples == 1 and tbt_model > 0
    assert stats["handoff_s"]["decode-0"].median == pytest.approx(first - tbt_model)
    if steps_mean > 0:
        assert stats["tbt_log_ratio"]["decode-0"].median == pytest.approx(
            math.log(steps_mean / tbt_model))
    # ... and /admin/status shows the residual model's windows by key.
    status = c.cluster.status()["residuals"]
    assert status["tbt_log_ratio"]["decode-0"]["samples"] == 1
    assert status["handoff_s"]["decode-0"]["samples"] == 1
    # Its TTFT was priced by the prefill prior (no fit yet): it teaches nothing.
    assert status["ttft_s"] == {} and c.sched.ttft_residuals.prior_skipped == 1


async def test_decode_reservation_is_touched_only_while_the_prefill_runs(conductor_for):
    hold = asyncio.Event()
    c = await conductor_for(FakePrefill(hold=hold), keepalive_s=0.02)
    task = asyncio.ensure_future(run(c.dispatcher.generate("req-t", PROMPT, sampling()), []))
    await asyncio.wait_for(c.prefill.started.wait(), 5)
    for _ in range(250):                         # 3 keepalive periods or more
        if len(c.decode.touches) >= 3:
            break
        await asyncio.sleep(0.02)
    hold.set()
    assert await asyncio.wait_for(task, 5) is None
    touched = list(c.decode.touches)
    assert len(touched) >= 3 and set(touched) == {"req-t"}
    await asyncio.sleep(0.1)
    assert c.decode.touches == touched           # the keepalive stopped with the prefill
    c.assert_capacity_returned()


async def test_ttft_counts_from_the_requests_arrival_and_the_scheduler_learns_it(conductor_for):
    """A request that arrived 0.3 s before generate() (its body read and
    tokenized meanwhile): its TTFT, token times and the error the scheduler
    records count those 0.3 s, as its client's clock does, and so does its
    prediction: the time already waited is known when it is scheduled.
    (These stand-in nodes answer at once, so everything else is
    milliseconds.)"""
    c = await conductor_for()
    arrival = time.monotonic() - 0.3
    assert await run(c.dispatcher.generate("req-a", PROMPT, sampling(max_tokens=2),
                                           arrival_s=arrival), []) is None
    trace = c.dispatcher.traces["req-a"]
    assert trace.ttft_s >= 0.3 and trace.token_times[0] == trace.ttft_s
    assert trace.schedule_s < 0.3                       # the decision's own time only
    assert trace.predicted_ttft_s >= 0.3
    assert trace.predicted_model_ttft_s >= 0.3          # what the residual is taken against
    # The error the scheduler records: both sides from the arrival.
    assert c.sched.ttft_errors[-1] == pytest.approx(trace.predicted_ttft_s - trace.ttft_s)
    # Without an arrival time it counts from the call.
    assert await run(c.dispatcher.generate("req-b", PROMPT, sampling(max_tokens=2)), []) is None
    assert c.dispatcher.traces["req-b"].ttft_s < 0.3


async def test_the_prefill_node_is_sent_the_prediction_it_must_keep(conductor_for):
    """PrefillRequest.budget: the compute the scheduler predicted, and what
    is left of the predicted TTFT when the request goes out, less the
    reply's way back (never below 0)."""
    c = await conductor_for()
    assert await run(c.dispatcher.generate("req-a", PROMPT, sampling(max_tokens=2)), []) is None
    trace = c.dispatcher.traces["req-a"]
    (spec,) = c.prefill.received
    assert spec.budget.prefill_s == pytest.approx(trace.predicted_prefill_s)
    # Sent after the decision and the reservation: less than the whole prediction.
    assert 0.0 <= spec.budget.reply_within_s \
        <= trace.predicted_ttft_s - PREFILL_REPLY_ALLOWANCE_S
    # A request that arrived 0.3 s before: its prediction counts those
    # 0.3 s, the time left for the node does not.
    assert await run(c.dispatcher.generate("req-b", PROMPT, sampling(max_tokens=2),
                                           arrival_s=time.monotonic() - 0.3), []) is None
    trace_b = c.dispatcher.traces["req-b"]
    assert trace_b.predicted_ttft_s >= 0.3
    assert 0.0 <= c.prefill.received[-1].budget.reply_within_s \
        <= trace_b.predicted_ttft_s - 0.3 - PREFILL_REPLY_ALLOWANCE_S


async def test_the_trace_records_what_the_residual_model_read(conductor_for):
    """The cost model's TTFT before the residual, the load level, the
    prior flag and the decision's time are in the trace: with ttft_s they
    let the residual model be replayed offline.  Before any sample the
    residual is 0, so the model's TTFT is the prediction; a second request
    scheduled while the first is still in flight reads level 1."""
    c = await conductor_for()
    t0 = time.monotonic()
    assert await run(c.dispatcher.generate("req-a", PROMPT, sampling(max_tokens=2)), []) is None
    trace = c.dispatcher.traces["req-a"]
    assert trace.predicted_model_ttft_s > 0
    assert trace.predicted_model_ttft_s == pytest.approx(trace.predicted_ttft_s)
    assert trace.load_level == 0
    assert t0 <= trace.scheduled_at_s <= time.monotonic()
    assert trace.priced_by_prior is True   # the built-in prior, refitted by nothing yet
    summary = trace.summary()
    assert {"predicted_model_ttft_s", "load_level", "priced_by_prior",
            "scheduled_at_s"} <= set(summary)
    # Held in flight (its decode not yet finished): the next one reads level 1.
    held = c.sched.schedule(ScheduleRequest("held", (1,), 16, 16, 2), time.monotonic())
    assert held.request_id == "held"
    assert await run(c.dispatcher.generate("req-b", PROMPT, sampling(max_tokens=2)), []) is None
    assert c.dispatcher.traces["req-b"].load_level == 1


def test_the_openai_backend_hands_the_requests_arrival_to_the_dispatcher():
    from roles.conductor.app import ClusterBackend
    from roles.conductor.openai_types import GenerationRequest

    class Recording:
        def __init__(self):
            self.calls = []

        def generate(self, *args, **kwargs):
            self.calls.append((args, kwargs))

    def request(arrival_s: float) -> GenerationRequest:
        return GenerationRequest("r-0", "completion", "m", PROMPT, sampling(), 4, True, False,
                                 [], None, False, 0, arrival_s=arrival_s)

    dispatcher = Recording()
    backend = ClusterBackend(dispatcher, None, "m", 128)
    backend.generate(request(123.5))
    backend.generate(request(0.0))  # not stamped: counted from the call
    assert [kw["arrival_s"] for _, kw in dispatcher.calls] == [123.5, None]


@pytest.mark.parametrize("first, max_tokens, finish", [(17, 1, "length"), (EOS, 4, "stop"),
                                                       (999, 4, "stop")])
async def test_a_first_token_that_finishes_needs_no_decode_stream(conductor_for, first,
                                                                  max_tokens, finish):
    """max_tokens=1, the model's EOS, or a stop token id as the prefill's answer."""
    c = await conductor_for(FakePrefill(reply=PrefillReply(first_token=first, logprob=-0.1)))
    events: list = []
    assert await run(c.dispatcher.generate("req-f", PROMPT, sampling(max_tokens=max_tokens)),
                     events) is None
    assert [type(e) for e in events] == [Scheduled, Token]
    assert tokens_of(events) == [(first, -0.1, 0, finish)]
    assert c.decode.generates == [] and c.prefill.cancels == []
    assert c.dispatcher.traces["req-f"].status == "ok"
    c.assert_capacity_returned()
    # (The decode node's reservation: see the next test.)


async def test_a_first_token_that_finishes_releases_the_decode_reservation(conductor_for):
    c = await conductor_for()
    assert await run(c.dispatcher.generate("req-1tok", PROMPT, sampling(max_tokens=1)), []) is None
    assert c.decode.generates == []
    assert c.decode.cancels == ["req-1tok"]


# ---- failures --------------------------------------------------------------------

DECODE_FAILURES = {
    # case: (the stand-in decode node's script, the tokens it streams before failing)
    # the decode node ends the stream with an error line after one token
    "stream error": (dict(lines=[TokenLine(token=23).to_wire(),
                                 StreamError(error="cancelled").to_wire()]), [23]),
    # the stream ends without a finish reason
    "truncated": (dict(lines=[TokenLine(token=23).to_wire(), TokenLine(token=5).to_wire()]),
                  [23, 5]),
    # a line that does not decode as a TokenLine
    "malformed line": (dict(lines=[TokenLine(token=23).to_wire(), b'{"token": -4}\n']), [23]),
    # generate refused (the reservation expired)
    "generate 404": (dict(generate_status=404, lines=[]), []),
}


@pytest.mark.parametrize("case", list(DECODE_FAILURES))
async def test_a_failed_decode_stream_is_502_and_cancels_the_reservation(conductor_for, case):
    script, streamed = DECODE_FAILURES[case]
    c = await conductor_for(decode=FakeDecode(**script))
    events: list = []
    error = await run(c.dispatcher.generate("req-d", PROMPT, sampling()), events)
    assert error is not None and error.status == 502
    assert tokens_of(events) == [(17, -0.5, 16, None)] + [(t, None, 16, None) for t in streamed]
    assert c.decode.cancels == ["req-d"]
    assert c.prefill.cancels == []          # its part was done
    assert c.dispatcher.traces["req-d"].status == "error 502"
    c.assert_capacity_returned()


@pytest.mark.parametrize("node_status, client_status", [(500, 502), (409, 502), (503, 503),
                                                        (429, 503)])
async def test_a_prefill_error_reaches_the_client_and_cancels_the_reservation(
        conductor_for, node_status, client_status):
    c = await conductor_for(FakePrefill(status=node_status))
    events: list = []
    error = await run(c.dispatcher.generate("req-p", PROMPT, sampling()), events)
    assert error is not None and error.status == client_status
    assert "prefill failed on purpose" in error.message
    assert [type(e) for e in events] == [Scheduled]
    assert c.decode.cancels == ["req-p"] and c.decode.generates == []
    assert c.dispatcher.traces["req-p"].status == f"error {client_status}"
    c.assert_capacity_returned()


async def test_an_unreachable_prefill_node_is_502_and_cancels_the_reservation(conductor_for):
    closed = TestServer(web.Application(), host="127.0.0.1")
    await closed.start_server()
    dead_url = str(closed.make_url("")).rstrip("/")
    await closed.close()
    c = await conductor_for(prefill_url=dead_url)
    error = await run(c.dispatcher.generate("req-u", PROMPT, sampling()), [])
    assert error is not None and error.status == 502
    assert c.decode.cancels == ["req-u"]
    c.assert_capacity_returned()


async def test_a_refused_reservation_reaches_the_client_before_any_event(conductor_for):
    c = await conductor_for(decode=FakeDecode(reserve_status=503))
    events: list = []
    error = await run(c.dispatcher.generate("req-r", PROMPT, sampling()), events)
    assert error is not None and error.status == 503
    assert events == [] and c.prefill.received == []
    assert (c.prefill.cancels, c.decode.cancels) == ([], [])   # nothing was held
    c.assert_capacity_returned()


# ---- the client goes away --------------------------------------------------------

async def test_the_prefill_is_out_before_the_scheduled_event_is_consumed(conductor_for):
    """The front end writes the client's response headers after Scheduled
    and only then asks for the next event: the prefill does not wait for
    that; closing at Scheduled cancels it on both nodes."""
    c = await conductor_for(FakePrefill(hold=asyncio.Event()))
    gen = c.dispatcher.generate("req-c0", PROMPT, sampling())
    assert isinstance(await gen.__anext__(), Scheduled)
    await asyncio.wait_for(c.prefill.started.wait(), 5)   # the next event not asked for
    assert [r.request_id for r in c.prefill.received] == ["req-c0"]
    await gen.aclose()
    assert (c.prefill.cancels, c.decode.cancels) == (["req-c0"], ["req-c0"])
    await asyncio.wait_for(c.prefill.gone.wait(), 5)      # the prefill connection was closed
    assert c.decode.generates == []
    assert c.dispatcher.traces["req-c0"].status == "cancelled"
    c.assert_capacity_returned()


async def test_a_client_gone_during_the_prefill_cancels_on_both_nodes(conductor_for):
    """The front end's handler task is cancelled while the prefill call is out."""
    c = await conductor_for(FakePrefill(hold=asyncio.Event()), keepalive_s=0.02)
    task = asyncio.ensure_future(run(c.dispatcher.generate("req-c1", PROMPT, sampling()), []))
    await asyncio.wait_for(c.prefill.started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (c.prefill.cancels, c.decode.cancels) == (["req-c1"], ["req-c1"])
    await asyncio.wait_for(c.prefill.gone.wait(), 5)   # the prefill connection was closed
    touched = len(c.decode.touches)
    await asyncio.sleep(0.08)
    assert len(c.decode.touches) == touched            # no keepalive left running
    assert c.decode.generates == []
    assert c.dispatcher.traces["req-c1"].status == "cancelled"
    c.assert_capacity_returned()


async def test_closing_during_the_decode_stream_cancels_the_decode_node(conductor_for):
    c = await conductor_for(decode=FakeDecode(lines=[TokenLine(token=23).to_wire()], hang=True))
    gen = c.dispatcher.generate("req-c2", PROMPT, sampling())
    events = [await gen.__anext__() for _ in range(3)]   # Scheduled, 17, 23
    assert tokens_of(events) == [(17, -0.5, 16, None), (23, None, 16, None)]
    await gen.aclose()
    assert c.decode.cancels == ["req-c2"]
    assert c.prefill.cancels == []                       # the prefill had finished
    await asyncio.wait_for(c.decode.stream_closed.wait(), 5)   # and the stream is hung up
    assert c.dispatcher.traces["req-c2"].status == "cancelled"
    # cut short: no TBT measured
    assert "decode-0" not in c.sched.residual_stats(time.monotonic())["tbt_log_ratio"]
    c.assert_capacity_returned()


async def test_the_decode_stream_is_requested_before_the_first_token_is_handed_on(
        conductor_for):
    """The decode node gets DecodeStart while the consumer still holds the
    first token (writing it to the client), not only once it asks for more."""
    c = await conductor_for()
    gen = c.dispatcher.generate("req-ahead", PROMPT, sampling())
    events = [await gen.__anext__() for _ in range(2)]   # Scheduled, 17
    assert tokens_of(events) == [(17, -0.5, 16, None)]
    await asyncio.wait_for(c.decode.generate_started.wait(), 5)
    assert [g.request_id for g in c.decode.generates] == ["req-ahead"]
    err = await run(gen, events)
    assert err is None
    assert tokens_of(events)[1:] == [(23, -1.0, 16, None), (5, -1.5, 16, None),
                                     (42, -2.0, 16, "length")]
    c.assert_capacity_returned()


async def test_closing_after_the_first_token_ends_the_stream_requested_ahead(conductor_for):
    c = await conductor_for(decode=FakeDecode(lines=[], hang=True))
    gen = c.dispatcher.generate("req-c3", PROMPT, sampling())
    events = [await gen.__anext__() for _ in range(2)]   # Scheduled, 17
    await asyncio.wait_for(c.decode.generate_started.wait(), 5)
    await gen.aclose()
    assert c.decode.cancels == ["req-c3"]
    await asyncio.wait_for(c.decode.stream_closed.wait(), 5)
    assert c.dispatcher.traces["req-c3"].status == "cancelled"
    c.assert_capacity_returned()


# ---- admission -------------------------------------------------------------------

async def test_a_predicted_ttft_miss_is_429_with_retry_after(conductor_for, tmp_path):
    """Every prefill is priced 5 s (a profile with only c0) against a 7 s SLO:
    the first request fits, the second would wait 5 s behind it (5 + 5 = 10 s,
    3 s over the SLO, the admit limit while no residual is learned: Retry-After
    3); once the first is done a third fits again."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"coeffs": {"c0": 5.0}}))
    c = await conductor_for(prefill_profile=str(profile), ttft_slo_s=7.0)
    first = c.dispatcher.generate("req-a", PROMPT, sampling())
    assert isinstance(await first.__anext__(), Scheduled)

    error = await run(c.dispatcher.generate("req-b", PROMPT, sampling()), [])
    assert error is not None and error.status == 429 and error.code == "ttft_slo"
    assert error.headers == {"Retry-After": "3"}
    # 10 s less what the first has run meanwhile (its booking counts down once
    # the node reports it running): 9.99 on a slow machine, never below 9.9 here.
    predicted = float(re.search(r"predicted TTFT ([0-9.]+)s", error.message).group(1))
    assert 9.9 < predicted <= 10.0, error.message
    # ... and the limit it exceeded: the SLO (no residuals learned yet).
    assert "over the admit limit 7s" in error.message, error.message
    assert [r.request_id for r in c.decode.reserves] == ["req-a"]   # no node saw req-b
    # The request log keeps it, with why it was refused.
    refused = c.dispatcher.traces["req-b"].summary()
    assert refused["status"] == "rejected ttft_slo"
    assert refused["predicted_ttft_s"] == pytest.approx(predicted, abs=0.01)
    assert refused["admit_limit_s"] == 7.0 and refused["ttft_s"] == 0.0
    assert set(c.sched.inflight) == {"req-a"} and c.sched.rejections == {"ttft_slo": 1}

    assert await run(first, []) is None
    c.assert_capacity_returned()
    assert await run(c.dispatcher.generate("req-c", PROMPT, sampling()), []) is None
    assert c.prom.get_sample_value("mooncaked_rejections_total", {"reason": "ttft_slo"}) == 1.0


async def test_a_predicted_tbt_miss_is_429(conductor_for):
    # The default decode model prices one sequence at >= 12 ms per token.
    c = await conductor_for(tbt_slo_ms=1.0)
    error = await run(c.dispatcher.generate("req-tbt", PROMPT, sampling()), [])
    assert error is not None and error.status == 429 and error.code == "tbt_slo"
    assert error.headers == {"Retry-After": "1"}
    assert "over the admit limit 1ms" in error.message, error.message     # the SLO
    refused = c.dispatcher.traces["req-tbt"]
    assert refused.status == "rejected tbt_slo" and refused.admit_limit_s == 0.001
    assert refused.predicted_tbt_s > 0.001
    assert c.decode.reserves == [] and c.prefill.received == []
    c.assert_capacity_returned()


async def test_no_nodes_yet_is_503():
    cluster = ClusterView(NodeRegistry(timeout_s=60.0), ConductorSection())
    client = InternalClient.open()
    try:
        dispatcher = Dispatcher(cluster, client, ConductorMetrics(CollectorRegistry()), SEED, [EOS])
        error = await run(dispatcher.generate("req-0", PROMPT, sampling()), [])
    finally:
        await client.close()
    assert error is not None and error.status == 503 and error.headers == {"Retry-After": "1"}


async def test_the_scheduled_trace_carries_the_planned_cached_tokens(conductor_for):
    """x-mooncaked-cached-tokens comes from this trace (openai_api.trace_headers);
    the real conductor never set it."""
    from mooncaked.node.messages import CacheSnapshot
    from roles.conductor.openai_api import trace_headers

    c = await conductor_for()
    keys = chain_keys(PROMPT, SEED)
    c.cluster.snapshot(CacheSnapshot(node_id="prefill-0", epoch=1, seq=0, keys=keys))
    events: list = []
    assert await run(c.dispatcher.generate("req-c", PROMPT, sampling()), events) is None
    scheduled = events[0]
    assert isinstance(scheduled, Scheduled)
    assert scheduled.trace["cached_tokens"] == 2 * BLOCK  # both full blocks are held

    class Run:
        trace = scheduled.trace
    assert trace_headers("id", [Run()])["x-mooncaked-cached-tokens"] == str(2 * BLOCK)


@pytest.mark.parametrize("epoch,seq,indexed", [(7, 3, True), (7, 2, False), (8, 3, False)])
async def test_the_blocks_a_prefill_stored_are_indexed_with_its_first_token(
        conductor_for, epoch, seq, indexed):
    """The prefill node answers without waiting to push its cache events; the
    reply's StoredBlocks go into the index before the first token is handed
    on, unless the batch that reports them was applied already (seq 2 here)
    or the shard restarted (another epoch)."""
    from mooncaked.node.messages import CacheSnapshot, StoredBlocks

    keys = chain_keys(PROMPT, SEED)
    reply = PrefillReply(first_token=17, logprob=-0.5, computed_tokens=len(PROMPT),
                         timings=PrefillTimings(queue_s=0.001, compute_s=0.004),
                         stored=StoredBlocks(epoch=epoch, seq=seq, keys=keys))
    c = await conductor_for(FakePrefill(reply=reply))
    c.cluster.snapshot(CacheSnapshot(node_id="prefill-0", epoch=7, seq=2, keys=[]))
    gen = c.dispatcher.generate("req-s", PROMPT, sampling(max_tokens=4))
    assert isinstance(await gen.__anext__(), Scheduled)
    assert isinstance(await gen.__anext__(), Token)          # the first token
    held = c.sched.index.longest_prefix_per_node(keys).get("prefill-0", 0)
    assert held == (len(keys) if indexed else 0)
    await gen.aclose()


async def test_a_prefill_node_declared_dead_fails_its_requests_at_once(conductor_for):
    """A partitioned prefill node sends no FIN: membership's verdict, not the
    call, ends its requests (502) and frees the decode reservation."""
    c = await conductor_for(FakePrefill(hold=asyncio.Event()))
    task = asyncio.ensure_future(run(c.dispatcher.generate("req-dead", PROMPT, sampling()), []))
    await asyncio.wait_for(c.prefill.started.wait(), 5)
    registry = c.cluster.registry
    registry.get("prefill-0").last_seen -= 1000.0   # its heartbeats stopped long ago
    assert [r.node_id for r in registry.sweep(time.monotonic())] == ["prefill-0"]
    error = await asyncio.wait_for(task, 5)
    assert error is not None and error.status == 502 and "prefill-0 dead" in error.message
    assert c.decode.cancels == ["req-dead"]
    # No cancel to the dead node: unanswered, it would hold the 502 for CANCEL_TIMEOUT_S.
    assert c.prefill.cancels == []
    assert c.dispatcher.traces["req-dead"].status == "error 502"
    assert c.dispatcher._prefill_calls == {} and c.dispatcher._abandoned == {}


async def test_the_prefill_call_has_a_deadline_from_the_slo(conductor_for):
    c = await conductor_for(ttft_slo_s=2.0)
    from roles.conductor.dispatch import PREFILL_DEADLINE_FACTOR, PREFILL_DEADLINE_MARGIN_S
    assert c.dispatcher.prefill_deadline_s(0.5) == PREFILL_DEADLINE_FACTOR * 2.0 + \
        PREFILL_DEADLINE_MARGIN_S
    assert c.dispatcher.prefill_deadline_s(7.0) == PREFILL_DEADLINE_FACTOR * 7.0 + \
        PREFILL_DEADLINE_MARGIN_S


async def test_a_prefill_node_refusing_connections_is_taken_out_at_once(conductor_for):
    """kill -9 leaves nothing listening: the first refused connection takes the
    node out (no waiting for heartbeats to time out); it must register again."""
    closed = TestServer(web.Application(), host="127.0.0.1")
    await closed.start_server()
    dead_url = str(closed.make_url("")).rstrip("/")
    await closed.close()
    c = await conductor_for(prefill_url=dead_url)
    registry = c.cluster.registry
    assert (await run(c.dispatcher.generate("req-k", PROMPT, sampling()), [])).status == 502
    assert not registry.get("prefill-0").alive
    assert registry.heartbeat("prefill-0", {}, time.monotonic()) is False  # re-register first
    error = await run(c.dispatcher.generate("req-k2", PROMPT, sampling()), [])
    assert error is not None and error.status == 503   # no live prefill node left to try
    assert c.prefill.received == []


async def test_heartbeats_carry_the_prefill_requests_the_node_holds(conductor_for):
    """The prefill node's load report names its queued/running requests
    (PrefillService.load); the conductor keeps every other booking."""
    from roles.scheduling.state import ScheduleRequest

    c = await conductor_for()
    sched, registry = c.cluster.scheduler, c.cluster.registry
    d = sched.schedule(ScheduleRequest("booked", (1, 2), 2 * BLOCK, BLOCK, 4), time.monotonic())
    assert d.prefill_node == "prefill-0"
    registry.heartbeat("prefill-0", {"queued_prefill_s": 0.25, "request_ids": []},
                       time.monotonic())
    assert set(sched.prefill["prefill-0"].pending) == {"booked"}   # not delivered yet
    registry.heartbeat("prefill-0", {"queued_prefill_s": 0.25, "request_ids": ["booked"]},
                       time.monotonic())
    # Named by the report: counted once, in the reported queue (the conductor
    # prices it with its own estimate: queue_from_bookings).
    assert [rid for rid, p in sched.prefill["prefill-0"].pending.items() if not p.in_report] == []
    # How long it has been computing reaches the scheduler; a report with a
    # malformed figure is refused whole (the route answers 400), naming it.
    now = time.monotonic()
    registry.heartbeat("prefill-0", {"request_ids": ["booked"], "running_s": {"booked": 0.5}}, now)
    started = sched.prefill["prefill-0"].pending["booked"].started_at
    assert started == pytest.approx(now - 0.5, abs=0.05)   # report time less 0.5 s
    for bad, where in (({"booked": -1}, "load.running_s.booked"),
                       ({"booked": "x"}, "load.running_s.booked"),
                       ({"booked": float("nan")}, "load.running_s.booked"),
                       (["booked"], "load.running_s")):
        sched.prefill["prefill-0"].pending["booked"].started_at = None
        with pytest.raises(MessageError) as refused:
            registry.heartbeat("prefill-0", {"request_ids": ["booked"], "running_s": bad},
                               time.monotonic())
        assert refused.value.field == where
        assert sched.prefill["prefill-0"].pending["booked"].started_at is None


@contextlib.asynccontextmanager
async def a_busier_second_prefill_node(c: Conductor):
    """A live stand-in prefill-1 beside the conductor's prefill-0, with a queue
    booked on it so that the scheduler tries prefill-0 first; yields the
    stand-in and checks on the way out that the booking was left alone."""
    from roles.scheduling.state import PendingPrefill

    live = FakePrefill()
    server = TestServer(live.app(), host="127.0.0.1")
    await server.start_server()
    try:
        c.cluster.registry.register(NodeRegistration(
            node_id="prefill-1", role="prefill", url=str(server.make_url("")).rstrip("/"),
            capacity=NodeCapacity(pages=PAGES, block_size=BLOCK, kv_bytes_per_token=1024)),
            time.monotonic())
        pending = c.sched.prefill["prefill-1"].pending
        pending["busy"] = PendingPrefill(0.5, time.monotonic())
        yield live
        assert set(pending) == {"busy"}
        del pending["busy"]
    finally:
        await server.close()


async def test_a_request_refused_by_a_killed_prefill_node_is_served_by_another(conductor_for):
    """A refused connection means no byte reached the node: the request is
    rescheduled on a live prefill node, keeping its decode reservation,
    instead of failing (the first request after a kill -9 used to get 502)."""
    closed = TestServer(web.Application(), host="127.0.0.1")
    await closed.start_server()
    dead_url = str(closed.make_url("")).rstrip("/")
    await closed.close()
    c = await conductor_for(prefill_url=dead_url)
    async with a_busier_second_prefill_node(c) as live:
        events: list = []
        error = await run(c.dispatcher.generate("req-r", PROMPT, sampling()), events)
        assert error is None
        assert tokens_of(events)[-1][3] == "length"
        assert [r.request_id for r in live.received] == ["req-r"]
        assert not c.cluster.registry.get("prefill-0").alive
        trace = c.dispatcher.traces["req-r"]
        assert (trace.prefill_node, trace.prefill_attempts, trace.status) == ("prefill-1", 2, "ok")
        assert len(c.decode.reserves) == 1 and c.decode.cancels == []   # pages kept
    c.assert_capacity_returned()


async def test_a_connection_dropped_before_the_answer_is_retried_on_fresh_pages(conductor_for):
    """A kept-alive connection to a node killed a moment ago is reset under the
    request: the node may have started writing KV, so the retry on another
    node releases the decode reservation (revoking its WRITE capability) and
    reserves again instead of reusing the pages."""
    async def reset_after_reading(reader: asyncio.StreamReader,
                                  writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)          # the request arrived: now die without answering
        writer.transport.abort()

    dropper = await asyncio.start_server(reset_after_reading, "127.0.0.1", 0)
    port = dropper.sockets[0].getsockname()[1]
    c = await conductor_for(prefill_url=f"http://127.0.0.1:{port}")
    try:
        async with a_busier_second_prefill_node(c) as live:
            error = await run(c.dispatcher.generate("req-l", PROMPT, sampling()), [])
            assert error is None
            assert [r.request_id for r in live.received] == ["req-l"]
            assert not c.cluster.registry.get("prefill-0").alive
            trace = c.dispatcher.traces["req-l"]
            assert (trace.prefill_node, trace.prefill_attempts, trace.status) == (
                "prefill-1", 2, "ok")
            # The first reservation was released, a second one made for the retry.
            assert [r.request_id for r in c.decode.reserves] == ["req-l", "req-l"]
            assert c.decode.cancels == ["req-l"]
        c.assert_capacity_returned()
    finally:
        dropper.close()
        await dropper.wait_closed()


async def test_a_prefill_node_declared_dead_mid_request_hands_it_to_another(conductor_for):
    """Membership's verdict on a silent node (partitioned, or killed at idle
    priority so that its sockets close late) reschedules its requests like a
    reset connection: served by the live node on fresh decode pages, where
    they used to fail with 502 (clean-clone CI, ``up --borrow``)."""
    c = await conductor_for(FakePrefill(hold=asyncio.Event()))
    async with a_busier_second_prefill_node(c) as live:
        task = asyncio.ensure_future(run(c.dispatcher.generate("req-moved", PROMPT, sampling()), []))
        await asyncio.wait_for(c.prefill.started.wait(), 5)
        registry = c.cluster.registry
        registry.get("prefill-0").last_seen -= 1000.0   # its heartbeats stopped long ago
        assert [r.node_id for r in registry.sweep(time.monotonic())] == ["prefill-0"]
        assert await asyncio.wait_for(task, 5) is None
        assert [r.request_id for r in live.received] == ["req-moved"]
        trace = c.dispatcher.traces["req-moved"]
        assert (trace.prefill_node, trace.prefill_attempts, trace.status) == ("prefill-1", 2, "ok")
        # It may have begun writing KV: the first pages were released first.
        assert [r.request_id for r in c.decode.reserves] == ["req-moved", "req-moved"]
        assert c.decode.cancels == ["req-moved"]
        assert c.prefill.cancels == []   # nothing sent to the dead node
    c.assert_capacity_returned()
    assert c.dispatcher._prefill_calls == {} and c.dispatcher._abandoned == {}


async def test_a_draining_decode_node_is_sent_no_new_request(conductor_for):
    """POST /admin/drain on a decode node shows in its heartbeat: the conductor
    stops choosing it (with no other decode node: 503 no_decode_capacity) until
    it is undrained, as for a prefill node."""
    c = await conductor_for()
    registry = c.cluster.registry
    registry.heartbeat("decode-0", {"draining": True}, time.monotonic())
    error = await run(c.dispatcher.generate("req-d1", PROMPT, sampling()), [])
    assert error is not None and error.status == 503 and error.code == "no_decode_capacity"
    assert c.decode.reserves == []
    # Logged with finite figures (no decode node: its TBT and limit are left at 0).
    refused = c.dispatcher.traces["req-d1"]
    assert refused.status == "rejected no_decode_capacity"
    assert refused.predicted_ttft_s > 0 and refused.predicted_tbt_s == refused.admit_limit_s == 0
    registry.heartbeat("decode-0", {"draining": False}, time.monotonic())
    assert await run(c.dispatcher.generate("req-d2", PROMPT, sampling()), []) is None
    c.assert_capacity_returned()
