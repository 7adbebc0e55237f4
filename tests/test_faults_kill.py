"""Fault matrix, kill -9 rows: each role killed mid-request on a supervised
cluster (prefill mid-prefill, decode mid-decode, the conductor mid-stream),
and the issue's "Done when" under a real ``mooncaked up --prefill 2 --decode 1``.

For each: the client gets a clear end (a completion or an error) in bounded
time, the node comes back on its own, nothing stays pinned, private,
reserved or fenced on any worker, and the survivors serve the quiet
reference's tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from mooncaked.local_cluster import LocalCluster
from tests.cluster_helpers import ADMIN, complete, start_cluster, stream_lines, tokens, trace_of
from tests.fault_rig import (node_pid, reference, report, supervised, wait_nothing_left,
                             worker_urls)
from tests.nodes import FAST, REPO, SMALL, get_json, mooncaked_cmd, post_json, wait_until

pytestmark = pytest.mark.slow  # real node processes, kill -9

# Slow enough on CPU that a 3k-token prefill is still running at the kill.
MODEL = "dummy"
BOUND_S = 90  # the bound on how long an in-flight request may take to end


@pytest.fixture(scope="module")
def supervised_cluster(tmp_path_factory):
    """(cluster, supervisor log) for the whole module: one supervising thread,
    since a node started again lives only as long as the thread that started
    it (``PR_SET_PDEATHSIG`` fires when the parent *thread* exits)."""
    c = start_cluster(tmp_path_factory.mktemp("faults-kill"), prefill=2, decode=2, model=MODEL,
                      # Long prefills on purpose (kills strike mid-prefill): a TTFT SLO they fit in.
                      extra=["store.capacity_bytes=67108864", "model.prefill_chunk=256",
                             "conductor.ttft_slo_s=120"])
    try:
        with supervised(c) as log:
            yield c, log
    finally:
        c.stop()


def node(cluster: LocalCluster, name: str):
    return next(c for c in cluster.children if c.name == name)


def serves_reference(cluster: LocalCluster, seed: int, n: int = 80, out: int = 6) -> float:
    """One quiet request: served with the reference's tokens; its seconds."""
    prompt = tokens(n, seed=seed)
    t0 = time.monotonic()
    status, body = complete(cluster.url, prompt, max_tokens=out, model=MODEL)
    took = time.monotonic() - t0
    assert status == 200, body
    assert trace_of(cluster.url, body)["output_token_ids"] == reference(MODEL, prompt, out)
    return took


def back_after(log: list[str], name: str) -> str:
    return wait_until(lambda: next((line for line in log if f"{name} is back" in line), None),
                      60, interval=0.1, what=f"{name} restarted by the supervisor")


def all_registered(cluster: LocalCluster) -> bool:
    _, status = get_json(cluster.url + "/admin/status")
    return {p["node_id"] for p in status.get("peers", [])} == set(worker_urls(cluster))


def test_kill_prefill_node_mid_prefill(supervised_cluster):
    cluster, log = supervised_cluster
    result: dict = {}

    def send() -> None:
        result["status"], result["body"] = complete(cluster.url, tokens(3000, seed=1),
                                                    max_tokens=4, model=MODEL)
        result["ended_at"] = time.monotonic()

    thread = threading.Thread(target=send)
    thread.start()
    prefill_nodes = [c for c in cluster.children if c.role == "prefill"]

    def running_on():
        return next((n for n in prefill_nodes
                     if get_json(n.url + "/admin/status")[1]["prefill"]["queue_len"]), None)

    victim = wait_until(running_on, 60, interval=0.01, what="a prefill to start")
    victim.proc.kill()
    killed_at = time.monotonic()
    thread.join(timeout=BOUND_S)
    assert not thread.is_alive()
    if result["status"] != 200:  # the usual case: cut before it answered
        assert result["status"] == 502, result
        assert "prefill" in result["body"]["error"]["message"], result
    back = back_after(log, victim.name)
    wait_until(lambda: all_registered(cluster), 30, what="every node registered")
    clean_s = wait_nothing_left(worker_urls(cluster), 30)
    next_request_s = serves_reference(cluster, seed=2)
    report("kill -9 prefill mid-prefill", next_request_s=next_request_s, status=result["status"],
           ended_after_kill_s=result["ended_at"] - killed_at, restart=back,
           nothing_left_after_s=clean_s)


def test_kill_decode_node_mid_decode(supervised_cluster):
    cluster, log = supervised_cluster
    body = {"model": MODEL, "prompt": tokens(200, seed=3), "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    resp = stream_lines(cluster.url, body, timeout=BOUND_S)
    victim = node(cluster, resp.headers["x-mooncaked-decode-node"])
    events: list[str] = []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        events.append(line[6:])
        if len(events) == 3:
            victim.proc.kill()
            killed_at = time.monotonic()
        if line == "data: [DONE]":
            break
    ended_s = time.monotonic() - killed_at
    errors = [json.loads(e)["error"]["message"] for e in events if '"error"' in e]
    assert errors and "decode" in errors[0], events[-3:]
    back = back_after(log, victim.name)
    wait_until(lambda: all_registered(cluster), 30, what="every node registered")
    clean_s = wait_nothing_left(worker_urls(cluster), 30)
    next_request_s = serves_reference(cluster, seed=4)
    report("kill -9 decode mid-decode", next_request_s=next_request_s, error=errors[0],
           ended_after_kill_s=ended_s, restart=back, nothing_left_after_s=clean_s)


def test_kill_conductor_mid_stream(supervised_cluster):
    cluster, log = supervised_cluster
    body = {"model": MODEL, "prompt": tokens(200, seed=5), "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    resp = stream_lines(cluster.url, body, timeout=BOUND_S)
    decode_node = resp.headers["x-mooncaked-decode-node"]
    events, done = 0, False
    try:
        for raw in resp:
            if raw.startswith(b"data: "):
                events += 1
                if events == 3:
                    cluster.conductor.proc.kill()
                    killed_at = time.monotonic()
                done = done or raw.strip() == b"data: [DONE]"
    except OSError:  # the connection is cut mid-body: that is the clear end here
        pass
    ended_s = time.monotonic() - killed_at
    assert not done  # the stream cannot have finished: its conductor is gone
    back = back_after(log, "conductor")
    wait_until(lambda: all_registered(cluster), 30, what="every node registered again")
    # The decode node noticed the stream's connection go and freed the sequence.
    clean_s = wait_nothing_left(worker_urls(cluster), 30)
    next_request_s = serves_reference(cluster, seed=6)
    report("kill -9 conductor mid-stream", next_request_s=next_request_s, decode_node=decode_node,
           ended_after_kill_s=ended_s, restart=back, nothing_left_after_s=clean_s)


# -- the "Done when", under a real `mooncaked up` -------------------------------

def long_stream(url: str, seed: int, outcome: dict) -> None:
    """A long streaming completion; ``outcome`` gets its prefill node, chunk
    count, then its finish reason or error, and when it ended."""
    body = {"model": "tiny", "prompt": tokens(64, seed=seed), "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    outcome["chunks"] = 0
    try:
        with stream_lines(url, body, timeout=BOUND_S) as resp:
            outcome["prefill_node"] = resp.headers["x-mooncaked-prefill-node"]
            for raw in resp:
                if not raw.startswith(b"data: {"):
                    continue
                event = json.loads(raw[6:])
                if "error" in event:
                    outcome["error"] = event["error"]["message"]
                    continue
                outcome["chunks"] += 1
                if event["choices"][0].get("finish_reason"):
                    outcome["finish_reason"] = event["choices"][0]["finish_reason"]
    except OSError as exc:
        outcome["error"] = str(exc)
    outcome["ended_at"] = time.monotonic()


def test_done_when_prefill_killed_under_mooncaked_up(tmp_path):
    err = tmp_path / "up.err"
    with open(err, "w") as stderr:
        up = subprocess.Popen(
            mooncaked_cmd("up", "--prefill", "2", "--decode", "1", *SMALL, *FAST,
                          "--set", "node.admin_token=test-token", "--log-dir", str(tmp_path / "logs")),
            stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO)
    try:
        line = up.stdout.readline()
        assert line.startswith("API: http://127.0.0.1:"), err.read_text()
        url = line.split()[1]
        outcomes = [{} for _ in range(4)]
        threads = [threading.Thread(target=long_stream, args=(url, 60 + i, out), daemon=True)
                   for i, out in enumerate(outcomes)]
        for thread in threads:
            thread.start()
        wait_until(lambda: all(out.get("chunks") for out in outcomes), 60,
                   what="every stream under way")
        victim = outcomes[0]["prefill_node"]
        os.kill(node_pid(up, victim), signal.SIGKILL)
        killed_at = time.monotonic()
        # Requests sent right after the kill, before membership can know: they
        # extend the victim's stream prompt (seed 60), whose blocks the
        # conductor's index still places on the victim, so cache-aware
        # scheduling sends the first of them to the dead node (through a
        # kept-alive connection that the kill reset, or a refused connect).
        after_kill, attempts = [], []
        for i in range(6):
            prompt = tokens(64, seed=60) + tokens(32, seed=70 + i)
            status, body = complete(url, prompt, max_tokens=5)
            after_kill.append((status, body.get("error", {}).get("message", "")))
            if status == 200:
                trace = trace_of(url, body)
                attempts.append(trace["prefill_attempts"])
                assert trace["output_token_ids"] == reference("tiny", prompt, 5)
        for thread in threads:
            thread.join(timeout=BOUND_S)
        assert not any(t.is_alive() for t in threads), outcomes
        for out in outcomes:  # every in-flight request ended: a completion or a clear error
            assert out.get("finish_reason") == "length" or out.get("error"), out
        ended_s = [round(out["ended_at"] - killed_at, 1) for out in outcomes]
        wait_until(lambda: f"{victim} is back" in err.read_text(), 60, interval=0.2,
                   what=f"{victim} restarted by up")
        back_s = time.monotonic() - killed_at
        # Served by every node once it is back: with the survivors drained
        # (two, or three with up's borrowing node), the restarted node takes
        # the next request.
        survivors = {c["node_id"]: c["url"] for c in get_json(url + "/admin/status")[1]["peers"]
                     if c["role"] == "prefill" and c["node_id"] != victim}
        assert survivors
        for survivor_url in survivors.values():
            post_json(survivor_url + "/admin/drain", {}, ADMIN)
        try:
            wait_until(lambda: not any(get_json(url + "/admin/status")[1]["scheduler"]["prefill"]
                                       [s]["accepting"] for s in survivors), 10,
                       what="the drains to be seen")
            prompt = tokens(48, seed=80)
            status, body = complete(url, prompt, max_tokens=5)
            assert status == 200, body
            trace = trace_of(url, body)
            assert trace["prefill_node"] == victim
            assert trace["output_token_ids"] == reference("tiny", prompt, 5)
        finally:
            for survivor_url in survivors.values():
                post_json(survivor_url + "/admin/undrain", {}, ADMIN)
        workers = {p["node_id"]: p["url"] for p in get_json(url + "/admin/status")[1]["peers"]}
        clean_s = wait_nothing_left(workers, 30)
        report("Done-when: kill -9 prefill under `mooncaked up`", streams_ended_after_kill_s=ended_s,
               streams=[o.get("finish_reason") or o.get("error") for o in outcomes],
               sent_after_kill=[s for s, _ in after_kill], their_prefill_attempts=attempts,
               back_after_kill_s=back_s,
               nothing_left_after_s=clean_s)
        assert [s for s, _ in after_kill] == [200] * 6, after_kill
        assert up.poll() is None
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=30)
