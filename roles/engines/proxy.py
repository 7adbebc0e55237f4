"""The OpenAI API in front of external engines: tokenize, choose, forward, learn.

With ``conductor.engines`` set, the conductor's /v1/completions and
/v1/chat/completions go here.  Per request:

1. tokenize: here, with the engine's own tokenizer where the fleet loaded
   it and showed it agrees with the engine (``local_tokenizer.py``); else at
   a live engine serving the request's model (``POST /tokenize`` with the
   prompt or the chat messages and template options), so the token ids are
   the ones the engine caches;
2. the engines' prefix hits from the index of their KV events, and the
   EngineScheduler's choice (Algorithm 1); a refusal is a 429 (503 when no
   engine is up) with Retry-After and the prediction in the message;
3. the body is forwarded unchanged and the answer streamed back as it comes
   (SSE passed through; a JSON answer whole); engine errors keep their
   status and OpenAI body;
4. the first content chunk is the TTFT and the chunk intervals the TBT
   the scheduler learns from; the conductor's metrics (/metrics) count
   each request as for its own nodes, and by engine
   (``mooncaked_engine_requests_total{engine, status}``).

Failures: an engine that cannot be reached before answering is marked dead
and the request goes to another (once); one that dies mid-answer is marked
dead and the client gets a 502 (a stream: an SSE error event, then
``[DONE]``).  A client that goes away closes the upstream connection,
which makes the engine abort the request.  /v1/models lists the live
engines' models; /tokenize and /detokenize are passed to an engine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
import orjson
from aiohttp import web

from kvstore.keys import block_keys
from mooncaked.node.context import NodeContext
from mooncaked.node.errors import ApiError, StartupError, error_body, json_response, read_json
from roles.conductor.metrics import ConductorMetrics
from roles.conductor.openai_api import TOKENIZE_IN_THREAD_BYTES
from roles.conductor.openai_parse import context_length_error
from roles.engines.fleet import Engine, EngineFleet, EngineSpec, EngineSpecError
from roles.engines.indexer_api import ENGINES
from roles.scheduling.config import scheduler_config
from roles.scheduling.engines import EngineDecision, EngineScheduler
from roles.scheduling.decode_estimator import DecodeEstimator
from roles.scheduling.estimators import PrefillEstimator
from roles.scheduling.state import Rejection

log = logging.getLogger("mooncaked.engines.proxy")

# Tries of one request: a second engine when the first could not be reached.
MAX_ATTEMPTS = 2
# How often a waiting request checks that its client and its engine are still there.
WATCH_S = 0.25
CONNECT_TIMEOUT_S = 5.0
# A call that is not a generation (/tokenize, /v1/models) gives up after this long.
CALL_TIMEOUT_S = 30.0
# Largest error body read from an engine (its message is passed on).
MAX_ERROR_BYTES = 1 << 20
# Chat /tokenize options that change the tokens (vLLM's names).
CHAT_TOKENIZE_KEYS = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                      "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")
DONE = b"data: [DONE]\n\n"
# The longest SSE line of an engine's stream the proxy parses: a stream
# whose line runs past it is treated as a broken engine, not buffered.
MAX_SSE_LINE_BYTES = 1 << 20


def rejection_error(rej: Rejection) -> ApiError:
    """A refusal as the client sees it (worded as for the conductor's own nodes)."""
    status = 503 if rej.reason.startswith("no_") else 429
    return ApiError(status, rej.message(), code=rej.reason,
                    headers={"Retry-After": str(max(1, math.ceil(rej.retry_after_s)))})


class EngineGone(Exception):
    """The engine failed while answering (the reason is the message)."""


class ClientLeft(ConnectionError):
    """Writing to the client failed: it went away.  Not an aiohttp
    ClientError (aiohttp raises its ClientConnectionResetError, one, for a
    write to a closing server-side transport too), so that nothing takes
    a client leaving for the engine failing."""


@dataclass
class StreamTiming:
    """When the content chunks of a streamed answer came."""

    first_at: float | None = None
    last_at: float | None = None
    chunks: int = 0
    done: bool = False   # the engine sent [DONE]
    usage: dict | None = field(default=None)
    # Gaps between consecutive content chunks, oldest first.
    intervals: list[float] = field(default_factory=list)

    def saw(self, line: bytes, now: float) -> None:
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if isinstance(event, dict) and event.get("usage"):
            self.usage = event["usage"]
        if _has_content(event):
            if self.last_at is not None:
                self.intervals.append(now - self.last_at)
            self.first_at = self.first_at if self.first_at is not None else now
            self.last_at = now
            self.chunks += 1

    def mean_interval_s(self) -> float | None:
        if self.chunks < 2 or self.first_at is None or self.last_at is None:
            return None
        return (self.last_at - self.first_at) / (self.chunks - 1)

    def median_interval_s(self) -> float | None:
        """The median gap between content chunks: the engine's bare decode
        step, which the few gaps a prefill chunk shared a step with do not
        move (the mean counts them)."""
        if not self.intervals:
            return None
        return statistics.median(self.intervals)


def _has_content(event) -> bool:
    if not isinstance(event, dict):
        return False
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if isinstance(delta, dict) and any(delta.get(k) for k in
                                           ("content", "reasoning_content", "reasoning",
                                            "tool_calls")):
            return True
    return False


def _usage_of(answer: bytes) -> dict | None:
    """The ``usage`` of a whole (non-streamed) OpenAI answer, if it has one."""
    try:
        usage = orjson.loads(answer).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def _max_tokens(body: dict) -> int | None:
    """The most tokens a request asks to generate (OpenAI's
    ``max_completion_tokens``, or the older ``max_tokens``); None when it
    states no positive whole number (the engine judges a bad one)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _cached_tokens(usage: dict | None) -> int | None:
    """The engine's own count of prompt tokens it reused (vLLM reports it with
    --enable-prompt-tokens-details), or None where it did not say."""
    details = (usage or {}).get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if type(cached) is int else None


def _completion_tokens(usage: dict | None, default: int) -> int:
    """The tokens the engine says it generated, else ``default``."""
    tokens = (usage or {}).get("completion_tokens")
    return tokens if type(tokens) is int else default


@dataclass
class ProxiedRequest:
    """One request on its way through an engine, as the metrics count it."""

    decision: EngineDecision
    prompt_tokens: int
    started_at: float     # time.monotonic() when the conductor received it
    scheduled_at: float   # ... when it was booked at its engine (after tokenizing)
    # Requests past their first token at the engine then (for the debug log).
    decoding_at_send: int = 0


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class EngineProxy:
    def __init__(self, fleet: EngineFleet, scheduler: EngineScheduler,
                 session: aiohttp.ClientSession, max_request_bytes: int,
                 metrics: ConductorMetrics) -> None:
        self.fleet = fleet
        self.scheduler = scheduler
        self.session = session
        self.max_request_bytes = max_request_bytes
        self.metrics = metrics
        # A generation may run for minutes: only connecting is bounded (the
        # fleet's polls and _watched notice an engine that stops answering).
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        self.call_timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S,
                                                  sock_connect=CONNECT_TIMEOUT_S)

    # ---- routes --------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/completions", chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/chat/completions", chat=True)

    async def models(self, request: web.Request) -> web.Response:
        seen: dict[str, dict] = {}
        for engine in self.fleet.live():
            try:
                async with self.session.get(engine.spec.url + "/v1/models",
                                            timeout=self.call_timeout) as resp:
                    answer = await resp.json() if resp.status == 200 else {}
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue   # the fleet's poll decides whether it is down
            for card in answer.get("data") or ():
                if isinstance(card, dict) and "id" in card:
                    seen.setdefault(card["id"], card)
        return json_response({"object": "list", "data": list(seen.values())})

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """POST /tokenize, /detokenize: answered by a live engine serving the model."""
        body = await read_json(request, self.max_request_bytes)
        for engine in self._candidates(body):
            try:
                status, answer = await self._post_json(engine, request.path, body)
            except EngineGone:
                continue
            return web.Response(body=answer, status=status, content_type="application/json")
        raise ApiError(503, "no engine serving the model is up; retry later",
                       headers={"Retry-After": "1"})

    # ---- one generation ------------------------------------------------
    def _candidates(self, body) -> list[Engine]:
        live = self.fleet.live()
        if not live:
            raise ApiError(503, "no engine is up; retry later", code="no_engine",
                           headers={"Retry-After": "1"})
        model = body.get("model") if isinstance(body, dict) else None
        engines = [e for e in live if model is None or e.model == model]
        if not engines:
            served = sorted({e.model for e in live})
            raise ApiError(404, f"The model `{model}` does not exist; served: {served}",
                           param="model", code="model_not_found")
        return engines

    @staticmethod
    def _fitting(candidates: list[Engine], prompt_tokens: int, chat: bool) -> list[Engine]:
        """The candidates whose context holds a prompt of ``prompt_tokens``
        and at least one completion token; a 400 when none does.  Without
        this a prompt too long for every engine would be priced like any
        other and, its predicted TTFT over the SLO, answered 429 with a
        Retry-After: a client would retry for ever what no engine can take.
        ``max_tokens`` is the engine's to judge (vLLM caps it at the room
        left rather than refusing)."""
        fitting = [e for e in candidates
                   if e.max_model_len is None or prompt_tokens < e.max_model_len]
        if not fitting:
            raise context_length_error(max(e.max_model_len for e in candidates), prompt_tokens,
                                       None, "messages" if chat else "prompt")
        return fitting

    async def _post_json(self, engine: Engine, path: str, body: dict) -> tuple[int, bytes]:
        try:
            async with self.session.post(engine.spec.url + path, json=body,
                                         timeout=self.call_timeout) as resp:
                return resp.status, await resp.content.read(MAX_ERROR_BYTES)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            await self.fleet.mark_dead(engine.name, f"POST {path}: {type(exc).__name__}: {exc}")
            raise EngineGone(str(exc)) from None

    async def _tokenize(self, body: dict, chat: bool,
                        in_thread: bool = False) -> tuple[list[int], int]:
        """(token ids routed on, prompt tokens in all): the first prompt of a
        batch is routed on and the others counted as long as it.
        ``in_thread``: a local tokenizer runs in a worker thread (a long
        prompt takes milliseconds, which on the event loop delay every
        other request's proxying)."""
        async def local_call(fn, arg):
            return await asyncio.to_thread(fn, arg) if in_thread else fn(arg)

        candidates = self._candidates(body)
        local = next((e.tokenizer for e in candidates if e.tokenizer is not None), None)
        if chat:
            ask = {"model": body.get("model"), "messages": body.get("messages")}
            ask.update({k: body[k] for k in CHAT_TOKENIZE_KEYS if k in body})
            if local is not None and len(ask) == 2:   # no template options
                tokens = await local_call(local.chat_tokens, ask["messages"])
                if tokens is not None:
                    return tokens, len(tokens)
            batch = 1
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return prompt, len(prompt)
            if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
                return prompt[0], sum(len(p) for p in prompt)
            batch = len(prompt) if isinstance(prompt, list) and prompt else 1
            first = prompt[0] if isinstance(prompt, list) and prompt else prompt
            ask = {"model": body.get("model"), "prompt": first}
            if "add_special_tokens" in body:
                ask["add_special_tokens"] = body["add_special_tokens"]
            elif local is not None and isinstance(first, str):
                tokens = await local_call(local.prompt_tokens, first)
                return tokens, len(tokens) * batch
        # The least loaded engine tokenizes: a round trip to a busy one
        # delays the first token, and one engine taking them all gets busy.
        for engine in sorted(candidates, key=lambda e: self.scheduler.load_of(e.name)):
            try:
                status, answer = await self._post_json(engine, "/tokenize", ask)
            except EngineGone:
                continue
            if status != 200:
                raise _engine_error(status, answer)
            try:
                tokens = orjson.loads(answer)["tokens"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                raise ApiError(502, f"engine {engine.name}: unexpected /tokenize answer") from None
            return tokens, len(tokens) * batch
        raise ApiError(503, "no engine is up; retry later", headers={"Retry-After": "1"})

    async def _generate(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        started_at = time.monotonic()
        body = await read_json(request, self.max_request_bytes)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        raw = orjson.dumps(body)
        tokens, prompt_tokens = await self._tokenize(
            body, chat, in_thread=(request.content_length or 0) > TOKENIZE_IN_THREAD_BYTES)
        if prompt_tokens == 0:
            raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt")
        streamed = bool(body.get("stream"))
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        for attempt in range(1, MAX_ATTEMPTS + 1):
            candidates = self._fitting(self._candidates(body), len(tokens) or prompt_tokens,
                                       chat)
            index = self.fleet.registry.index
            hits = index.prefix_tokens_per_instance(tokens, candidates[0].model) if tokens else {}
            block_size = candidates[0].block_size or 0
            keys = block_keys(tokens, block_size) if tokens and block_size else []
            scheduled_at = time.monotonic()
            decision = self.scheduler.schedule(request_id, prompt_tokens, hits, scheduled_at,
                                               streamed=streamed,
                                               among={e.name for e in candidates},
                                               block_keys=keys, block_size=block_size,
                                               cached_blocks={e.name: self.fleet.cached_blocks(e)
                                                              for e in candidates},
                                               max_tokens=_max_tokens(body))
            if isinstance(decision, Rejection):
                self.metrics.rejected(decision.reason)
                error = rejection_error(decision)
                log.info("%s %d %s (%d prompt tokens)", request_id, error.status, error.message,
                         prompt_tokens)
                raise error
            engine = self.fleet.engines[decision.engine]

            async def send() -> aiohttp.ClientResponse:
                return await self.session.post(engine.spec.url + path, data=raw,
                                               timeout=self.timeout,
                                               headers=_forwarded_headers(request))

            try:
                # Until the engine's answer starts (a whole answer: until it
                # ends), a client leaving or the engine dying must be noticed.
                upstream = await self._watched(request, engine, send())
            except asyncio.CancelledError:
                self.scheduler.on_failed(engine.name, request_id, time.monotonic())
                self._count(engine.name, "cancelled", started_at, 0)
                raise
            except EngineGone as exc:
                # Nothing was answered: the request may go to another engine.
                self.scheduler.on_failed(engine.name, request_id, time.monotonic())
                await self.fleet.mark_dead(engine.name, f"POST {path}: {exc}")
                if attempt == MAX_ATTEMPTS:
                    self._count(engine.name, "error", started_at, 0)
                    raise ApiError(502, f"engine {engine.name} failed before answering: "
                                        f"{exc}") from None
                continue
            proxied = ProxiedRequest(decision, prompt_tokens, started_at, scheduled_at)
            if log.isEnabledFor(logging.DEBUG):
                state = self.scheduler.engines[engine.name]
                proxied.decoding_at_send = state.ours_decoding() + state.foreign_running
            try:
                return await self._answer(request, upstream, engine, proxied, streamed)
            finally:
                upstream.release()
        raise AssertionError("unreachable")

    def _count(self, engine: str, status: str, started_at: float, tokens: int) -> None:
        self.metrics.engine_finished(engine, status, time.monotonic() - started_at, tokens)

    def _first_token(self, proxied: ProxiedRequest, at: float | None, usage: dict | None,
                     timing: StreamTiming | None = None) -> None:
        """Count a request's first token: its TTFT against the prediction
        (``at`` None: not seen, a whole answer), and its prefix hit (the
        engine's count where its usage says, else the index's match it was
        routed on).  Called once per request, when its answer ended."""
        cached = _cached_tokens(usage)
        d = proxied.decision
        if at is not None and log.isEnabledFor(logging.DEBUG):
            # What the prediction was made of against what happened.
            log.debug("%s at %s: TTFT %.1f ms (%.1f tokenizing), predicted %.1f (queue %.1f "
                      "(start %.1f) + prefill %.1f (x%.2f, busy level %d) + residual); "
                      "%d prompt tokens, %d predicted "
                      "cached, %s reported; %d decoding there when sent (%d pushed over the "
                      "TBT SLO); TBT predicted %.1f, "
                      "intervals mean %.1f median %.1f over %d; among %s",
                      d.request_id, d.engine,
                      (at - proxied.started_at) * 1e3,
                      (proxied.scheduled_at - proxied.started_at) * 1e3,
                      d.predicted_ttft_s * 1e3, d.t_queue * 1e3, d.t_start * 1e3,
                      d.t_prefill * 1e3, d.slowdown, d.busy_level,
                      proxied.prompt_tokens, d.prefix_tokens, cached, proxied.decoding_at_send,
                      d.tbt_misses, d.predicted_tbt_s * 1e3,
                      (timing.mean_interval_s() or 0.0) * 1e3 if timing else 0.0,
                      (timing.median_interval_s() or 0.0) * 1e3 if timing else 0.0,
                      len(timing.intervals) if timing else 0,
                      ", ".join(f"{e} (cached {p}, TTFT {t * 1e3:.1f}, cost {c * 1e3:.1f})"
                                for e, p, t, c in d.candidates))
        self.metrics.engine_first_token(
            at - proxied.started_at if at is not None else None,
            proxied.decision.predicted_ttft_s, proxied.prompt_tokens,
            cached if cached is not None else proxied.decision.prefix_tokens)

    async def _answer(self, request: web.Request, upstream: aiohttp.ClientResponse,
                      engine: Engine, proxied: ProxiedRequest,
                      streamed: bool) -> web.StreamResponse:
        decision = proxied.decision
        rid, name = decision.request_id, engine.name
        headers = {"x-request-id": rid, "x-mooncaked-engine": name,
                   "x-mooncaked-predicted-ttft-ms": f"{decision.predicted_ttft_s * 1000:.1f}",
                   "x-mooncaked-cached-tokens": str(decision.prefix_tokens)}
        if upstream.status != 200:
            self.scheduler.on_failed(name, rid, time.monotonic())
            self._count(name, "error", proxied.started_at, 0)
            raise _engine_error(upstream.status, await upstream.content.read(MAX_ERROR_BYTES))
        if not streamed or not upstream.content_type.startswith("text/event-stream"):
            try:
                answer = await self._watched(request, engine, upstream.read())
            except EngineGone as exc:
                self.scheduler.on_failed(name, rid, time.monotonic())
                self._count(name, "error", proxied.started_at, 0)
                await self.fleet.mark_dead(name, str(exc))
                raise ApiError(502, f"engine {name} failed while answering: {exc}") from None
            except asyncio.CancelledError:
                self.scheduler.on_failed(name, rid, time.monotonic())
                self._count(name, "cancelled", proxied.started_at, 0)
                upstream.close()   # the engine aborts the request
                raise
            now = time.monotonic()
            self.scheduler.on_finished(name, rid, now)
            usage = _usage_of(answer)
            self._first_token(proxied, None, usage)
            self._count(name, "ok", proxied.started_at, _completion_tokens(usage, 0))
            return web.Response(body=answer, headers=headers,
                                content_type=upstream.content_type or "application/json")
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        timing = StreamTiming()
        try:
            await self._watched(request, engine, self._relay(upstream, resp, timing, proxied))
        except asyncio.CancelledError:   # the client went away (or the handler was cancelled)
            self.scheduler.on_failed(name, rid, time.monotonic())
            self._stream_ended(name, proxied, timing, "cancelled")
            upstream.close()
            log.info("%s: client went away mid-stream; engine request closed", rid)
            raise
        except (EngineGone, ConnectionError) as exc:
            self.scheduler.on_failed(name, rid, time.monotonic())
            upstream.close()
            if isinstance(exc, ConnectionError):   # writing to a client that left
                self._stream_ended(name, proxied, timing, "cancelled")
                log.info("%s: client went away mid-stream; engine request closed", rid)
                return resp
            self._stream_ended(name, proxied, timing, "error")
            await self.fleet.mark_dead(name, str(exc))
            message = f"engine {name} failed mid-stream: {exc}; retry the request"
            try:
                await resp.write(b"data: " + orjson.dumps(
                    {"error": error_body(502, message, code="engine_failed")["error"]}) + b"\n\n")
                await resp.write(DONE)
            except ConnectionError:
                pass
            return resp
        self.scheduler.on_finished(name, rid, time.monotonic(), timing.mean_interval_s(),
                                   timing.chunks, timing.median_interval_s())
        self._stream_ended(name, proxied, timing, "ok")
        return resp

    def _stream_ended(self, engine: str, proxied: ProxiedRequest, timing: StreamTiming,
                      status: str) -> None:
        """Count a stream once it ended: its first token (the usage, which
        says what the engine reused, comes last), its token gaps, its end."""
        if timing.first_at is not None:
            self._first_token(proxied, timing.first_at, timing.usage, timing)
        for gap in timing.intervals:
            self.metrics.tbt.observe(gap)
        self._count(engine, status, proxied.started_at,
                    _completion_tokens(timing.usage, timing.chunks))

    async def _relay(self, upstream: aiohttp.ClientResponse, resp: web.StreamResponse,
                     timing: StreamTiming, proxied: ProxiedRequest) -> None:
        """Pass the engine's bytes on as they come, one write per read: an
        SSE event is two lines (its data and a blank one), and the last
        token, the usage and [DONE] often come together, so a write per line
        would cost this loop, the client and the core they share several
        syscalls and wake-ups per token.  Complete lines are parsed for
        StreamTiming (first content chunk reported at once).  A read that
        fails is the engine's failure (EngineGone), a write that fails the
        client's (ClientLeft)."""
        partial = b""   # the start of a line whose end has not come yet
        now = time.monotonic()
        while True:   # one read per turn, until the engine's stream ends
            try:
                data = await upstream.content.readany()
            except (aiohttp.ClientError, OSError) as exc:
                raise EngineGone(f"{type(exc).__name__}: {exc}") from None
            if not data:
                break
            now = time.monotonic()
            had_first, had_chunks = timing.first_at is not None, timing.chunks
            *lines, partial = (partial + data).split(b"\n")
            if len(partial) > MAX_SSE_LINE_BYTES:
                raise EngineGone(f"an SSE line longer than {MAX_SSE_LINE_BYTES} bytes")
            for line in lines:
                timing.saw(line, now)
            if timing.chunks != had_chunks:
                # How far its decode is: when it frees its KV blocks there.
                decision = proxied.decision
                if not had_first:
                    self.scheduler.on_first_token(decision.engine, decision.request_id, now)
                self.scheduler.on_tokens(decision.engine, decision.request_id, timing.chunks)
            try:
                await resp.write(data)
            except ConnectionError as exc:
                raise ClientLeft(f"{type(exc).__name__}: {exc}") from None
        if partial:
            timing.saw(partial, now)   # a last line without its newline
        if not timing.done:
            raise EngineGone("the stream ended without [DONE]")

    async def _watched(self, request: web.Request, engine: Engine, work):
        """Run ``work``; cancel it when the client goes away (CancelledError)
        or the fleet finds the engine dead (EngineGone).  A waiting request
        notices either within WATCH_S."""
        task = asyncio.ensure_future(work)
        try:
            while True:   # ends with the work, the client or the engine
                done, _ = await asyncio.wait({task}, timeout=WATCH_S)
                if done:
                    try:
                        return task.result()
                    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                        # Reaching the engine or reading its answer failed.
                        raise EngineGone(f"{type(exc).__name__}: {exc}") from None
                if _client_gone(request):
                    raise asyncio.CancelledError()
                if not engine.alive:
                    raise EngineGone(f"the engine stopped answering: {engine.last_error}")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


def _forwarded_headers(request: web.Request) -> dict[str, str]:
    out = {"Content-Type": "application/json"}
    for name in ("Authorization", "Accept", "X-Request-Id"):
        if name in request.headers:
            out[name] = request.headers[name]
    return out


def _engine_error(status: int, body: bytes) -> ApiError:
    """An engine's error answer, passed on with its status and message."""
    try:
        err = orjson.loads(body)["error"]
        message = err.get("message") or str(err) if isinstance(err, dict) else str(err)
        param = err.get("param") if isinstance(err, dict) else None
        code = err.get("code") if isinstance(err, dict) else None
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message, param, code = body[:500].decode("utf-8", "replace") or f"HTTP {status}", None, None
    return ApiError(status, message, param=param,
                    code=str(code) if code is not None and not isinstance(code, str) else code)


ENGINE_PROXY = web.AppKey("engine_proxy", EngineProxy)


def add_engine_proxy_routes(app: web.Application) -> None:
    """The OpenAI routes, answered by the engines (app[ENGINE_PROXY], set at start-up)."""

    def route(method: str):
        async def handler(request: web.Request) -> web.StreamResponse:
            proxy = request.app.get(ENGINE_PROXY)
            if proxy is None:
                raise ApiError(503, "the engine proxy is not ready yet; retry shortly",
                               headers={"Retry-After": "1"})
            return await getattr(proxy, method)(request)
        return handler

    app.router.add_post("/v1/completions", route("completions"))
    app.router.add_post("/v1/chat/completions", route("chat"))
    app.router.add_get("/v1/models", route("models"))
    app.router.add_post("/tokenize", route("passthrough"))
    app.router.add_post("/detokenize", route("passthrough"))


def setup_engine_proxy(app: web.Application, ctx: NodeContext, prefill_prior: PrefillEstimator,
                       decode_prior: DecodeEstimator,
                       metrics: ConductorMetrics | None = None) -> None:
    """Serve the OpenAI routes from ``conductor.engines``: the fleet and the
    proxy live as long as the app (after engines_ctx, whose registry they
    use); the scheduler's learned state goes to /admin/status as "engines".
    The prefill and decode priors are the conductor's own nodes' (forked per
    engine and refitted on what each engine does)."""
    section = ctx.config.conductor
    try:
        specs = [EngineSpec.parse(s) for s in section.engines]
    except EngineSpecError as exc:
        raise StartupError(str(exc)) from None
    scheduler = EngineScheduler(scheduler_config(section), prefill_prior, decode_prior)
    metrics = metrics if metrics is not None else ConductorMetrics(ctx.metrics)

    async def proxy_ctx(app: web.Application):
        session = aiohttp.ClientSession()
        fleet = EngineFleet(specs, app[ENGINES], scheduler, session)
        fleet.start()
        app[ENGINE_PROXY] = EngineProxy(fleet, scheduler, session, section.max_request_bytes,
                                        metrics)
        ctx.status_providers["engines"] = lambda: {
            "fleet": fleet.status(), **scheduler.status(time.monotonic())}
        yield
        await fleet.close()
        await session.close()

    app.cleanup_ctx.append(proxy_ctx)
    add_engine_proxy_routes(app)
