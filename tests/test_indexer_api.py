"""Mooncake's Indexer API (/register /unregister /query /query_by_hash) on our routes.

Bodies follow the examples of Mooncake's
docs/source/api-reference/http/conductor-indexer.md; the hash vectors are
computed here with xxhash directly, not with roles.engines.hashing.
"""

from __future__ import annotations

import asyncio

import pytest
import xxhash
import zmq.asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fixtures.fake_publisher import FakePublisher
from mooncaked.node.errors import error_middleware
from roles.engines.events import BlockStored, Frame, KVEventBatch, encode_batch
from roles.engines.hashing import standard_seq_hashes
from roles.engines.indexer_api import add_indexer_routes, engines_ctx

TOKENS = [101, 15, 100, 55, 89, 7, 3, 42]
BS = 4
SEED = 1337


def le_u32(tokens):
    return b"".join(t.to_bytes(4, "little") for t in tokens)


def xxh(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=SEED)


# seq[0] = local[0]; seq[1] = XXH3(le64(seq[0]) || le64(local[1]), 1337)
LOCAL = [xxh(le_u32(TOKENS[:4])), xxh(le_u32(TOKENS[4:]))]
SEQ = [LOCAL[0], xxh(LOCAL[0].to_bytes(8, "little") + LOCAL[1].to_bytes(8, "little"))]


def test_standard_hash_vectors():
    assert LOCAL == [1667876268580726115, 17769444240631287821]
    assert SEQ == [1667876268580726115, 15660154282014278234]
    assert standard_seq_hashes(TOKENS + [1], BS) == SEQ   # the partial block gets none
    assert standard_seq_hashes(TOKENS[4:], BS, parent=SEQ[0]) == SEQ[1:]


def registration(fake: FakePublisher, **over) -> dict:
    body = {"endpoint": fake.endpoint, "replay_endpoint": fake.replay_endpoint, "type": "vLLM",
            "modelname": "deepseek", "lora_name": "sql-adapter", "tenant_id": "default",
            "instance_id": "vllm-prefill-node1", "block_size": BS, "dp_rank": 0,
            "additionalsalt": "w8a8"}
    body.update(over)
    return body


def stored(hashes, tokens, medium):
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
                       block_size=BS, lora_id=None, medium=medium, lora_name=None)


@pytest.fixture()
async def api():
    app = web.Application(middlewares=[error_middleware])
    app.cleanup_ctx.append(engines_ctx(hash_seed=12345))
    add_indexer_routes(app)
    zctx = zmq.asyncio.Context()
    fake = FakePublisher(zctx)
    async with TestClient(TestServer(app)) as client:
        yield client, fake
    await fake.close()
    zctx.term()


async def post(client, path, body, status=200):
    resp = await client.post(path, json=body)
    data = await resp.json()
    assert resp.status == status, data
    return data


async def feed(client, fake):
    """Register, then publish: block 0 on GPU, blocks 0-1 offloaded to CPU."""
    assert await post(client, "/register", registration(fake)) == \
        {"status": "registered successfully", "instance_id": "vllm-prefill-node1"}
    await fake.wait_subscribed()
    batch = KVEventBatch(ts=1.0, data_parallel_rank=0, events=[
        stored([0xA], TOKENS[:4], "GPU"), stored([0xA, 0xB], TOKENS, "CPU")])
    await fake.send(Frame(b"", 0, encode_batch(batch)))
    for _ in range(3000):
        status = await (await client.get("/admin/engines")).json()
        if status["publishers"][0]["next_seq"] == 1:
            return status
        await asyncio.sleep(0.01)
    raise AssertionError(f"batch never applied: {status}")


QUERY = {"model": "deepseek", "lora_name": "sql-adapter", "tenant_id": "default",
         "instance_id": "vllm-prefill-node1", "block_size": BS, "cache_salt": "w8a8"}
HIT = {"default": {"vllm-prefill-node1": {"longest_matched": 8, "GPU": 4, "CPU": 8,
                                          "DP": {"0": 8}}}}


async def test_query_and_query_by_hash(api):
    client, fake = api
    await feed(client, fake)
    assert await post(client, "/query", {**QUERY, "token_ids": TOKENS + [1]}) == HIT
    # Every registered instance appears, even without a hit.
    miss = {"default": {"vllm-prefill-node1": {"longest_matched": 0, "GPU": 0, "DP": {"0": 0}}}}
    assert await post(client, "/query", {**QUERY, "token_ids": [1, 2, 3, 4]}) == miss
    by_hash = {k: v for k, v in QUERY.items()}
    assert await post(client, "/query_by_hash", {**by_hash, "seq_hashes": SEQ}) == HIT
    assert await post(client, "/query_by_hash", {**by_hash, "block_hash": SEQ[:1]}) == \
        {"default": {"vllm-prefill-node1": {"longest_matched": 4, "GPU": 4, "CPU": 4,
                                            "DP": {"0": 4}}}}
    # Another namespace (salt, LoRA, block size, tenant) never matches.
    for other in ({"cache_salt": ""}, {"lora_name": None}, {"block_size": 2},
                  {"tenant_id": "t2"}):
        body = {k: v for k, v in {**QUERY, "token_ids": TOKENS, **other}.items() if v is not None}
        answer = await post(client, "/query", body)
        assert all(row["longest_matched"] == 0 for rows in answer.values() for row in rows.values())
    # instance_id omitted: every instance of the tenant.
    body = {k: v for k, v in QUERY.items() if k != "instance_id"}
    assert await post(client, "/query", {**body, "token_ids": TOKENS}) == HIT


async def test_unregister(api):
    client, fake = api
    await feed(client, fake)
    assert await post(client, "/unregister", {
        "type": "vLLM", "modelname": "deepseek", "lora_name": "sql-adapter",
        "tenant_id": "default", "instance_id": "vllm-prefill-node1", "block_size": BS,
        "dp_rank": 0}) == {"status": "unregistered successfully",
                           "removed_instances": ["vllm-prefill-node1|default|0"]}
    assert await post(client, "/query", {**QUERY, "token_ids": TOKENS}) == {"default": {}}
    err = await post(client, "/unregister", {"instance_id": "vllm-prefill-node1"}, 404)
    assert err["error"]["param"] == "instance_id"


@pytest.mark.parametrize("path,body,param", [
    ("/register", {"block_size": None}, "block_size"),
    ("/register", {"block_size": 0}, "block_size"),
    ("/register", {"dp_rank": -1}, "dp_rank"),
    ("/register", {"type": "SGLang"}, "type"),
    ("/register", {"endpoint": "http://127.0.0.1:5557"}, "endpoint"),
    ("/register", {"modelname": ""}, "modelname"),
    ("/query", {"token_ids": [1, -2]}, "token_ids"),
    ("/query", {"token_ids": "1 2"}, "token_ids"),
    ("/query", {"token_ids": [1], "lora_id": 3}, "lora_id"),
    ("/query", {"token_ids": [1], "model": None}, "model"),
    ("/query_by_hash", {"seq_hashes": [1 << 64]}, "seq_hashes"),
    ("/query_by_hash", {"seq_hashes": [1], "block_hash": [1]}, "block_hash"),
    ("/query_by_hash", {}, "seq_hashes"),
])
async def test_bad_requests_name_the_field(api, path, body, param):
    client, fake = api
    base = registration(fake) if path == "/register" else dict(QUERY)
    full = {k: v for k, v in {**base, **body}.items() if v is not None}
    err = await post(client, path, full, 400)
    assert err["error"]["param"] == param, err


@pytest.mark.slow  # a conductor process
def test_the_conductor_serves_the_indexer_api(tmp_path):
    import signal

    import zmq

    from nodes import get_json, post_json, start_node

    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    node = start_node(tmp_path, "conductor")
    try:
        node.wait_ready()
        status, body = post_json(node.url + "/register", {
            "endpoint": f"tcp://127.0.0.1:{port}", "type": "vLLM", "modelname": "m",
            "instance_id": "e0", "block_size": BS, "dp_rank": 0})
        assert status == 200, body
        status, body = post_json(node.url + "/query", {"model": "m", "token_ids": TOKENS,
                                                       "block_size": BS})
        assert (status, body) == (200, {"default": {"e0": {"longest_matched": 0, "GPU": 0,
                                                           "DP": {"0": 0}}}})
        assert get_json(node.url + "/admin/engines")[1]["publishers"][0]["publisher"] == "e0|default|0"
        node.proc.send_signal(signal.SIGTERM)   # subscribers close with the app
        assert node.proc.wait(timeout=15) == 0
    finally:
        node.kill()
        pub.close(0)
