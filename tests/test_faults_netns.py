"""Fault matrix, network rows: every node in its own network namespace
(tests/fault_rig.py: one veth each to a bridge), so HTTP and KV transfers
cross namespaces, never loopback.

- a prefill node partitioned (``ip link set down``: no FIN, no RST) while its
  prefill computes, and while its KV is on the wire to the decode node: the
  client gets a clear error once membership declares the node dead; the
  decode reservation (and any page a half-received WRITE held) is freed
  while the partition lasts; the survivors serve with the quiet reference's
  tokens; the node rejoins when its link comes back;
- 5% packet loss on the transfer path (iptables ``statistic`` DROP rules on
  every worker's egress, for the transfer port: the KV data one way, its
  ACKs the other): requests complete with the quiet reference's tokens,
  nothing is left behind; the time per request with and without loss;
- 5% loss and 20 ms delay (``tc netem``) on every worker's egress: the same.

Needs root and ``ip netns``; the iptables row also iptables, the netem row
``sch_netem`` (some kernels lack it, and nothing else here can delay
packets); skipped otherwise, with the reason.
"""

from __future__ import annotations

import time

import pytest

from model.config import DUMMY_CONFIGS, RuntimeConfig, page_layout
from tests.cluster_helpers import complete, tokens
from tests.fault_rig import (NetnsCluster, NetnsRig, iptables_unusable, netns_unusable,
                             qdisc_unusable, reference, report, wait_nothing_left)

pytestmark = [pytest.mark.netns, pytest.mark.slow]

# Slow enough on CPU that a 3k-token prefill is still running when the link goes.
MODEL = "dummy"
# Every node listens for KV transfers on this port (one NIC each; each node
# has its own namespace), so the loss rule can single out the transfer path.
TRANSFER_PORT = 9000
# Long prefills on purpose (a fault must strike mid-prefill), so a TTFT SLO
# they fit in: at the interactive default they would be refused up front.
OVERRIDES = ["conductor.ttft_slo_s=120", "conductor.tbt_slo_ms=10000", "store.capacity_bytes=134217728", "store.block_size=16", "model.prefill_chunk=256",
             "node.heartbeat_interval_s=0.2", "node.heartbeat_timeout_s=1.5",
             "decode.reservation_timeout_s=5", "transfer.user_timeout_ms=1000",
             "transfer.stall_timeout_s=2", "transfer.connect_timeout_s=1",
             f"transfer.port={TRANSFER_PORT}"]
# The egress shaping of the two rows (tbf: a slow link; netem: a lossy one).
SLOW_EGRESS = ("tbf", "rate", "40mbit", "burst", "64kb", "latency", "400ms")
LOSS_AND_DELAY = ("netem", "loss", "5%", "delay", "20ms")
LOSS = 0.05
# The lossy rows: prompts whose KV (3.3 MB each, dummy model) takes
# thousands of packets to the decode node; sequential requests, so each
# one's time is its own.
LOSSY_PROMPT_TOKENS, LOSSY_OUTPUT_TOKENS, LOSSY_REQUESTS = 800, 8, 6
# dummy: 4 layers x K,V x 2 kv heads x 64 dims x the dtype's bytes per token,
# 3000 tokens; at 40 Mbit/s the second half is still on the wire well after
# compute ends.
HALF_THE_KV = 3000 * page_layout(DUMMY_CONFIGS["dummy"], 16,
                                 RuntimeConfig().dtype).kv_bytes_per_token // 2
# Client-side bound on any one request: far above the clear error we expect.
REQUEST_BOUND_S = 90


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = netns_unusable()
    if why:
        pytest.skip(f"netns fault rows skipped: {why}")
    rig = NetnsRig()
    try:
        c = NetnsCluster(rig, tmp_path_factory.mktemp("faults-netns"), MODEL, OVERRIDES)
        try:
            c.start(prefill=2, decode=1)
            yield c
        finally:
            c.stop()
    finally:
        rig.close()


def quiet_request_matches_reference(c: NetnsCluster, seed: int, n: int = 96, out: int = 6) -> None:
    prompt = tokens(n, seed=seed)
    status, body = c.call(complete, c.url, prompt, max_tokens=out, model=MODEL)
    assert status == 200, body
    trace = c.get(f"{c.url}/admin/requests/{body['id']}-0?tokens=1")[1]
    assert trace["output_token_ids"] == reference(MODEL, prompt, out)


def transfer_bytes(c: NetnsCluster, name: str) -> int:
    return sum(c.get(c.node(name).url + "/admin/status")[1]["transfer"]["path_bytes"].values())


@pytest.mark.parametrize("moment", ["mid-prefill", "mid-transfer"])
def test_prefill_node_partitioned(cluster, moment):
    c = cluster
    quiet_request_matches_reference(c, seed=100)  # both prefill nodes healthy
    prefill_names = [ch.name for ch in c.children if ch.role == "prefill"]
    before = {name: transfer_bytes(c, name) for name in prefill_names}
    if moment == "mid-transfer":
        # A slow egress, so the KV is still on the wire when the link goes.
        for name in prefill_names:
            c.rig.shape(name, *SLOW_EGRESS)
    prompt = tokens(3000, seed=101 if moment == "mid-prefill" else 102)
    t0 = time.monotonic()
    pending = c.submit(complete, c.url, prompt, max_tokens=4, model=MODEL)

    def victim() -> tuple[str, int] | None:
        for name in prefill_names:
            load = c.get(c.node(name).url + "/admin/status")[1]
            if not load["prefill"]["queue_len"]:
                continue
            moved = sum(load["transfer"]["path_bytes"].values()) - before[name]
            if moment == "mid-prefill" or moved > HALF_THE_KV:
                return name, moved
        return None

    deadline = time.monotonic() + 60
    while (found := victim()) is None:
        assert time.monotonic() < deadline and not pending.done(), "the prefill never started"
        time.sleep(0.01)
    name, moved = found
    c.rig.link(name, up=False)
    t_cut = time.monotonic()
    declared_dead = c.submit(c.wait_peers, set(c.worker_urls()) - {name}, 30)
    try:
        status, body = pending.result(timeout=REQUEST_BOUND_S)
        answered_s = time.monotonic() - t_cut
        if status != 200:  # the usual case: cut before it answered
            assert status == 502, body
            assert "dead" in body["error"]["message"] or "prefill" in body["error"]["message"], body
        # While the partition lasts: the victim is out, the survivors hold
        # nothing for the lost request, and they serve correct tokens.
        dead_s = declared_dead.result(timeout=30)  # seconds from the cut
        survivors = {n: u for n, u in c.worker_urls().items() if n != name}
        wait_nothing_left(survivors, 30, get=c.get)
        freed_s = time.monotonic() - t_cut
        for name_ in prefill_names:
            c.rig.shape(name_)  # no shaping for the quiet requests
        quiet_request_matches_reference(c, seed=103)
    finally:
        c.rig.link(name, up=True)
        for name_ in prefill_names:
            c.rig.shape(name_)
    rejoined_s = c.wait_peers(set(c.worker_urls()), 30)
    left_s = c.wait_nothing_left(30)
    quiet_request_matches_reference(c, seed=104)
    report(f"prefill partitioned {moment}", kv_bytes_moved_at_cut=moved, status=status,
           answered_after_cut_s=answered_s, declared_dead_after_cut_s=dead_s,
           survivors_clean_after_cut_s=freed_s, rejoined_after_link_up_s=rejoined_s,
           victim_clean_after_rejoin_s=left_s, request_total_s=time.monotonic() - t0)


def timed_requests(c: NetnsCluster, seeds: range) -> list[float]:
    """One request per seed, one after the other, each served with the
    reference's tokens; the seconds each took."""
    took = []
    for seed in seeds:
        prompt = tokens(LOSSY_PROMPT_TOKENS, seed=seed)
        t0 = time.monotonic()
        status, body = c.submit(complete, c.url, prompt, max_tokens=LOSSY_OUTPUT_TOKENS,
                                model=MODEL).result(timeout=REQUEST_BOUND_S)
        took.append(time.monotonic() - t0)
        assert status == 200, body
        trace = c.get(f"{c.url}/admin/requests/{body['id']}-0?tokens=1", timeout=10)[1]
        assert trace["output_token_ids"] == reference(MODEL, prompt, LOSSY_OUTPUT_TOKENS)
        assert trace["prefill_node"] != trace["decode_node"]  # the KV crossed the network
    return took


def retries(c: NetnsCluster, workers: list[str]) -> dict[str, int]:
    return {n: c.get(c.node(n).url + "/admin/status", timeout=10)[1]["transfer"]["retries"]
            for n in workers}


def per_request(took: list[float]) -> str:
    return f"mean {sum(took) / len(took):.2f} s, max {max(took):.2f} s"


def test_loss_on_the_transfer_path(cluster):
    why = iptables_unusable()
    if why:
        pytest.skip(f"iptables loss row skipped: {why}")
    c = cluster
    workers = [ch.name for ch in c.children[1:]]
    quiet = timed_requests(c, range(300, 303))
    retries_before = retries(c, workers)
    for name in workers:
        c.rig.drop_randomly(name, LOSS, [TRANSFER_PORT])
    try:
        lossy = timed_requests(c, range(310, 310 + LOSSY_REQUESTS))
        dropped = {n: c.rig.dropped_packets(n) for n in workers}
    finally:
        for name in workers:
            c.rig.stop_dropping(name)
    # The loss was on the path these requests took: packets of it were dropped.
    assert sum(dropped.values()) > 0, dropped
    left_s = c.wait_nothing_left(30)
    after = retries(c, workers)
    report("5% loss on the transfer path (iptables)", requests=len(lossy), all_ok=True,
           quiet_per_request=per_request(quiet), lossy_per_request=per_request(lossy),
           dropped_packets=dropped,
           transfer_retries={n: after[n] - retries_before[n] for n in workers},
           nothing_left_after_s=left_s)


def test_loss_and_delay_on_the_transfer_path(cluster):
    why = qdisc_unusable(*LOSS_AND_DELAY)
    if why:
        # Loss alone is covered by test_loss_on_the_transfer_path (iptables);
        # no other tool here can hold packets back for 20 ms.
        pytest.skip(f"20 ms delay row skipped (needs sch_netem): {why}")
    c = cluster
    workers = [ch.name for ch in c.children[1:]]
    quiet = timed_requests(c, range(200, 203))
    retries_before = retries(c, workers)
    for name in workers:
        c.rig.shape(name, *LOSS_AND_DELAY)
    try:
        lossy = timed_requests(c, range(210, 210 + LOSSY_REQUESTS))
    finally:
        for name in workers:
            c.rig.shape(name)
    left_s = c.wait_nothing_left(30)
    after = retries(c, workers)
    report("5% loss + 20 ms delay (netem)", requests=len(lossy), all_ok=True,
           quiet_per_request=per_request(quiet), lossy_per_request=per_request(lossy),
           transfer_retries={n: after[n] - retries_before[n] for n in workers},
           nothing_left_after_s=left_s)
