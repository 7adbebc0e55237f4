"""The internal protocol (mooncaked/node/messages.py) and its one client
(mooncaked/node/internal_client.py).

Every message survives ``to_wire`` -> JSON -> ``from_wire``; a malformed one
is refused at decode with the bad field named; a real node app answers a
malformed ``/internal/...`` body with 400 naming the field; the client maps
every failure to ``InternalCallError``.
"""

from __future__ import annotations

import copy
import dataclasses

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvstore.layout import PageLayout
from model.sampling import SamplingParams
from mooncaked.local_cluster import free_port
from mooncaked.node.config import NodeConfig
from mooncaked.node.context import NodeContext
from mooncaked.node.internal_client import InternalCallError, InternalClient
from mooncaked.node.messages import (
    Aborted, ActivationSlot, CacheEvents, CacheEventsAck, CacheSnapshot, Cancelled, CppChunk,
    CppHop, CppPlan, CppPrepare, CppPrepared, CppStageReport, CppStart, CppSummary,
    DecodeSeqLoad, DecodeStart, DecodeStepSample, Deregistration, FetchPlan, Heartbeat,
    LeaseGrant, LeaseRelease, LeaseRequest, MessageError, NodeCapacity, NodeLoad,
    NodeRegistration, Ok, PrefetchReply, PrefetchRequest, PrefillBudget, PrefillReply,
    PrefillRequest, PrefillTimings, RegistrationAck, Released, RequestRef, ReservationGrant,
    ReservationRequest, Route, StreamError, TokenLine, decode_line, sampling_to_wire)
from mooncaked.node.runtime import build_app
from mooncaked.node.sections import NodeSection
from roles.conductor.cluster import CLUSTER, ClusterView, add_cache_routes
from roles.conductor.membership_api import setup_membership

GRANT = ReservationGrant(pages=[4, 5, 6], segment="decode-0", region=1)
SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, max_tokens=8,
                          stop_token_ids=[2], stop=["\n"], logprobs=True)
PREFILL = PrefillRequest(request_id="r1", token_ids=list(range(40)), block_keys=[11, 12],
                         decode=GRANT, sampling=SAMPLING,
                         fetch=FetchPlan(source_url="http://127.0.0.1:9/", to_block=2),
                         cpp=CppPlan(stage_urls=["http://127.0.0.1:10"]),
                         budget=PrefillBudget(prefill_s=0.125, reply_within_s=0.5))
HOP = CppHop(url="http://127.0.0.1:10", segment="prefill-1", region=2, offset=4096)
LAYOUT = PageLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32")
# What worker_node announces; a CPP stage and a decode node add their own.
CAPACITY = NodeCapacity(pages=64, block_size=16, page_bytes=LAYOUT.page_bytes,
                        kv_bytes_per_token=LAYOUT.kv_bytes_per_token, layout=LAYOUT, region=0,
                        layers=[0, 2], yields_to=["decode-0"])
CPP_CAPACITY = dataclasses.replace(CAPACITY, yields_to=None, layers=[1, 2], cpp_group="g",
                                   cpp_stage=1, cpp_stages=2)
# What PrefillService.load and DecodeBatcher.load report; a colocated node both.
PREFILL_LOAD = NodeLoad(queue_len=2, queued_tokens=96, queued_prefill_s=0.048,
                        prefill_tokens_per_s=2000.0, request_ids=["r1", "r2"],
                        running_s={"r1": 0.25}, running_cpu_s={"r1": 0.125}, batches=3,
                        batched_requests=7, batch_joins_declined=1, completed=9, failed=0)
DECODE_LOAD = NodeLoad(batch_size=1, waiting=1, reservations=3, free_pages=40, fenced_pages=0,
                       recent_tbt_s=0.02, context_tokens=41, tokens_out=100, steps=90,
                       mirrored=1, mirror_bytes=4096, mirror_budget_bytes=1 << 20,
                       sequences=[DecodeSeqLoad("r1", 41, 2, 30), DecodeSeqLoad("r3", 12, 1, 8)],
                       recent_steps=[DecodeStepSample(89, 1, 40, 0.02),
                                     DecodeStepSample(90, 1, 41, 0.0199)])
REGISTRATION = NodeRegistration(
    node_id="prefill-0", role="prefill", url="http://127.0.0.1:8001",
    capacity=CAPACITY, load=NodeLoad(queue_len=0, draining=False),
    transfer={"name": "prefill-0", "transport": "tcp", "regions": [], "nics": [], "topology": {}})

EVERY_MESSAGE = [
    RequestRef(request_id="r1"), Ok(), Cancelled(cancelled=True), Aborted(aborted=False),
    Released(released=True),
    ReservationRequest(request_id="r1", total_tokens=48), GRANT,
    DecodeStart(request_id="r1", prompt_len=40, first_token=7, sampling=SAMPLING),
    TokenLine(token=9, logprob=-0.25, finish_reason=None),
    TokenLine(token=2, logprob=0.0, finish_reason="stop"), StreamError(error="cancelled"),
    PREFILL, dataclasses.replace(PREFILL, fetch=None, cpp=None, budget=None),
    dataclasses.replace(PREFILL, decode=None, reserve_here=48, cpp=None),
    PrefillReply(first_token=7, logprob=-1.5, local_hit_tokens=16, fetched_tokens=16,
                 computed_tokens=8, fetch_failed="",
                 timings=PrefillTimings(queue_s=0.5, fetch_s=0.25, compute_s=0.125,
                                        transfer_wait_s=0.001, first_layer_sent_s=0.002,
                                        total_s=0.375, compute_cpu_s=0.1, batched_ahead_s=0.05,
                                        batched_behind_s=0.0)),
    PrefillReply(first_token=7, logprob=0.0, timings=PrefillTimings(),
                 cpp=CppSummary(stages=2, boundary_bytes=1024, stage_compute_s=[0.5, 0.25])),
    PrefetchRequest(token_ids=list(range(32)), block_keys=[1, 2], source_url="http://p:1"),
    PrefetchReply(held_tokens=32, error=""),
    LeaseRequest(keys=[1, 2, 2**64 - 1], ttl_s=12.5),
    LeaseGrant(lease_id=3, pages=[0, 9], region=0, segment="prefill-0"), LeaseRelease(lease_id=3),
    CppPrepare(request_id="r1", token_ids=list(range(40)), block_keys=[11, 12], decode=GRANT,
               sampling=SAMPLING, max_prefix_blocks=2),
    CppPrepared(prefix_blocks=1, act=ActivationSlot(segment="prefill-1", region=2, offset=4096)),
    CppStart(request_id="r1", prefix_blocks=1, next=HOP),
    CppStart(request_id="r1", prefix_blocks=0, next=None),
    CppStageReport(stage_compute_s=0.5, stage_s=0.75, boundary_bytes=64, layers=[0, 2]),
    CppStageReport(stage_compute_s=0.5, stage_s=0.75, boundary_bytes=0, layers=[2, 4],
                   first_token=5, logprob=-0.5),
    CppChunk(request_id="r1", start=16, n=16),
    REGISTRATION, dataclasses.replace(REGISTRATION, capacity=CPP_CAPACITY),
    NodeRegistration(node_id="decode-0", role="decode", url="http://127.0.0.1:8002",
                     capacity=dataclasses.replace(CAPACITY, yields_to=None, max_batch=32),
                     load=dataclasses.replace(DECODE_LOAD, draining=False)),
    NodeCapacity(), NodeLoad(), PREFILL_LOAD, DECODE_LOAD,
    RegistrationAck(node_id="prefill-0", heartbeat_interval_s=1.0),
    Heartbeat(node_id="prefill-0", load=dataclasses.replace(PREFILL_LOAD, draining=False)),
    Heartbeat(node_id="colo-0",
              load=PREFILL_LOAD.merged(DECODE_LOAD).merged(NodeLoad(draining=True))),
    Deregistration(node_id="prefill-0"),
    CacheSnapshot(node_id="prefill-0", epoch=2**62, seq=0, keys=[5, 6]),
    CacheEvents(node_id="prefill-0", epoch=2**62, seq=3, stored=[7], evicted=[5], resync=False),
    CacheEventsAck(resync=True),
]


@pytest.mark.parametrize("msg", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_survives_the_wire(msg):
    wire = orjson.loads(orjson.dumps(msg.to_wire()))
    assert type(msg).from_wire(wire) == msg


def test_the_wire_keeps_the_shapes_nodes_already_speak():
    # What roles/conductor/dispatch.py built by hand before there were messages.
    assert PREFILL.to_wire() == {
        "request_id": "r1", "token_ids": list(range(40)), "block_keys": [11, 12],
        "sampling": dataclasses.asdict(SAMPLING),
        "decode": {"segment": "decode-0", "region": 1, "pages": [4, 5, 6]},
        "fetch": {"source_url": "http://127.0.0.1:9/", "to_block": 2},
        "cpp": {"stage_urls": ["http://127.0.0.1:10"]},
        "budget": {"prefill_s": 0.125, "reply_within_s": 0.5}}
    plain = dataclasses.replace(PREFILL, fetch=None, cpp=None, budget=None).to_wire()
    assert "fetch" not in plain and "cpp" not in plain and "budget" not in plain
    reply = PrefillReply(first_token=7, logprob=-1.5, local_hit_tokens=16, fetched_tokens=8,
                         timings=PrefillTimings(compute_s=0.1234567)).to_wire()
    assert reply["cached_tokens"] == 24 and reply["timings"] == {
        "queue_s": 0.0, "fetch_s": 0.0, "compute_s": 0.123457, "transfer_wait_s": 0.0,
        "first_layer_sent_s": 0.0, "total_s": 0.0, "batched_ahead_s": 0.0,
        "batched_behind_s": 0.0}   # compute_cpu_s: only from a node that measures it
    assert set(reply) == {"first_token", "logprob", "cached_tokens", "local_hit_tokens",
                          "fetched_tokens", "computed_tokens", "fetch_failed", "timings"}
    assert TokenLine(token=1, logprob=0.0, finish_reason=None).to_wire() == {
        "token": 1, "logprob": 0.0, "finish_reason": None}
    assert CppStart(request_id="r", prefix_blocks=0).to_wire()["next"] is None
    assert "first_token" not in CppStageReport(0.0, 0.0, 0, [0, 1]).to_wire()
    # One SamplingParams wire form: its fields.
    assert sampling_to_wire(SAMPLING) == dataclasses.asdict(SAMPLING)
    # Capacity and load: the keys each role put in its open objects before
    # they were typed (/admin/status and its readers see the same JSON); a
    # field the node's role does not report is left out.
    assert CPP_CAPACITY.to_wire() == {
        "pages": 64, "block_size": 16, "page_bytes": LAYOUT.page_bytes,
        "kv_bytes_per_token": LAYOUT.kv_bytes_per_token, "layout": LAYOUT.to_dict(),
        "region": 0, "layers": [1, 2], "cpp_group": "g", "cpp_stage": 1, "cpp_stages": 2}
    assert Heartbeat("d", NodeLoad(batch_size=0, sequences=[DecodeSeqLoad("r", 3, 1, 4)],
                                   draining=True)).to_wire() == {
        "node_id": "d", "load": {"draining": True, "batch_size": 0, "sequences": [
            {"request_id": "r", "context_tokens": 3, "generated_tokens": 1, "max_tokens": 4}]}}
    assert NodeRegistration("p", "prefill", "http://p").to_wire() == {
        "node_id": "p", "role": "prefill", "url": "http://p", "capacity": {}, "transfer": {},
        "load": {}}


def test_a_colocated_load_report_merges_its_roles_parts():
    """NodeContext.load: each role's part fills its own fields; draining is the node's."""
    ctx = NodeContext(config=NodeConfig())
    ctx.load_providers += [lambda: PREFILL_LOAD, lambda: DECODE_LOAD]
    ctx.draining = True
    load = ctx.load()
    assert load.queue_len == 2 and load.batch_size == 1 and load.draining is True
    assert load.to_wire() == {**PREFILL_LOAD.to_wire(), **DECODE_LOAD.to_wire(), "draining": True}
    assert "draining" not in PREFILL_LOAD.to_wire()   # a role's part (/admin/status "prefill")
    ctx.load_providers.clear()
    assert ctx.load() == NodeLoad(draining=True)


def test_defaults_fill_absent_and_null_fields_and_unknown_keys_are_ignored():
    req = PrefillRequest.from_wire({"request_id": "r", "token_ids": [1, 2], "block_keys": [],
                                    "decode": {"pages": [0], "segment": "d"},
                                    "sampling": None, "fetch": None, "newer_field": 1})
    assert req.sampling == SamplingParams() and req.fetch is None and req.stage_urls == []
    assert req.decode.region == 0
    assert CacheEvents.from_wire({"node_id": "n", "epoch": 1, "seq": 1}).stored == []
    assert decode_line({"error": "cancelled"}) == StreamError("cancelled")
    assert decode_line({"token": 3}) == TokenLine(3, None, None)
    # Registrations live in etcd and are read by whichever conductor leads: in
    # a rolling upgrade a node may report capacity and load its conductor does
    # not know yet.
    newer = _with(_with(REGISTRATION.to_wire(), "capacity.gpu_pages", 8), "load.newer_gauge", 1)
    assert NodeRegistration.from_wire(newer) == REGISTRATION
    assert Heartbeat.from_wire({"node_id": "p", "load": {"draining": None}}).load == NodeLoad()


def _with(wire: dict, path: str, value) -> dict:
    """``wire`` with the dotted ``path`` set to ``value`` (``...`` deletes it)."""
    out = copy.deepcopy(wire)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is ...:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return out


PREFILL_WIRE = PREFILL.to_wire()
REGISTRATION_WIRE = REGISTRATION.to_wire()


@pytest.mark.parametrize("cls,wire,field,problem", [
    (PrefillRequest, _with(PREFILL_WIRE, "decode.pages.2", -1), "prefill.decode.pages[2]",
     "expected a non-negative integer, got -1"),
    (PrefillRequest, _with(PREFILL_WIRE, "request_id", ...), "prefill.request_id", "missing"),
    (PrefillRequest, _with(PREFILL_WIRE, "request_id", 7), "prefill.request_id",
     "expected a non-empty string"),
    (PrefillRequest, _with(PREFILL_WIRE, "token_ids", []), "prefill.token_ids", "non-empty list"),
    (PrefillRequest, _with(PREFILL_WIRE, "token_ids.3", True), "prefill.token_ids[3]",
     "expected a non-negative integer, got True"),
    (PrefillRequest, _with(PREFILL_WIRE, "block_keys", "x"), "prefill.block_keys",
     "expected a list of non-negative integers"),
    (PrefillRequest, _with(PREFILL_WIRE, "decode", ...), "prefill.decode",
     "expected a decode reservation or reserve_here tokens (exactly one)"),
    (PrefillRequest, _with(PREFILL_WIRE, "reserve_here", 48), "prefill.decode",
     "expected a decode reservation or reserve_here tokens (exactly one)"),
    (PrefillRequest, _with(_with(PREFILL_WIRE, "decode", ...), "reserve_here", 39),
     "prefill.reserve_here", "39 tokens do not cover the 40-token prompt"),
    (PrefillRequest, _with(_with(PREFILL_WIRE, "decode", ...), "reserve_here", -1),
     "prefill.reserve_here", "expected a non-negative integer, got -1"),
    (PrefillRequest, _with(PREFILL_WIRE, "decode.segment", None), "prefill.decode.segment",
     "expected a string, got null"),
    (PrefillRequest, _with(PREFILL_WIRE, "fetch.source_url", ""), "prefill.fetch.source_url",
     "non-empty string"),
    (PrefillRequest, _with(PREFILL_WIRE, "cpp.stage_urls.0", 3), "prefill.cpp.stage_urls[0]",
     "non-empty string"),
    (PrefillRequest, _with(PREFILL_WIRE, "sampling.top_p", 2.0), "prefill.sampling", "top_p"),
    (PrefillRequest, _with(PREFILL_WIRE, "sampling.typical_p", 0.1), "prefill.sampling.typical_p",
     "unknown sampling parameter"),
    (PrefillRequest, _with(PREFILL_WIRE, "sampling.seed", "s"), "prefill.sampling.seed",
     "expected an integer"),
    (PrefillRequest, [PREFILL_WIRE], "prefill", "expected a JSON object, got a list"),
    (PrefillRequest, _with(PREFILL_WIRE, "budget.reply_within_s", -0.5),
     "prefill.budget.reply_within_s", "expected a finite number of seconds >= 0, got -0.5"),
    (PrefillRequest, _with(PREFILL_WIRE, "budget.prefill_s", ...), "prefill.budget.prefill_s",
     "missing"),
    (CppPrepare, PREFILL_WIRE, "cpp.prepare.max_prefix_blocks", "missing"),
    (CppStart, {"request_id": "r", "prefix_blocks": 0, "next": {**HOP.to_wire(), "offset": "x"}},
     "cpp.start.next.offset", "expected a non-negative integer, got 'x'"),
    (CppChunk, {"request_id": "r", "start": 0, "n": 0}, "cpp.chunk.n", "positive integer"),
    (ReservationRequest, {"request_id": "r", "total_tokens": 0}, "decode.reserve.total_tokens",
     "expected a positive integer, got 0"),
    (DecodeStart, {"request_id": "r", "prompt_len": 3, "first_token": 1,
                   "sampling": {"max_tokens": 0}}, "decode.generate.sampling.max_tokens",
     "expected a positive integer"),
    (TokenLine, {"logprob": 0.0}, "token.token", "missing"),
    (PrefillReply, {"logprob": 0.0}, "prefill reply.first_token", "missing"),
    (PrefillReply, {"first_token": 1, "timings": {"queue_s": "slow"}},
     "prefill reply.timings.queue_s", "expected a number"),
    (PrefillReply, {"first_token": 1, "timings": {"compute_cpu_s": -0.5}},
     "prefill reply.timings.compute_cpu_s", "expected a finite number of seconds >= 0"),
    (LeaseRequest, {"keys": [1], "ttl_s": "long"}, "lease.ttl_s", "expected a number"),
    (LeaseRelease, {"lease_id": 1.5}, "lease.release.lease_id", "integer"),
    (NodeRegistration, _with(REGISTRATION_WIRE, "role", "conductor"), "registration.role",
     "expected one of prefill, decode, colocated"),
    (NodeRegistration, _with(REGISTRATION_WIRE, "capacity", [1]), "registration.capacity",
     "expected a JSON object"),
    (NodeRegistration, _with(REGISTRATION_WIRE, "capacity.pages", "64"),
     "registration.capacity.pages", "expected a non-negative integer, got '64'"),
    (NodeRegistration, _with(REGISTRATION_WIRE, "capacity.block_size", 0),
     "registration.capacity.block_size", "expected a positive integer, got 0"),
    (NodeRegistration, _with(REGISTRATION_WIRE, "capacity.yields_to.0", ""),
     "registration.capacity.yields_to[0]", "non-empty string"),
    (NodeRegistration, _with(REGISTRATION_WIRE, "capacity.layout.head_dim", ...),
     "registration.capacity.layout.head_dim", "missing"),
    (NodeRegistration, _with(REGISTRATION_WIRE, "capacity.layout.dtype", "int3"),
     "registration.capacity.layout", "dtype must be one of"),
    (NodeRegistration, _with(REGISTRATION_WIRE, "capacity.cpp_group", "g"),
     "registration.capacity.cpp_group", "cpp_group, cpp_stage and cpp_stages together"),
    (NodeRegistration,
     _with(REGISTRATION_WIRE, "capacity", _with(CPP_CAPACITY.to_wire(), "cpp_stage", 2)),
     "registration.capacity.cpp_stage", "expected a stage below 2, got 2"),
    (NodeRegistration, _with(REGISTRATION_WIRE, "load.queued_prefill_s", -1),
     "registration.load.queued_prefill_s", "expected a finite number of seconds >= 0"),
    (Heartbeat, {"node_id": "n", "load": "busy"}, "heartbeat.load", "JSON object"),
    (Heartbeat, {"node_id": "n", "load": {"batch_size": "2"}}, "heartbeat.load.batch_size",
     "expected a non-negative integer, got '2'"),
    (Heartbeat, {"node_id": "n", "load": {"draining": "no"}}, "heartbeat.load.draining",
     "expected true or false"),
    (Heartbeat, {"node_id": "n", "load": {"request_ids": ["r1", 2]}},
     "heartbeat.load.request_ids[1]", "non-empty string"),
    (Heartbeat, {"node_id": "n", "load": {"running_s": {"r1": float("inf")}}},
     "heartbeat.load.running_s.r1", "expected a finite number of seconds >= 0"),
    (Heartbeat, _with(Heartbeat("n", DECODE_LOAD).to_wire(), "load.sequences.1.max_tokens", 0),
     "heartbeat.load.sequences[1].max_tokens", "expected a positive integer, got 0"),
    (Heartbeat, _with(Heartbeat("n", DECODE_LOAD).to_wire(), "load.recent_steps.0.seconds", None),
     "heartbeat.load.recent_steps[0].seconds", "expected a number, got null"),
    (CacheEvents, {"node_id": "n", "epoch": 1, "seq": 2, "stored": [1, True]},
     "cache.events.stored[1]", "non-negative integer"),
    (CacheSnapshot, {"node_id": "n", "epoch": 1, "keys": []}, "cache.snapshot.seq", "missing"),
])
def test_a_malformed_message_is_refused_naming_the_field(cls, wire, field, problem):
    with pytest.raises(MessageError) as info:
        cls.from_wire(wire)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ") and problem in str(info.value)


def test_keys_and_pages_are_checked_against_the_block_size():
    assert PrefillRequest.from_wire(PREFILL_WIRE, block_size=16) == PREFILL
    with pytest.raises(MessageError, match=r"^prefill\.block_keys: .*per full block of 8 tokens"):
        PrefillRequest.from_wire(PREFILL_WIRE, block_size=8)       # 40 tokens: 5 keys
    short = _with(PREFILL_WIRE, "decode.pages", [4, 5])
    with pytest.raises(MessageError, match=r"^prefill\.decode\.pages: 2 pages of 16 tokens"):
        PrefillRequest.from_wire(short, block_size=16)
    prefetch = PrefetchRequest(token_ids=list(range(40)), block_keys=[1], source_url="http://p")
    with pytest.raises(MessageError, match=r"^prefetch\.block_keys"):
        PrefetchRequest.from_wire(prefetch.to_wire(), block_size=16)


# ---- a real node app, a real client ------------------------------------------------

@pytest.fixture
async def conductor_url():
    """The conductor's membership and cache routes behind the real middlewares
    (errors as JSON, the cluster token on /internal/)."""
    config = NodeConfig(node=NodeSection(cluster_token="s3cret"))

    def setup(app: web.Application, ctx) -> None:
        app[CLUSTER] = ClusterView(setup_membership(app, timeout_s=5.0), ctx.config.conductor)
        add_cache_routes(app)

    async with TestServer(build_app(NodeContext(config=config), setup)) as server:
        yield str(server.make_url("")).rstrip("/")


@pytest.mark.parametrize("route,body,field", [
    (Route.NODE_REGISTER, {"node_id": "p", "role": "prefill", "url": 5}, "registration.url"),
    (Route.NODE_HEARTBEAT, {"node_id": "p", "load": []}, "heartbeat.load"),
    (Route.NODE_HEARTBEAT, {"node_id": "p", "load": {"batch_size": "many"}},
     "heartbeat.load.batch_size"),
    (Route.NODE_REGISTER, {"node_id": "p", "role": "decode", "url": "http://p",
                           "capacity": {"max_batch": 0}}, "registration.capacity.max_batch"),
    (Route.CACHE_EVENTS, {"node_id": "p", "epoch": 1, "seq": "2"}, "cache.events.seq"),
    (Route.CACHE_SNAPSHOT, {"node_id": "p", "epoch": 1, "seq": 0, "keys": [-1]},
     "cache.snapshot.keys[0]"),
    (Route.NODE_DEREGISTER, [], "deregister"),
])
async def test_a_malformed_internal_body_gets_400_naming_the_field(conductor_url, route, body, field):
    client = InternalClient.open("s3cret")
    try:
        async with client.session.post(conductor_url + route, data=orjson.dumps(body),
                                       headers=client.headers) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert error["message"].startswith(f"{field}: ") and error["param"] == field
        # Through the client: the same answer as an InternalCallError.
        with pytest.raises(InternalCallError) as info:
            await client.call(conductor_url + route, _Raw(body), Ok.from_wire, what="test call")
        assert info.value.status == 400 and info.value.detail.startswith(f"{field}: ")
        assert info.value.to_api_error().status == 502
    finally:
        await client.close()


class _Raw:
    """A body that is not a valid message (to send malformed JSON on purpose)."""

    def __init__(self, body) -> None:
        self.body = body

    def to_wire(self):
        return self.body


async def test_the_client_carries_the_token_and_maps_every_failure(conductor_url):
    reg = NodeRegistration(node_id="p", role="prefill", url="http://127.0.0.1:1")
    anonymous = InternalClient.open()
    client = InternalClient.open("s3cret")
    try:
        with pytest.raises(InternalCallError) as info:
            await anonymous.send(conductor_url + Route.NODE_REGISTER, reg, what="registration")
        assert info.value.status == 401
        ack = await client.call(conductor_url + Route.NODE_REGISTER, reg,
                                RegistrationAck.from_wire, what="registration")
        assert ack.node_id == "p"
        await client.send(conductor_url + Route.NODE_HEARTBEAT, Heartbeat("p"), what="heartbeat")
        with pytest.raises(InternalCallError) as info:
            await client.send(conductor_url + Route.NODE_HEARTBEAT, Heartbeat("q"), what="heartbeat")
        assert info.value.status == 404 and "unknown node 'q'" in info.value.detail
        assert str(info.value).startswith("heartbeat failed (HTTP 404): ")
        # check_status=False: only an unreachable node is a failure.
        await client.send(conductor_url + Route.NODE_HEARTBEAT, Heartbeat("q"), what="heartbeat",
                          check_status=False)
        # An answer that does not decode as the reply expected.
        with pytest.raises(InternalCallError, match=r"malformed answer: CacheEventsAck\.resync"):
            await client.call(conductor_url + Route.NODE_HEARTBEAT, Heartbeat("p"),
                              CacheEventsAck.from_wire, what="heartbeat")
        # Nobody listening: no status, the target and the attempt are named.
        dead = f"http://127.0.0.1:{free_port()}" + Route.NODE_HEARTBEAT
        with pytest.raises(InternalCallError) as info:
            await client.send(dead, Heartbeat("p"), what="heartbeat", timeout=2)
        assert info.value.status is None and info.value.target == dead
        assert str(info.value).startswith("heartbeat failed: ")
        assert info.value.to_api_error().status == 502
    finally:
        await client.close()
        await anonymous.close()


async def test_the_token_stream_is_decoded_line_by_line():
    lines = [TokenLine(5, -0.5, None).to_wire(), TokenLine(6, -0.25, "length").to_wire()]

    async def generate(request: web.Request) -> web.StreamResponse:
        start = DecodeStart.from_wire(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for line in lines if start.request_id == "ok" else [{"token": "x"}]:
            await resp.write(orjson.dumps(line) + b"\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post(Route.DECODE_GENERATE, generate)
    client = InternalClient.open()
    async with TestServer(app) as server:
        url = str(server.make_url(Route.DECODE_GENERATE))
        try:
            got = [line async for line in client.stream(
                url, DecodeStart("ok", 3, 4, SamplingParams()), decode_line, what="decode")]
            assert got == [TokenLine(5, -0.5, None), TokenLine(6, -0.25, "length")]
            with pytest.raises(InternalCallError, match=r"decode failed: malformed answer: token\."):
                async for _ in client.stream(url, DecodeStart("bad", 3, 4, SamplingParams()),
                                             decode_line, what="decode"):
                    pass
        finally:
            await client.close()


class _StubWorker:
    """Just what the handlers read before a request is decoded."""

    class layout:
        block_size = 16

    shard = None
    region_id = 0


class _StubBatcher:
    def __init__(self) -> None:
        self.released: list[tuple[str, str]] = []

    def release(self, request_id: str, reason: str) -> bool:
        self.released.append((request_id, reason))
        return True


@pytest.mark.parametrize("route,body,field", [
    (Route.PREFILL, _with(PREFILL_WIRE, "decode.pages.1", "4"), "prefill.decode.pages[1]"),
    (Route.PREFILL, _with(PREFILL_WIRE, "block_keys", [11]), "prefill.block_keys"),
    (Route.PREFILL, {}, "prefill.request_id"),
    (Route.PREFILL_CANCEL, {"request_id": 3}, "prefill.cancel.request_id"),
    (Route.PREFETCH, {"token_ids": [1], "block_keys": [], "source_url": None},
     "prefetch.source_url"),
    (Route.LEASE, {"keys": [1, -2]}, "lease.keys[1]"),
    (Route.LEASE, {"keys": [1], "ttl_s": 1e9}, "lease.ttl_s"),
    (Route.LEASE_RELEASE, {"lease_id": "1"}, "lease.release.lease_id"),
    (Route.DECODE_RESERVE, {"request_id": "r", "total_tokens": -1}, "decode.reserve.total_tokens"),
    (Route.DECODE_TOUCH, {"request_id": ""}, "decode.touch.request_id"),
    (Route.DECODE_GENERATE, {"request_id": "r", "first_token": 1},
     "decode.generate.prompt_len"),
])
async def test_worker_routes_answer_a_malformed_body_with_400_naming_the_field(route, body, field):
    from mooncaked.node.errors import error_middleware
    from roles.decode import app as decode_app
    from roles.prefill import app as prefill_app
    from roles.store_leases import add_lease_routes
    from roles.worker_node import WORKER

    app = web.Application(middlewares=[error_middleware])
    app[WORKER] = _StubWorker()
    app[decode_app.BATCHER] = batcher = _StubBatcher()
    add_lease_routes(app)
    for path, handler in ((Route.PREFILL, prefill_app.prefill),
                          (Route.PREFILL_CANCEL, prefill_app.cancel),
                          (Route.PREFETCH, prefill_app.prefetch_blocks),
                          (Route.DECODE_RESERVE, decode_app.reserve),
                          (Route.DECODE_TOUCH, decode_app.touch),
                          (Route.DECODE_GENERATE, decode_app.generate)):
        app.router.add_post(path, handler)
    client = InternalClient.open()
    async with TestServer(app) as server:
        try:
            with pytest.raises(InternalCallError) as info:
                await client.send(str(server.make_url(route)), _Raw(body), what="test call")
        finally:
            await client.close()
    assert info.value.status == 400 and info.value.detail.startswith(f"{field}: ")
    if route == Route.DECODE_GENERATE:  # a malformed start gives its reservation up
        assert batcher.released == [("r", "bad request")]
