"""Running one request across the cluster: the conductor's side of the workflow.

  1. schedule   block keys -> Scheduler.schedule (Algorithm 1) -> prefill node,
                decode node, reuse plan; or a Rejection (HTTP 429);
  2. reserve    the decode node allocates pages for prompt + max_tokens;
  3. prefill    the prefill node loads the prefix (locally or from the peer
                named in the plan), computes the rest and streams every
                layer's KV into the reserved pages; it answers with the first
                token (that is the TTFT);
  4. decode     the decode node continues from the first token in its
                continuous batch and streams tokens back.
Whatever happens (finish, error, client gone), ``finally`` cancels what is
still running on the nodes and returns the booked capacity to the Scheduler.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, AsyncGenerator, AsyncIterator, Callable, TypeVar

from kvstore.keys import block_keys
from model.sampling import SamplingParams
from mooncaked.node.errors import ApiError
from mooncaked.node.membership import NodeRecord
from mooncaked.node.internal_client import (CANCEL_TIMEOUT_S, CONTROL_TIMEOUT_S, RESERVE_TIMEOUT_S,
                                            STREAM_READ_TIMEOUT_S, UNBOUNDED, InternalCallError,
                                            InternalClient)
from mooncaked.node.messages import (CppPlan, DecodeStart, FetchPlan, Message, PrefillBudget,
                                     PrefillReply, PrefillRequest, RequestRef, ReservationGrant,
                                     ReservationRequest, Route, StreamError, decode_line)
from mooncaked.node.tasks import cancel_and_wait
from roles.conductor.cluster import ClusterView
from roles.conductor.metrics import ConductorMetrics
from roles.conductor.openai_types import Scheduled, Token
from roles.scheduling.state import Rejection, ScheduleRequest

log = logging.getLogger("mooncaked.conductor.dispatch")
T = TypeVar("T")

# The conductor gives up on a prefill after FACTOR x max(TTFT SLO, predicted
# TTFT) + MARGIN seconds: far past any useful answer, yet bounded, so that a
# node that stopped answering (no FIN on a partition) cannot hold a request.
PREFILL_DEADLINE_FACTOR = 3.0
PREFILL_DEADLINE_MARGIN_S = 10.0
# A prefill node that refuses the connection, or drops it before answering,
# is taken out of the cluster and the request is scheduled again on the nodes
# that remain: at most this many prefill nodes are tried before the 502.
MAX_PREFILL_ATTEMPTS = 3
# What a first token still takes once the prefill node replies (the reply's
# way back and the conductor's handling: the conductor-side part of the
# prefill call takes a few milliseconds): the node is asked to reply
# that much before the predicted TTFT.
PREFILL_REPLY_ALLOWANCE_S = 0.002


@dataclass
class PrefilledAt:
    """A prefill's reply, and for a stream_decode prefill its answer still
    open on the tokens the node decodes next (None otherwise)."""

    reply: PrefillReply
    stream: AsyncGenerator[Any, None] | None = None

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()


def _reply_then_tokens() -> Callable[[Any], Any]:
    """The decoder of a stream_decode prefill's lines: its PrefillReply,
    then TokenLines (or a last StreamError)."""
    replied = False

    def decode(obj: Any) -> Any:
        nonlocal replied
        if replied:
            return decode_line(obj)
        replied = True
        return PrefillReply.from_wire(obj)
    return decode


class PrefillRefused(ApiError):
    """The prefill node refused the connection (``maybe_started`` False: no
    byte of the request reached it) or dropped it before answering
    (``maybe_started`` True: it may have begun writing KV into the decode
    reservation, so a retry needs fresh pages)."""

    def __init__(self, status: int, message: str, maybe_started: bool) -> None:
        super().__init__(status, message)
        self.maybe_started = maybe_started


@dataclass
class RequestTrace:
    """Per-request timing breakdown (seconds), kept for /admin/requests."""
    request_id: str
    prompt_tokens: int
    prefill_node: str = ""
    decode_node: str = ""
    policy: str = ""
    cached_tokens: int = 0
    local_hit_tokens: int = 0
    fetched_tokens: int = 0
    transfer_planned_from: str | None = None
    fetch_failed: str = ""
    predicted_ttft_s: float = 0.0
    # The scheduler's predicted TBT (decode step at the load when the request
    # joins) and the measured one: mean interval between decoded tokens.
    predicted_tbt_s: float = 0.0
    tbt_s: float = 0.0
    # The first token interval, the hand-off from prefill to decode (a
    # short reply's TBT is mostly this); 0 with fewer than two tokens.
    handoff_s: float = 0.0
    # The predicted TTFT's parts (the rest of it is the median residual).
    predicted_queue_s: float = 0.0
    predicted_prefill_s: float = 0.0
    # What the residual model saw of the decision: the cost model's TTFT
    # before the residual, the load level it was read at, whether it was
    # priced by an unfitted prior (then its residual is not learned), and
    # when it was made (the conductor's monotonic clock, seconds).  With
    # ttft_s these let a replay of the residual model run offline.
    predicted_model_ttft_s: float = 0.0
    load_level: int = 0
    priced_by_prior: bool = False
    scheduled_at_s: float = 0.0
    # A refused request ("rejected <reason>"): the admit limit its
    # prediction exceeded (TTFT or TBT, seconds; 0 when not refused).
    admit_limit_s: float = 0.0
    schedule_s: float = 0.0
    reserve_s: float = 0.0
    prefill_queue_s: float = 0.0
    prefix_load_s: float = 0.0
    prefill_compute_s: float = 0.0
    # CPU seconds the prefill node's compute thread spent on it (what a node
    # that yields its cores is fitted on); 0 when the node did not say.
    prefill_compute_cpu_s: float = 0.0
    # Of a batched pass, the part spent on the requests ahead of this one in
    # it (its first token waited for the whole pass; 0 when not batched).
    prefill_batched_ahead_s: float = 0.0
    # ... and the part spent on the requests behind it (0 when not batched).
    prefill_batched_behind_s: float = 0.0
    # A colocated node's decode steps run inside the prefill, and its wait
    # for the node's compute thread (PrefillTimings).
    prefill_gave_way_s: float = 0.0
    prefill_thread_wait_s: float = 0.0
    kv_transfer_wait_s: float = 0.0
    first_layer_sent_s: float = 0.0
    # The prefill call as the conductor timed it (request sent to reply read)
    # and as the node did (enqueued to reply ready): their difference is the
    # RPC, the two event loops and the cores they wait for.
    prefill_rpc_s: float = 0.0
    prefill_node_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    e2e_s: float = 0.0
    completion_tokens: int = 0
    status: str = "running"
    prefill_attempts: int = 1   # > 1: rescheduled after a prefill node refused the connection
    # CPP: stages, bytes that crossed stage boundaries, per-stage compute.
    cpp: dict[str, Any] | None = None
    token_times: list[float] = field(default_factory=list, repr=False)
    output_token_ids: list[int] = field(default_factory=list, repr=False)

    def summary(self, with_tokens: bool = False) -> dict[str, Any]:
        out = asdict(self)
        out.pop("token_times")
        if not with_tokens:
            out.pop("output_token_ids")
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in out.items()}


class Dispatcher:
    def __init__(self, cluster: ClusterView, client: InternalClient, metrics: ConductorMetrics,
                 hash_seed: int, eos_ids: list[int],
                 keep_traces: int = 256, reservation_keepalive_s: float = 20.0) -> None:
        self.cluster = cluster
        self.client = client
        self.metrics = metrics
        self.hash_seed = hash_seed
        self.eos_ids = frozenset(eos_ids)
        self.traces: collections.OrderedDict[str, RequestTrace] = collections.OrderedDict()
        self.keep_traces = keep_traces
        self.reservation_keepalive_s = reservation_keepalive_s
        # Prefill calls in flight per node: membership's "dead"/"left" fails
        # them at once (a partitioned node sends no FIN; waiting for the call's
        # own deadline would hold the request and its decode pages).
        self._prefill_calls: dict[str, set[asyncio.Future]] = {}
        self._abandoned: dict[asyncio.Future, str] = {}
        cluster.registry.subscribe(self._on_membership)

    def _on_membership(self, event: str, record: NodeRecord) -> None:
        if event not in ("dead", "left"):
            return
        for call in self._prefill_calls.pop(record.node_id, set()):
            if not call.done():
                self._abandoned[call] = f"prefill node {record.node_id} {event} mid-request"
                call.cancel()

    def prefill_deadline_s(self, predicted_ttft_s: float) -> float:
        """How long the conductor waits for a prefill: a multiple of what the
        request may take (its TTFT SLO, or its prediction when larger)."""
        budget = max(self.cluster.scheduler.config.ttft_slo_s, predicted_ttft_s)
        return PREFILL_DEADLINE_FACTOR * budget + PREFILL_DEADLINE_MARGIN_S

    @staticmethod
    def _prefill_budget(predicted_ttft_s: float, predicted_prefill_s: float,
                        t0: float) -> PrefillBudget:
        """The prediction as the prefill node can keep it: the compute it
        predicted, and the time left of the predicted TTFT (counted from
        ``t0``, the request's arrival) less the reply's way back."""
        left = predicted_ttft_s - (time.perf_counter() - t0) - PREFILL_REPLY_ALLOWANCE_S
        return PrefillBudget(max(0.0, predicted_prefill_s), max(0.0, left))

    async def _call_prefill(self, node_id: str, url: str, spec: PrefillRequest,
                            deadline_s: float) -> PrefilledAt:
        """The prefill call; run as a task of its own, which membership
        cancels (``_on_membership``) when the node is declared dead.  The
        request goes out from this task's first step: in a burst each step
        of the event loop runs every arrival's parsing and scheduling, and
        a call that waited for a second task would wait a second round."""
        call = asyncio.current_task()
        assert call is not None
        calls = self._prefill_calls.setdefault(node_id, set())
        calls.add(call)
        try:
            return await self._prefill_once(node_id, url, spec, deadline_s)
        except asyncio.CancelledError:
            reason = self._abandoned.pop(call, None)
            if reason is None:
                raise  # our own caller was cancelled (client gone)
            call.uncancel()
            # Retried elsewhere like a dropped connection: a node that dies
            # slowly (kill -9 of a process at idle priority on a busy core
            # closes its sockets late) or is partitioned (no FIN at all) is
            # no different from one that reset the connection, and it may
            # have begun writing KV, so the retry takes fresh decode pages.
            raise PrefillRefused(502, reason, maybe_started=True) from None
        finally:
            calls.discard(call)
            if not calls and self._prefill_calls.get(node_id) is calls:
                del self._prefill_calls[node_id]
            self._abandoned.pop(call, None)

    async def _prefill_once(self, node_id: str, url: str, spec: PrefillRequest,
                            deadline_s: float) -> PrefilledAt:
        try:
            if not spec.stream_decode:
                return PrefilledAt(await self.client.call(
                    url + Route.PREFILL, spec, PrefillReply.from_wire, what="prefill",
                    timeout=deadline_s))
            return await self._prefill_streamed(url, spec, deadline_s)
        except InternalCallError as exc:
            if (exc.refused or exc.lost) and self.cluster.registry.declare_dead(node_id):
                # A killed node refuses connections (or resets the kept-alive
                # one) long before its heartbeats time out: stop scheduling
                # onto it now.  A live node that merely dropped a connection
                # is back at its next heartbeat (it registers again).
                log.warning("prefill node %s %s: taken out of the cluster until it registers "
                            "again", node_id, "refused a connection" if exc.refused
                            else "dropped the connection before answering")
            error = exc.to_api_error()
            if exc.refused or exc.lost:
                raise PrefillRefused(error.status, error.message, maybe_started=exc.lost) from None
            raise error from None

    async def _prefill_streamed(self, url: str, spec: PrefillRequest,
                                deadline_s: float) -> PrefilledAt:
        """A stream_decode prefill: its reply, the first line, within the
        deadline, and the stream left open on the tokens that follow."""
        # A silent stretch of the answer is the prefill's queue and compute
        # before the reply (bounded below), then the spacing of its tokens.
        lines = self.client.stream(url + Route.PREFILL, spec, _reply_then_tokens(),
                                   what="prefill",
                                   read_timeout=max(deadline_s, STREAM_READ_TIMEOUT_S))
        try:
            try:
                async with asyncio.timeout(deadline_s):
                    reply = await anext(lines)
            except TimeoutError:
                raise InternalCallError(url + Route.PREFILL, "prefill",
                                        f"no reply within {deadline_s:.0f}s") from None
            except StopAsyncIteration:
                raise InternalCallError(url + Route.PREFILL, "prefill",
                                        "the answer ended before the reply") from None
        except BaseException:
            await lines.aclose()
            raise
        return PrefilledAt(reply, lines)

    def _note_decision(self, trace: RequestTrace, decision) -> NodeRecord | None:
        """Record the plan in the trace; the node to pull the prefix from, if any."""
        trace.prefill_node, trace.decode_node = decision.prefill_node, decision.decode_node
        trace.policy, trace.predicted_ttft_s = decision.policy, decision.predicted_ttft_s
        trace.predicted_tbt_s = decision.predicted_tbt_s
        trace.predicted_queue_s, trace.predicted_prefill_s = decision.t_queue, decision.t_prefill
        inflight = self.cluster.scheduler.inflight.get(decision.request_id)
        if inflight is not None:
            trace.predicted_model_ttft_s = inflight.ttft_model_s
            trace.load_level = inflight.load_level
            trace.priced_by_prior = inflight.priced_by_prior
            trace.scheduled_at_s = inflight.scheduled_at
        source = self.cluster.registry.get(decision.transfer.source) if decision.transfer else None
        trace.transfer_planned_from = source.node_id if source else None
        return source

    @staticmethod
    def _scheduled(request_id: str, decision, trace: RequestTrace) -> Scheduled:
        """The plan as the client's x-mooncaked-* headers report it."""
        return Scheduled({
            "request_id": request_id, "prefill_node": decision.prefill_node,
            "decode_node": decision.decode_node, "policy": decision.policy,
            "prefix_tokens_planned": decision.prefix_tokens,
            # What x-mooncaked-cached-tokens reports (docs/api.md): the prefix
            # hit planned with; the hit the prefill node achieved is in usage.
            "cached_tokens": decision.prefix_tokens,
            "local_prefix_tokens_planned": decision.local_prefix_tokens,
            "transfer": trace.transfer_planned_from,
            "predicted_ttft_ms": round(decision.predicted_ttft_s * 1000, 2),
            "predicted_tbt_ms": round(decision.predicted_tbt_s * 1000, 2)})

    def _remember(self, trace: RequestTrace) -> None:
        self.traces[trace.request_id] = trace
        while len(self.traces) > self.keep_traces:
            self.traces.popitem(last=False)

    async def call_node(self, url: str, message: Message, decode: Callable[[Any], T], what: str,
                        timeout: float | None = UNBOUNDED) -> T:
        """A call whose failure fails the client's request: 503 when the node
        was busy, else 502."""
        try:
            return await self.client.call(url, message, decode, what=what, timeout=timeout)
        except InternalCallError as exc:
            raise exc.to_api_error() from None

    @staticmethod
    def _reserves_with_prefill(prefill: NodeRecord | None, decode: NodeRecord | None,
                               stage_urls: list[str]) -> bool:
        """Whether the prefill can carry the decode reservation: one node
        does both (and says it takes ``reserve_here``), no pipeline."""
        return (prefill is not None and decode is not None and not stage_urls
                and prefill.node_id == decode.node_id
                and bool(decode.capacity.reserves_with_prefill))

    async def _keep_reserved(self, decode_url: str, request_id: str) -> None:
        """While the prefill is queued or running, keep the decode node's
        reservation from expiring (expiry is for requests nobody owns)."""
        while True:
            await asyncio.sleep(self.reservation_keepalive_s)
            try:
                # Only an unreachable node is worth a warning: the answer is not looked at.
                await self.client.send(decode_url + Route.DECODE_TOUCH, RequestRef(request_id),
                                       what="touching the decode reservation",
                                       timeout=CONTROL_TIMEOUT_S, check_status=False)
            except InternalCallError as exc:
                log.warning("%s: keeping the decode reservation alive failed: %s", request_id, exc)

    async def _cancel(self, url: str, request_id: str) -> None:
        try:
            await self.client.send(url, RequestRef(request_id), what="cancel",
                                   timeout=CANCEL_TIMEOUT_S, check_status=False)
        except InternalCallError:
            pass  # node gone: its own timeouts free what it held

    async def generate(self, request_id: str, token_ids: list[int],
                       sampling: SamplingParams,
                       arrival_s: float | None = None) -> AsyncIterator[Scheduled | Token]:
        """``arrival_s``: time.monotonic() when the HTTP request arrived.
        Its TTFT and token times count from then, as its client's do: the
        body read and the tokenizing before this call are part of what the
        client waits for, and the TTFT residuals learn them with the rest."""
        cluster, sched = self.cluster, self.cluster.scheduler
        bs = cluster.block_size
        t_start = time.perf_counter()
        t0 = t_start
        if arrival_s is not None:
            t0 -= max(0.0, time.monotonic() - arrival_s)
        trace = RequestTrace(request_id, len(token_ids))
        if bs is None:
            self.metrics.rejected("no_nodes")
            raise ApiError(503, "no prefill/decode nodes have joined the cluster yet",
                           headers={"Retry-After": "1"})
        keys = block_keys(token_ids, bs, self.hash_seed)
        sched_keys = keys
        tail = len(token_ids) % bs
        if tail:
            # The scheduler counts the partial last block too; its key (chained
            # over the partial tokens) is never stored by a shard, so it never
            # matches: only full blocks are ever reused.
            sched_keys = keys + block_keys(token_ids[-tail:], tail, self.hash_seed,
                                           parent=keys[-1] if keys else 0)
        sreq = ScheduleRequest(request_id, tuple(sched_keys), len(token_ids), bs,
                               expected_output_tokens=sampling.max_tokens,
                               waited_s=max(0.0, time.perf_counter() - t0))
        decision = sched.schedule(sreq, time.monotonic())
        trace.schedule_s = time.perf_counter() - t_start
        if isinstance(decision, Rejection):
            self.metrics.rejected(decision.reason)
            retry = max(1, int(decision.retry_after_s + 0.999))
            status = 503 if decision.reason.startswith("no_") else 429
            message = decision.message()
            log.info("%s %d %s (%d prompt tokens, max_tokens %d)", request_id, status, message,
                     len(token_ids), sampling.max_tokens)
            # Kept with the served ones: /admin/requests shows why it was refused.
            trace.status = f"rejected {decision.reason}"
            # (A figure of a missing node is infinite: left at 0, as JSON has no inf.)
            trace.predicted_ttft_s, trace.predicted_tbt_s, trace.admit_limit_s = (
                v if math.isfinite(v) else 0.0
                for v in (decision.predicted_ttft_s, decision.predicted_tbt_s, decision.limit_s))
            self._remember(trace)
            raise ApiError(status, message, code=decision.reason,
                           headers={"Retry-After": str(retry)})
        prefill, stage_urls = cluster.prefill_target(decision.prefill_node)
        decode = cluster.registry.get(decision.decode_node)
        source = self._note_decision(trace, decision)
        # finished: the request got its finish reason (status "ok");
        # stream_done: the decode node's stream ended it, so the node has freed
        # the reservation itself.  A request the first token finishes is
        # finished without a stream: its reservation is released below.
        # booked: the Scheduler holds this request's prefill and decode bookings.
        reserved = prefill_done = finished = stream_done = False
        booked = True
        # The decode node's token stream, and its first line requested ahead.
        decode_stream: AsyncGenerator[Token, None] | None = None
        # A stream_decode prefill's answer, open on the tokens after its reply:
        # the decode stream reads it; closed on the way out in any case (a
        # decode stream closed before it ran never took it).
        prefill_stream: AsyncGenerator[Any, None] | None = None
        next_line: asyncio.Future | None = None
        self.metrics.running.inc()
        try:
            for attempt in range(1, MAX_PREFILL_ATTEMPTS + 1):
                if prefill is None or decode is None:
                    raise ApiError(503, "the chosen node just left the cluster; retry",
                                   headers={"Retry-After": "1"})
                # The node that prefills and decodes the request (colocated)
                # reserves its decode pages itself as it takes the prefill:
                # the request is then never held up by a reservation round trip.
                folded = not reserved and self._reserves_with_prefill(prefill, decode, stage_urls)
                if folded:
                    reservation = None
                    reserved = True   # cancelled on every way out, like one made here
                elif not reserved:
                    t = time.perf_counter()
                    reservation = await self.call_node(
                        decode.url + Route.DECODE_RESERVE,
                        ReservationRequest(request_id,
                                           total_tokens=len(token_ids) + sampling.max_tokens),
                        ReservationGrant.from_wire, "reserving KV pages on the decode node",
                        timeout=RESERVE_TIMEOUT_S)
                    reserved = True
                    trace.reserve_s = time.perf_counter() - t
                spec = PrefillRequest(
                    request_id, token_ids, keys, decode=reservation, sampling=sampling,
                    reserve_here=len(token_ids) + sampling.max_tokens if folded else 0,
                    # The node that decodes it here streams its tokens on the
                    # reply: no DecodeStart round trip before the second token.
                    stream_decode=folded,
                    fetch=None if source is None else FetchPlan(source.url,
                                                                decision.transfer.to_block),
                    cpp=CppPlan(stage_urls) if stage_urls else None,
                    budget=self._prefill_budget(decision.predicted_ttft_s, decision.t_prefill,
                                                t0),
                    # Another node decodes: the prefill node starts it there as
                    # soon as the KV has landed (our start then attaches).
                    decode_url=decode.url if decode.node_id != prefill.node_id else None)
                # No on_prefill_started here: the request may still wait in the
                # node's queue, and counting its estimate down from now would make
                # a busy node look idle.  Its whole estimate stays booked until the
                # prefill finishes (or the node's heartbeat reports its real queue).
                keepalive = asyncio.ensure_future(self._keep_reserved(decode.url, request_id))
                try:
                    t = time.perf_counter()
                    # Sent before the Scheduled event is handed out: its consumer
                    # writes the client's response headers before it asks for
                    # the next event, and the prefill must not wait for that.
                    call = asyncio.ensure_future(self._call_prefill(
                        prefill.node_id, prefill.url, spec,
                        self.prefill_deadline_s(decision.predicted_ttft_s)))
                    prefilled: PrefilledAt | None = None
                    try:
                        if attempt == 1:
                            # One Scheduled per request: its headers describe the
                            # first plan; a rerouted request's final nodes are in
                            # /admin/requests.
                            yield self._scheduled(request_id, decision, trace)
                        prefilled = await call
                    finally:
                        # The consumer closed us at the yield (or we were
                        # cancelled): the call goes too; the node's job is
                        # cancelled below, as for any unfinished prefill.
                        if not call.done():
                            call.cancel()
                            await asyncio.wait([call])
                        elif prefilled is None and not call.cancelled() \
                                and call.exception() is None:
                            await call.result().close()   # its reply came, unread
                    result, prefill_stream = prefilled.reply, prefilled.stream
                    trace.prefill_rpc_s = time.perf_counter() - t
                    break
                except PrefillRefused as exc:
                    # The node was killed and not yet swept from the cluster:
                    # the request is scheduled afresh on the nodes that remain.
                    # When nothing reached it, the decode pages are kept if the
                    # same decode node is chosen again; when it may have started,
                    # they are released first: release revokes the WRITE
                    # capability, so a late WRITE of the dead node can land in
                    # none of the pages reserved next.
                    if attempt == MAX_PREFILL_ATTEMPTS:
                        raise
                    if exc.maybe_started or folded:
                        await self._cancel(decode.url + Route.DECODE_CANCEL, request_id)
                        reserved = False
                    now = time.monotonic()
                    sched.on_prefill_finished(decision.prefill_node, request_id, now, 0.0)
                    sched.on_decode_finished(decision.decode_node, request_id, now)
                    booked = False
                    sreq = replace(sreq, waited_s=max(0.0, time.perf_counter() - t0))
                    retry = sched.schedule(sreq, now)
                    if isinstance(retry, Rejection):
                        raise
                    booked = True
                    log.warning("%s: prefill node %s failed (%s); rescheduled on %s", request_id,
                                decision.prefill_node, exc.message, retry.prefill_node)
                    if reserved and retry.decode_node != decision.decode_node:
                        await self._cancel(decode.url + Route.DECODE_CANCEL, request_id)
                        reserved = False
                    decision = retry
                    prefill, stage_urls = cluster.prefill_target(decision.prefill_node)
                    decode = cluster.registry.get(decision.decode_node)
                    source = self._note_decision(trace, decision)
                    trace.prefill_attempts = attempt + 1
                finally:
                    await cancel_and_wait(keepalive)
            prefill_done = True
            trace.ttft_s = time.perf_counter() - t0
            self._account_prefill(trace, result, decision, source)
            self.metrics.first_token(trace)
            first = result.first_token
            finish = self._first_finish(first, sampling)
            trace.token_times.append(trace.ttft_s)
            trace.output_token_ids.append(first)
            if finish is not None:
                # Marked before the yield: the consumer may close us right after it.
                finished, trace.status = True, "ok"
            else:
                # DecodeStart goes out before the first token is handed to the
                # client, not after its write: the decode node can take the
                # request into its next step while the conductor writes.
                decode_stream = self._decode_stream(decode.url, request_id, token_ids,
                                                    first, sampling, trace, t0,
                                                    prefill_stream)
                next_line = asyncio.ensure_future(anext(decode_stream))
            yield Token(first, result.logprob, trace.cached_tokens, finish,
                        result.top_logprobs or ())
            token = None
            if next_line is not None:
                token, next_line = await next_line, None
            while token is not None:
                done = token.finish_reason is not None
                if done:
                    finished = stream_done = True
                    trace.status = "ok"
                yield token
                token = None if done else await anext(decode_stream)
        except GeneratorExit:
            if not finished:
                trace.status = "cancelled"
            raise
        except ApiError as exc:
            trace.status = f"error {exc.status}"
            raise
        except asyncio.CancelledError:
            trace.status = "cancelled"
            raise
        finally:
            if next_line is not None:
                # Its task drives the stream: it must end before the stream
                # can be closed (asyncio.wait does not raise what it raised).
                next_line.cancel()
                await asyncio.wait([next_line])
            if decode_stream is not None:
                await decode_stream.aclose()
            if prefill_stream is not None:
                await prefill_stream.aclose()
            self.metrics.running.dec()
            now = time.monotonic()
            if not prefill_done:
                if booked:
                    sched.on_prefill_finished(decision.prefill_node, request_id, now, 0.0)
                # A node membership declared dead (partitioned: no FIN) would
                # only hold the client's error for CANCEL_TIMEOUT_S; its own
                # deadlines free what it held (its late WRITEs are refused).
                record = self.cluster.registry.get(prefill.node_id) if prefill else None
                if prefill is not None and reserved and record is not None and record.alive:
                    await self._cancel(prefill.url + Route.PREFILL_CANCEL, request_id)
            if reserved and not stream_done and decode is not None:
                await self._cancel(decode.url + Route.DECODE_CANCEL, request_id)
            if booked:
                # A stream that ran to its end measured the decode node as
                # the client gets it: its first token interval is the
                # hand-off from prefill to decode, the others its steps (a
                # client scores the reply by their mean, its inter-token
                # latency); the scheduler learns both.
                intervals = [b - a for a, b in zip(trace.token_times, trace.token_times[1:])]
                sched.on_decode_finished(
                    decision.decode_node, request_id, now,
                    intervals if stream_done and trace.status == "ok" else None)
            trace.e2e_s = time.perf_counter() - t0
            trace.completion_tokens = len(trace.token_times)
            times = trace.token_times
            if len(times) > 1:
                trace.tbt_s = (times[-1] - times[0]) / (len(times) - 1)
                trace.handoff_s = times[1] - times[0]
            self.metrics.finished(trace)
            self._remember(trace)
            log.info("%s %s: prefill %s (cached %d of %d, %s), decode %s, TTFT %.3fs "
                     "(predicted %.3fs), %d tokens in %.3fs", request_id, trace.status,
                     trace.prefill_node, trace.cached_tokens, trace.prompt_tokens,
                     f"pulled {trace.fetched_tokens} from {trace.transfer_planned_from}"
                     if trace.fetched_tokens else "local", trace.decode_node, trace.ttft_s,
                     trace.predicted_ttft_s, trace.completion_tokens, trace.e2e_s)

    def _first_finish(self, token: int, sampling: SamplingParams) -> str | None:
        if token in sampling.stop_token_ids or (token in self.eos_ids and not sampling.ignore_eos):
            return "stop"
        if sampling.max_tokens <= 1:
            return "length"
        return None

    def _account_prefill(self, trace: RequestTrace, result: PrefillReply, decision, source) -> None:
        timings = result.timings
        trace.cached_tokens = result.cached_tokens
        trace.local_hit_tokens = result.local_hit_tokens
        trace.fetched_tokens = result.fetched_tokens
        trace.fetch_failed = result.fetch_failed
        trace.prefill_queue_s = timings.queue_s
        trace.prefix_load_s = timings.fetch_s
        trace.prefill_compute_s = timings.compute_s
        trace.kv_transfer_wait_s = timings.transfer_wait_s
        trace.first_layer_sent_s = timings.first_layer_sent_s
        trace.prefill_node_s = timings.queue_s + timings.total_s
        trace.cpp = result.cpp.to_wire() if result.cpp is not None else None
        if result.stored is not None:
            # Before the first token goes out: the next decision sees these
            # blocks although the node did not wait to push its events.
            self.cluster.blocks_from_reply(decision.prefill_node, result.stored)
        sched = self.cluster.scheduler
        work = timings.compute_cpu_s  # None from a node that does not say
        trace.prefill_compute_cpu_s = work or 0.0
        trace.prefill_batched_ahead_s = timings.batched_ahead_s
        trace.prefill_batched_behind_s = timings.batched_behind_s
        trace.prefill_gave_way_s = timings.gave_way_s
        trace.prefill_thread_wait_s = timings.thread_wait_s
        sched.on_prefill_finished(decision.prefill_node, trace.request_id, time.monotonic(),
                                  trace.prefill_compute_s, actual_ttft_s=trace.ttft_s,
                                  actual_prefix_tokens=trace.cached_tokens,
                                  actual_queue_s=trace.prefill_queue_s, actual_work_s=work,
                                  actual_batched_ahead_s=trace.prefill_batched_ahead_s,
                                  actual_batched_behind_s=trace.prefill_batched_behind_s,
                                  actual_gave_way_s=timings.gave_way_s,
                                  actual_thread_wait_s=timings.thread_wait_s)
        if source is not None and trace.fetched_tokens and trace.prefix_load_s > 0:
            nbytes = trace.fetched_tokens * sched.config.kv_bytes_per_token
            sched.on_transfer_finished(source.node_id, nbytes, trace.prefix_load_s)
            self.metrics.transfer_bytes(nbytes)

    async def _decode_stream(self, url: str, request_id: str, token_ids: list[int], first: int,
                             sampling: SamplingParams, trace: RequestTrace, t0: float,
                             prefill_stream: AsyncGenerator[Any, None] | None = None
                             ) -> AsyncIterator[Token]:
        """The request's tokens after the first: read on from
        ``prefill_stream`` (a stream_decode prefill's answer) when given;
        where that ends before any token (the node did not start the decode
        itself), or without one, from the decode node's generate stream."""
        t_decode = time.perf_counter()
        try:
            if prefill_stream is not None:
                read = 0
                async with contextlib.aclosing(prefill_stream) as lines:
                    async for line in lines:
                        read += 1
                        token = self._token(line, trace, t0)
                        yield token
                        if token.finish_reason:
                            return
                if read:
                    raise ApiError(502, "decode stream ended before the request finished")
            start = DecodeStart(request_id, len(token_ids), first, sampling,
                                token_ids if sampling.needs_prompt else None)
            # aclosing: leaving the loop early closes the stream (and its connection) at once.
            async with contextlib.aclosing(self.client.stream(
                    url + Route.DECODE_GENERATE, start, decode_line, what="decode")) as lines:
                async for line in lines:
                    token = self._token(line, trace, t0)
                    yield token
                    if token.finish_reason:
                        return
            raise ApiError(502, "decode stream ended before the request finished")
        except InternalCallError as exc:
            raise exc.to_api_error() from None
        finally:
            trace.decode_s = time.perf_counter() - t_decode

    @staticmethod
    def _token(line: Any, trace: RequestTrace, t0: float) -> Token:
        """A decode stream's line as the client's next token (a StreamError: 502)."""
        if isinstance(line, StreamError):
            raise ApiError(502, f"decode node ended the stream: {line.error}")
        trace.token_times.append(time.perf_counter() - t0)
        trace.output_token_ids.append(line.token)
        return Token(line.token, line.logprob, trace.cached_tokens, line.finish_reason,
                     line.top_logprobs or ())
