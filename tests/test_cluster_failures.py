"""Real failures on a real cluster: kill -9 a prefill node mid-prefill and a
decode node mid-decode; the client gets a clear error in bounded time, the
survivors keep serving and nothing stays pinned or reserved."""

from __future__ import annotations

import json
import time

import pytest

from tests.cluster_helpers import complete, leaked, stream_lines, tokens
from tests.nodes import get_json, wait_until

pytestmark = pytest.mark.slow  # real local clusters (node processes)

# The default dummy model: slow enough on CPU that a long prefill is still
# running when the node is killed.
MODEL = "dummy"


@pytest.fixture
def cluster(local_cluster):
    # Long prefills on purpose (faults strike mid-prefill): a TTFT SLO they fit in.
    return local_cluster(prefill=2, decode=2, model=MODEL,
                         extra=["store.capacity_bytes=134217728", "model.prefill_chunk=512",
                                "conductor.ttft_slo_s=120"])


def peers_alive(cluster) -> set[str]:
    return {p["node_id"] for p in get_json(cluster.url + "/admin/status")[1]["peers"]}


def test_kill_prefill_node_mid_prefill(cluster):
    import threading

    result: dict = {}

    def send() -> None:
        t0 = time.monotonic()
        result["status"], result["body"] = complete(cluster.url, tokens(6000, seed=1), max_tokens=4,
                                                    model=MODEL)
        result["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=send)
    thread.start()
    prefill_nodes = [c for c in cluster.children if c.role == "prefill"]

    def running_on():
        for node in prefill_nodes:
            status = get_json(node.url + "/admin/status")[1]
            if status.get("prefill", {}).get("queue_len"):
                return node
        return None

    victim = wait_until(running_on, 30, interval=0.01, what="a prefill to start")
    victim.proc.kill()
    victim.proc.wait()
    thread.join(timeout=60)
    assert not thread.is_alive()
    if result["status"] != 200:  # the usual case: the prefill was cut short
        assert result["status"] == 502
        assert "prefill failed" in result["body"]["error"]["message"]
    # The decode node's reservation was released by the conductor.
    wait_until(lambda: not leaked(cluster), 15, what="reservations released")
    wait_until(lambda: victim.name not in peers_alive(cluster), 10, what="victim marked dead")
    status, body = complete(cluster.url, tokens(300, seed=2), max_tokens=4, model=MODEL)
    assert status == 200, body
    assert not leaked(cluster)


def test_kill_decode_node_mid_decode(cluster):
    body = {"model": MODEL, "prompt": tokens(200, seed=3), "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    resp = stream_lines(cluster.url, body, timeout=60)
    decode_node = resp.headers["x-mooncaked-decode-node"]
    victim = next(c for c in cluster.children if c.name == decode_node)
    t_kill = None
    events = []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        events.append(line[6:])
        if len(events) == 3:
            victim.proc.kill()
            t_kill = time.monotonic()
        if line == "data: [DONE]":
            break
    ended_after = time.monotonic() - t_kill
    assert ended_after < 30
    errors = [json.loads(e) for e in events if e.startswith("{") and '"error"' in e]
    assert errors and "decode" in errors[0]["error"]["message"]
    victim.proc.wait()
    wait_until(lambda: victim.name not in peers_alive(cluster), 10, what="decode node marked dead")
    status, body = complete(cluster.url, tokens(100, seed=4), max_tokens=5, model=MODEL)
    assert status == 200, body
    wait_until(lambda: not leaked(cluster), 10, what="prefill pins released")


def test_reservations_outlive_a_long_prefill_queue_but_not_their_owner(local_cluster):
    from concurrent.futures import ThreadPoolExecutor

    from tests.nodes import post_json

    c = local_cluster(prefill=1, decode=1, model=MODEL,
                      extra=["decode.reservation_timeout_s=1", "model.prefill_chunk=512",
                             "store.capacity_bytes=134217728", "conductor.ttft_slo_s=120"])
    # Four 2k-token prompts queue at one prefill node for well over the
    # 1 s reservation timeout: the conductor keeps their reservations alive.
    prompts = [tokens(2048, seed=20 + i) for i in range(4)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda p: complete(c.url, p, max_tokens=3, model=MODEL), prompts))
    assert [s for s, _ in results] == [200] * 4, results
    # A reservation nobody owns (no conductor touching it) expires.
    decode = next(ch for ch in c.children if ch.role == "decode")
    status, _ = post_json(decode.url + "/internal/decode/reserve",
                          {"request_id": "orphan", "total_tokens": 64})
    assert status == 200
    wait_until(lambda: not leaked(c), 10, what="the orphan reservation to expire")


def test_conductor_restart_nodes_rejoin_and_cache_index_is_rebuilt(local_cluster):
    c = local_cluster(prefill=1, decode=1, model="tiny")
    prompt = tokens(64, seed=9)
    assert complete(c.url, prompt, max_tokens=2, model="tiny")[0] == 200
    old = c.children[0]
    old.proc.kill()  # kill -9: nodes get no goodbye
    old.proc.wait()
    c.restart_conductor()
    wait_until(lambda: len(peers_alive(c)) == 2, 20, what="nodes to re-register")
    # The new conductor rebuilds its cache index from the nodes' snapshots,
    # so the repeated prompt is scheduled with its cached prefix again.
    def cached() -> int:
        status, body = complete(c.url, prompt, max_tokens=2, model="tiny")
        assert status == 200, body
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert wait_until(lambda: cached() == 48, 10, interval=0.3, what="index rebuilt")
    assert not leaked(c)


def test_failed_prefix_fetch_falls_back_to_recompute(local_cluster):
    from tests.cluster_helpers import ADMIN, reference_greedy, trace_of
    from tests.nodes import post_json

    c = local_cluster(prefill=2, decode=1, model="tiny",
                      extra=["node.heartbeat_timeout_s=5", "node.heartbeat_interval_s=0.2"])
    shared = tokens(96, seed=31)
    status, body = complete(c.url, shared + tokens(8, seed=1), max_tokens=2, model="tiny")
    assert status == 200
    holder_name = trace_of(c.url, body)["prefill_node"]
    holder = next(ch for ch in c.children if ch.name == holder_name)
    post_json(holder.url + "/admin/drain", {}, ADMIN)
    wait_until(lambda: get_json(c.url + "/admin/status")[1]["scheduler"]["prefill"]
               [holder_name]["accepting"] is False, 5, what="the drain to be seen")
    holder.proc.kill()  # the conductor still believes it holds the prefix
    holder.proc.wait()
    prompt = shared + tokens(8, seed=2)
    status, body = complete(c.url, prompt, max_tokens=4, model="tiny")
    assert status == 200, body
    trace = trace_of(c.url, body)
    assert trace["transfer_planned_from"] == holder_name
    assert trace["fetch_failed"] and trace["fetched_tokens"] == 0
    assert trace["output_token_ids"] == reference_greedy("tiny", prompt, 4)
    wait_until(lambda: not leaked(c), 10, what="nothing pinned after the failed fetch")
