"""The etcd-backed cluster across "hosts": every process in a network namespace
of its own (tests/multihost_rig.py), started from the deployment files of
docs/DEPLOY.md, with a 3-member etcd, two conductors, two prefill nodes and a
decode node.

Each test makes one real failure, measures how long the cluster takes to get
over it (printed as ``MULTIHOST ...`` lines, the figures of docs/DEPLOY.md;
no timing asserts, only generous bounded waits) and ends checking that no
worker has a pinned block, private page, reservation or fenced page left:

1. the leading conductor killed (kill -9): the standby serves new requests
   (the printed time is about the lease TTL plus a round), and the killed one,
   restarted, rejoins as a standby;
2. one etcd member killed: the cluster keeps serving, not one request fails;
3. etcd unreachable (every member's link down) for longer than a lease: a
   stream already routed runs to its end, the conductors refuse new requests
   with a clear 503 and serve again by themselves once etcd is back;
4. a prefill node partitioned (its link down: no FIN) until its lease
   expires: the leader marks it dead and new requests are served by the
   other prefill node; back on the network it rejoins;
5. a rolling restart of every prefill node with ``POST /admin/drain`` while
   two bounded client loops (one through each conductor) keep sending
   requests: not one fails.

One rig serves the whole module; ``healed`` brings it back to the healthy
layout before each test.  Needs root, ``ip netns`` and the ``etcd`` binary;
skipped otherwise, with the reason.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.cluster_helpers import tokens
from tests.fault_rig import reference
from tests.nodes import wait_until
from tests.multihost_rig import (Answer, LoadLoop, MultiHostCluster, Stream, figure,
                                 multihost_cluster, multihost_unusable)

pytestmark = [pytest.mark.netns, pytest.mark.slow]

MODEL = "tiny"
# The guide's cluster, shrunk to a test run; everything else (ports, lease
# TTL, heartbeats, tokens, transport, policy) is as etc/deploy/ has it.
SCALE = ["store.capacity_bytes=16777216", "store.block_size=16", "model.prefill_chunk=32",
         "model.torch_threads=1", "decode.reservation_timeout_s=5"]
# Bound on any one wait for the cluster to get over a fault: far above the
# few seconds it takes, so that only a real hang fails a test.
BOUND_S = 60


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    why = multihost_unusable()
    if why:
        pytest.skip(f"multi-host etcd rig skipped: {why}")
    with multihost_cluster(tmp_path_factory.mktemp("multihost"), MODEL, SCALE) as cluster:
        yield cluster


@pytest.fixture
def c(rig: MultiHostCluster) -> MultiHostCluster:
    healed = rig.heal(BOUND_S)
    if healed > 1:
        print(f"\n(rig healed in {healed:.1f}s)")
    return rig


def served_right(c: MultiHostCluster, conductor: str, seed: int, n: int = 40,
                 max_tokens: int = 6) -> Answer:
    """A completion through ``conductor`` that must be served with the quiet
    reference's tokens (the trace is on whichever conductor leads)."""
    prompt = tokens(n, seed=seed)
    answer = c.completion(conductor, prompt, max_tokens)
    assert answer.status == 200, (conductor, answer)
    served_by = answer.headers.get("X-Mooncaked-Served-By", conductor)
    assert c.output_tokens(served_by, answer) == reference(MODEL, prompt, max_tokens)
    return answer


def first_served(c: MultiHostCluster, conductor: str, since: float, seed: int) -> float:
    """Seconds from ``since`` until a new request through ``conductor`` is served."""
    deadline = since + BOUND_S
    answer = None
    while time.monotonic() < deadline:
        answer = c.completion(conductor, tokens(40, seed=seed), 6, timeout=BOUND_S)
        if answer.status == 200:
            return time.monotonic() - since
        time.sleep(0.1)
    raise AssertionError(f"{conductor} served nothing within {BOUND_S}s: {answer}")


def idle(status: dict) -> bool:
    """A drained prefill node may stop: nothing queued or running, nothing pinned."""
    return status["prefill"]["queue_len"] == 0 and status["store"]["pinned_blocks"] == 0


def test_leader_conductor_killed(c):
    leader = c.wait_leader(BOUND_S)
    standby = next(n for n in c.conductor_names if n != leader)
    assert c.election(standby)["role"] == "standby"
    served_right(c, standby, seed=1)  # forwarded to the leader
    # A stream relayed by the standby when its leader dies: a clear error, then [DONE].
    relayed = Stream(c, standby, tokens(40, seed=5), max_tokens=3000, timeout_s=BOUND_S)
    assert relayed.first.wait(BOUND_S), "the relayed stream never started"
    c.nodes[leader].proc.kill()
    killed = time.monotonic()
    took = first_served(c, standby, killed, seed=2)
    events = relayed.result(BOUND_S)
    assert events[-1] == "[DONE]" and [e["code"] for e in relayed.errors()] == ["leader_failed"], \
        events[-3:]
    assert c.election(standby)["role"] == "leader"
    c.wait_workers_registered(BOUND_S)
    figure("leader conductor killed (kill -9)", standby_serves_s=took,
           workers_registered_s=time.monotonic() - killed, lease_ttl_s=c.lease_ttl_s)
    served_right(c, standby, seed=3)
    # The killed conductor, started again, stands by and forwards.
    back = c.restart(leader, BOUND_S)
    wait_until(lambda: c.election(leader).get("role") == "standby", BOUND_S,
               what="the old leader to stand by")
    served_right(c, leader, seed=4)
    figure("killed conductor restarted", ready_s=back)
    c.wait_nothing_left(BOUND_S)


def test_one_etcd_member_lost(c):
    leader = c.wait_leader(BOUND_S)
    # The worst member to lose: the raft leader (etcd answers nothing until the
    # other two have elected a new one); the first endpoint when none is known.
    victim = c.etcd_raft_leader() or c.etcd[0]
    loop = LoadLoop(c, lambda i: c.conductor_names[i % 2], requests=400,
                    prompt=lambda i: tokens(40, seed=1000 + i)).start()
    wait_until(lambda: len(loop.answers) >= 3, BOUND_S, what="the client loop to get going")
    victim.kill()
    killed = time.monotonic()
    # Long enough for every lease to be renewed through another member.
    time.sleep(2 * c.lease_ttl_s + 1)
    answers = loop.finish()
    assert len(answers) > 10, answers
    assert not loop.failed(), f"{len(loop.failed())} of {len(answers)} failed: {loop.failed()[:3]}"
    assert c.leader() == leader  # its lease was renewed elsewhere: no failover
    for name in c.conductor_names:
        assert c.election(name)["etcd_reachable"], c.election(name)
    assert c.alive_peers(leader) == set(c.worker_names)  # no record lost
    rejoin_start = time.monotonic()
    victim.start()
    c.wait_etcd_healthy(BOUND_S, [victim])
    figure("one of 3 etcd members killed", requests=len(answers), failed=len(loop.failed()),
           victim=f"{victim.name} (raft leader)", watched_s=time.monotonic() - killed,
           member_rejoined_s=time.monotonic() - rejoin_start)
    c.wait_nothing_left(BOUND_S)


def test_etcd_unreachable_then_back(c):
    leader = c.wait_leader(BOUND_S)
    standby = next(n for n in c.conductor_names if n != leader)
    served_right(c, standby, seed=20)
    # Long enough to be still running when the conductors start refusing.
    routed = Stream(c, leader, tokens(40, seed=21), max_tokens=3000, timeout_s=BOUND_S)
    assert routed.first.wait(BOUND_S), "the routed stream never started"
    for member in c.etcd:
        c.rig.link(member.name, up=False)
    cut = time.monotonic()

    def refused(name: str) -> Answer | None:
        answer = c.completion(name, tokens(40, seed=22), 2, timeout=10)
        return answer if answer.status == 503 and answer.error_code == "etcd_unreachable" else None

    refusal = wait_until(lambda: refused(leader), BOUND_S,
                         what="the leader to refuse with 503")
    refused_at = time.monotonic()
    assert "Retry-After" in refusal.headers and "etcd" in refusal.body["error"]["message"]
    wait_until(lambda: refused(standby), BOUND_S, what="the standby to refuse with 503")
    events = routed.result(BOUND_S)
    assert events[-1] == "[DONE]" and not routed.errors(), events[-3:]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    # Cut off for longer than a lease: every lease runs out of time.
    remaining = 2 * c.lease_ttl_s + 1 - (time.monotonic() - cut)
    if remaining > 0:
        time.sleep(remaining)
    assert refused(leader)  # still, with every lease run out
    for member in c.etcd:
        c.rig.link(member.name, up=True)
    back = time.monotonic()
    took = {name: first_served(c, name, back, seed=23) for name in c.conductor_names}
    c.wait_workers_registered(BOUND_S)
    figure("etcd unreachable (all 3 members' links down)", refused_503_after_s=refused_at - cut,
           routed_stream_ran_s=routed.ended_at - cut,
           stream_outlived_refusal=routed.ended_at > refused_at, cut_for_s=back - cut,
           serving_again_s=max(took.values()), workers_registered_s=time.monotonic() - back)
    # The stream routed before the cut: every token, and the right ones.
    assert c.output_tokens(leader, Answer(200, {}, {"id": routed.request_id}, 0.0)) == \
        reference(MODEL, routed.body["prompt"], routed.body["max_tokens"])
    served_right(c, leader, seed=24)
    served_right(c, standby, seed=25)
    c.wait_nothing_left(BOUND_S)


def test_prefill_node_partitioned_until_its_lease_expires(c):
    leader = c.wait_leader(BOUND_S)
    victim, survivor = c.names("prefill")[1], c.names("prefill")[0]
    c.rig.link(victim, up=False)
    cut = time.monotonic()
    wait_until(lambda: victim not in c.alive_peers(leader), BOUND_S,
               what=f"the leader to mark {victim} dead")
    dead_after = time.monotonic() - cut
    log = c.nodes[leader].output()
    by_lease = f"node {victim} (prefill): its etcd lease expired: marked dead" in log
    by_heartbeat = f"node {victim} (prefill) missed heartbeats" in log
    assert by_lease or by_heartbeat, c.nodes[leader].tail(10)
    for i, conductor in enumerate(c.conductor_names * 2):
        answer = served_right(c, conductor, seed=40 + i)
        assert c.prefill_node_of(leader, answer) == survivor
    c.rig.link(victim, up=True)
    back = time.monotonic()
    c.wait_workers_registered(BOUND_S)
    figure("prefill node partitioned (link down)", marked_dead_s=dead_after,
           detected_by="etcd lease" if by_lease else "heartbeat timeout",
           lease_ttl_s=c.lease_ttl_s, rejoined_s=time.monotonic() - back)
    c.wait_nothing_left(BOUND_S)


def test_rolling_restart_of_prefill_nodes_with_drain(c):
    leader = c.wait_leader(BOUND_S)
    standby = next(n for n in c.conductor_names if n != leader)
    shared = tokens(32, seed=60)  # two full blocks: prefixes cached, and fetched from peers

    def prompt(i: int) -> list[int]:
        return shared + tokens(12, seed=600 + i)

    loops = [LoadLoop(c, lambda i, name=name: name, requests=300, prompt=prompt).start()
             for name in (leader, standby)]
    wait_until(lambda: all(len(loop.answers) >= 2 for loop in loops), BOUND_S,
               what="the client loops")
    t0 = time.monotonic()
    per_node = {}
    heartbeat_s = float(c.deployment.setting("node", "heartbeat_interval_s", 1.0))
    seen_draining = {}
    # docs/DEPLOY.md "Rolling restarts", step by step, one node at a time.
    for name in c.names("prefill"):
        began = time.monotonic()
        assert c.admin_post(name, "/admin/drain")[0] == 200
        # "wait a heartbeat, then until its queue is empty and nothing is pinned"
        time.sleep(heartbeat_s)
        wait_until(lambda: idle(c.status(name)), BOUND_S, what=f"{name} to finish its work")
        drained = time.monotonic() - began
        seen_draining[name] = c.accepting(leader, name) is False
        # "systemctl restart": SIGTERM (a graceful stop), then the same command again.
        assert c.nodes[name].terminate(timeout=BOUND_S) == 0
        c.restart(name, BOUND_S)  # until /readyz answers 200
        per_node[name] = (drained, time.monotonic() - began)
    rolled = time.monotonic() - t0
    # A few more requests with every node back, then stop the loops.
    counts = [len(loop.answers) for loop in loops]
    wait_until(lambda: all(len(lp.answers) >= n + 2 for lp, n in zip(loops, counts)), BOUND_S,
               what="requests after the restart")
    answers = [a for loop in loops for a in loop.finish()]
    failed = [f for loop in loops for f in loop.failed()]
    assert not failed, f"{len(failed)} of {len(answers)} failed: {failed[:3]}"
    # A sample of the latest answers (the leader keeps the traces of its last
    # 256 requests); a loop's i-th answer is to prompt(i).
    for loop in loops:
        for i, (target, answer) in list(enumerate(loop.answers))[-60::6]:
            served_by = answer.headers.get("X-Mooncaked-Served-By", target)
            assert c.output_tokens(served_by, answer) == reference(MODEL, prompt(i),
                                                                   loop.max_tokens), (target, i)
    figure("rolling restart of every prefill node with drain", requests=len(answers),
           failed=len(failed), rolled_s=rolled,
           leader_saw_drain_before_stop=all(seen_draining.values()),
           **{f"{n}_drained_s": d for n, (d, _) in per_node.items()},
           **{f"{n}_total_s": t for n, (_, t) in per_node.items()})
    c.wait_nothing_left(BOUND_S)
