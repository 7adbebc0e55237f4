"""The paper's request workflow end to end on a real local cluster (issue 6).

One conductor, two prefill nodes and one decode node as separate processes
on loopback; the tiny dummy model; outputs checked against a single-process
oracle at temperature 0.
"""

from __future__ import annotations

import pytest

from tests.cluster_helpers import (ADMIN, complete, leaked, reference_greedy, running_cluster,
                                   stream_lines, tokens, trace_of)
from tests.nodes import get_json, post_json, wait_until

pytestmark = pytest.mark.slow  # real local clusters (node processes)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.mark.parametrize("length", [1, 15, 16, 33, 77])
def test_outputs_equal_single_process_reference(cluster, length):
    prompt = tokens(length, seed=length)
    expected = reference_greedy("tiny", prompt, 10)
    status, body = complete(cluster.url, prompt, max_tokens=10)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == length and body["usage"]["completion_tokens"] == 10
    assert trace_of(cluster.url, body)["output_token_ids"] == expected
    # Again: now with the prompt's full blocks cached somewhere; same tokens.
    status, again = complete(cluster.url, prompt, max_tokens=10)
    assert status == 200
    trace = trace_of(cluster.url, again)
    assert trace["output_token_ids"] == expected
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == trace["cached_tokens"]
    if length > 16:
        assert trace["cached_tokens"] == (length - 1) // 16 * 16


def test_prefix_fetched_from_peer_and_kv_streamed_per_layer(cluster):
    shared = tokens(96, seed=1000)  # 6 full blocks
    a = shared + tokens(20, seed=1)
    status, body = complete(cluster.url, a)
    assert status == 200
    holder = trace_of(cluster.url, body)["prefill_node"]
    other = next(c for c in cluster.children if c.role == "prefill" and c.name != holder)
    holder_url = next(c.url for c in cluster.children if c.name == holder)
    assert post_json(holder_url + "/admin/drain", {}, ADMIN)[0] == 200
    try:
        # The conductor learns of the drain from the next heartbeat.
        wait_until(lambda: get_json(cluster.url + "/admin/status")[1]["scheduler"]["prefill"]
                   [holder]["accepting"] is False, 5, what="the conductor to see the drain")
        b = shared + tokens(40, seed=2)
        status, body = complete(cluster.url, b, max_tokens=6)
        assert status == 200, body
        trace = trace_of(cluster.url, body)
        assert trace["prefill_node"] == other.name
        assert trace["transfer_planned_from"] == holder
        assert trace["fetched_tokens"] == 96 and trace["local_hit_tokens"] == 0
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        assert trace["output_token_ids"] == reference_greedy("tiny", b, 6)
        # Layer-wise streaming: the first layer's KV left for the decode node
        # while the prefill was still computing the rest.
        assert 0 < trace["first_layer_sent_s"] < trace["prefill_compute_s"]
        # The fetched blocks now live on the other node too (replication).
        _, metrics = get_json(other.url + "/admin/status")
        assert metrics["store"]["cached_blocks"] >= 6
    finally:
        post_json(holder_url + "/admin/undrain", {}, ADMIN)


def decode_status(cluster) -> dict:
    decode = next(c for c in cluster.children if c.role == "decode")
    return get_json(decode.url + "/admin/status")[1]["decode"]


def test_the_prefill_node_starts_the_decode_once_its_kv_has_landed(cluster):
    """The decode node starts from the prefill node's start (sent as soon as
    its KV WRITEs are acknowledged), not only from the conductor's, which
    attaches to it; the tokens are the oracle's either way."""
    before = decode_status(cluster)["started_by_prefill"]
    prompt = tokens(50, seed=4242)
    status, body = complete(cluster.url, prompt, max_tokens=7)
    assert status == 200, body
    trace = trace_of(cluster.url, body)
    assert trace["prefill_node"] != trace["decode_node"]
    assert trace["output_token_ids"] == reference_greedy("tiny", prompt, 7)
    # The counter is read from the node's load, which the request changed.
    assert decode_status(cluster)["started_by_prefill"] == before + 1
    wait_until(lambda: not leaked(cluster), 10, what="pages released")


def test_a_start_from_prefill_needs_the_reservation_and_its_capability(cluster):
    decode = next(c for c in cluster.children if c.role == "decode")
    start = {"request_id": "no-such-request", "prompt_len": 3, "first_token": 1}
    status, body = post_json(decode.url + "/internal/decode/start",
                             {"start": start, "capability": 7})
    assert status == 404, body
    status, body = post_json(decode.url + "/internal/decode/start", {"start": start})
    assert status == 400 and "decode.start.capability" in body["error"]["message"], body


def test_client_disconnect_frees_everything(cluster):
    body = {"model": "tiny", "prompt": tokens(40, seed=7), "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    resp = stream_lines(cluster.url, body)
    got = 0
    for line in resp:
        if line.startswith(b"data: {"):
            got += 1
        if got >= 3:
            break
    resp.close()  # the client goes away mid-stream
    wait_until(lambda: not leaked(cluster), 10, what="pages released after disconnect")
    _, reqs = get_json(cluster.url + "/admin/requests")
    assert reqs["requests"][0]["status"] == "cancelled"


def test_nothing_stays_pinned_after_requests(cluster):
    wait_until(lambda: not leaked(cluster), 10, what="no pinned or reserved pages")
    assert leaked(cluster) == {}


def test_concurrent_short_prompts_are_prefilled_in_batches(local_cluster):
    """Batched passes end to end.  With prefill.batch_within_predictions (the
    default) a request joins a pass only within the slack its predecessors'
    predicted TTFTs hold, which a burst on an idle cluster does not have
    (test_inproc_prefill.py covers that rule): this cluster batches by the
    token budget alone, on one prefill node that the whole burst queues on."""
    from concurrent.futures import ThreadPoolExecutor

    cluster = local_cluster(prefill=1, extra=["prefill.batch_within_predictions=false"])
    prompts = [tokens(18 + i, seed=300 + i) for i in range(8)]  # each fits one chunk (32)

    def status_batches() -> int:
        return sum(get_json(c.url + "/admin/status")[1]["prefill"]["batched_requests"]
                   for c in cluster.children if c.role == "prefill")

    before = status_batches()
    for _ in range(3):  # bounded: a burst usually queues several requests at once
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(lambda p: complete(cluster.url, p, max_tokens=4), prompts))
        for prompt, (status, body) in zip(prompts, results):
            assert status == 200, body
            assert trace_of(cluster.url, body)["output_token_ids"] == reference_greedy("tiny", prompt, 4)
        if status_batches() > before:
            break
    assert status_batches() > before


def test_colocated_node_matches_the_reference_too(local_cluster):
    colo = local_cluster(colocated=1)
    prompt = tokens(50, seed=11)
    expected = reference_greedy("tiny", prompt, 8)

    def streamed() -> int:
        node = next(c for c in colo.children if c.role == "colocated")
        return get_json(node.url + "/admin/status")[1]["decode"][
            "streamed_with_prefill"]

    for attempt in range(2):  # then with its own prefix cache
        before = streamed()
        status, body = complete(colo.url, prompt, max_tokens=8)
        assert status == 200, body
        trace = trace_of(colo.url, body)
        assert trace["prefill_node"] == trace["decode_node"] == "colocated-0"
        assert trace["output_token_ids"] == expected
        assert trace["cached_tokens"] == (0 if attempt == 0 else 48)
        # No reservation round trip: the node reserved its decode pages as it
        # took the prefill (PrefillRequest.reserve_here), and no DecodeStart
        # one: the tokens came on the prefill's own answer (stream_decode).
        assert trace["reserve_s"] == 0.0
        assert streamed() == before + 1
    # A first token that ends the request: the answer's stream is closed
    # unread, and the reservation goes with it.
    status, body = complete(colo.url, tokens(30, seed=13), max_tokens=1)
    assert status == 200, body
    assert trace_of(colo.url, body)["output_token_ids"] == reference_greedy(
        "tiny", tokens(30, seed=13), 1)
    wait_until(lambda: not leaked(colo), 10, what="pages released after a one-token reply")
    assert leaked(colo) == {}
    # A client gone mid-stream frees that reservation too.
    body = {"model": "tiny", "prompt": tokens(40, seed=12), "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    resp = stream_lines(colo.url, body)
    got = 0
    for line in resp:
        got += line.startswith(b"data: {")
        if got >= 3:
            break
    resp.close()
    wait_until(lambda: not leaked(colo), 10, what="pages released after disconnect")
