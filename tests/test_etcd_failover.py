"""`mooncaked up --etcd --conductors 2` as real processes: kill -9 the leading
conductor mid-stream, etcd killed and started again.

What must hold: the in-flight stream relayed by the standby ends with a clear
error; a standby serves new requests within a bounded wait (the time is
printed, not asserted); the supervisor restarts the killed conductor and it
rejoins as a standby; no page stays pinned, private or reserved on any
worker; with etcd down the conductors refuse new requests with a 503 JSON
error and Retry-After while a stream already routed runs to its end, and
they serve again by themselves once etcd is back."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from mooncaked.etcd_process import find_etcd
from mooncaked.local_cluster import LocalCluster
from tests.cluster_helpers import TINY, complete, stream_lines, tokens
from tests.nodes import get_json, wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(find_etcd() is None,
                                 reason="etcd not found: apt-get install etcd-server")]

TTL = 2


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(prefill=1, decode=1, model="tiny", log_dir=tmp_path, etcd=True,
                     conductors=2, overrides=TINY + [f"etcd.lease_ttl_s={TTL}"])
    try:
        c.start(timeout_s=120)
        yield c
    finally:
        c.stop()


def leaked(cluster: LocalCluster) -> dict[str, dict]:
    out = {}
    for child in cluster.workers:
        status = get_json(child.url + "/admin/status")[1]
        store = status["store"]
        problem = {"pinned_blocks": store["pinned_blocks"], "private_pages": store["private_pages"],
                   "reservations": status.get("decode", {}).get("reservations", 0)}
        if any(problem.values()):
            out[child.name] = problem
    return out


def raw_completion(url: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"{}")
    except (urllib.error.URLError, OSError) as exc:
        return 0, {}, {"error": {"message": str(exc)}}


def election(child) -> dict:
    return get_json(child.url + "/admin/status")[1].get("election", {})


def sse_events(resp) -> list[str]:
    events = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            events.append(line[6:])
            if line == "data: [DONE]":
                break
    return events


def test_leader_killed_then_etcd_lost_and_back(cluster):
    leader_url = cluster.leader_url()
    leader = next(c for c in cluster.conductor_children if c.url == leader_url)
    standby = next(c for c in cluster.conductor_children if c is not leader)
    assert election(standby)["role"] == "standby"
    prompt = tokens(40, seed=11)
    via_leader, via_standby = complete(leader.url, prompt, 8), complete(standby.url, prompt, 8)
    assert via_leader[0] == via_standby[0] == 200, (via_leader, via_standby)
    assert via_leader[1]["choices"][0]["text"] == via_standby[1]["choices"][0]["text"]

    # A stream relayed by the standby, its leader killed mid-stream.
    body = {"model": "tiny", "prompt": tokens(60, seed=12), "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    resp = stream_lines(standby.url, body, timeout=60)
    events = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            events.append(line[6:])
        if len(events) == 3:
            leader.proc.kill()
            killed = time.monotonic()
            break
    events += sse_events(resp)
    errors = [json.loads(e)["error"] for e in events if e.startswith("{") and '"error"' in e]
    assert errors and errors[0]["code"] == "leader_failed", events[-3:]
    assert events[-1] == "[DONE]"

    # The standby serves new requests once it has taken over.
    def served() -> bool:
        return complete(standby.url, prompt, 8)[0] == 200
    wait_until(served, TTL + 30, interval=0.1, what="the standby to serve after the failover")
    print(f"\nfailover: standby served a new request {time.monotonic() - killed:.2f}s after "
          f"kill -9 of the leader (lease TTL {TTL}s)")
    assert election(standby)["role"] == "leader"
    assert complete(standby.url, prompt, 8)[1]["choices"][0]["text"] == \
        via_leader[1]["choices"][0]["text"]

    # up's supervisor restarts the killed conductor; it rejoins as a standby.
    def restarted_as_standby() -> bool:
        cluster.poll_restarts(time.monotonic(), log=lambda line: None)
        fresh = next(c for c in cluster.conductor_children if c.name == leader.name)
        return fresh.proc.poll() is None and fresh.ready(0.5) and \
            election(fresh).get("role") == "standby"
    wait_until(restarted_as_standby, 60, interval=0.2, what="the killed conductor back as standby")
    rejoined = next(c for c in cluster.conductor_children if c.name == leader.name)
    assert complete(rejoined.url, prompt, 8)[0] == 200  # forwarded to the new leader
    wait_until(lambda: not leaked(cluster), 20, what="nothing pinned or reserved after the failover")

    # etcd lost: a stream already routed runs to its end, new requests get a 503.
    routed = stream_lines(standby.url, {**body, "max_tokens": 300}, timeout=60)
    first = routed.readline()
    assert first.startswith(b"data: ")
    cluster.etcd_process.kill()
    lost = time.monotonic()

    def refused() -> tuple[int, dict, dict] | None:
        answer = raw_completion(standby.url, {"model": "tiny", "prompt": prompt, "max_tokens": 2})
        return answer if answer[0] == 503 and answer[2]["error"]["code"] == "etcd_unreachable" \
            else None
    status, headers, error = wait_until(refused, 15, interval=0.1, what="503 while etcd is down")
    assert "Retry-After" in headers and "etcd" in error["error"]["message"]
    print(f"etcd down: new requests refused (503) {time.monotonic() - lost:.2f}s after kill -9")
    rest = sse_events(routed)
    assert rest[-1] == "[DONE]" and not any('"error"' in e for e in rest), rest[-3:]
    assert raw_completion(rejoined.url, {"model": "tiny", "prompt": prompt,
                                         "max_tokens": 2})[0] == 503

    cluster.etcd_process.start()
    back = time.monotonic()
    answers: list = []

    def serves_again() -> bool:
        answers.append(complete(standby.url, prompt, 8))
        return answers[-1][0] == 200
    # A bound on how long the whole suite's load may stretch the recovery (one
    # CI run on a slow machine went past 30 s); the last answer says why.
    try:
        wait_until(serves_again, 60, interval=0.1, what="serving again after etcd came back")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last answer {answers[-1] if answers else None}, "
                             f"election {election(standby)}") from None
    print(f"etcd back: served again {time.monotonic() - back:.2f}s after etcd was healthy")
    wait_until(lambda: complete(rejoined.url, prompt, 8)[0] == 200, 30, interval=0.2,
               what="the other conductor serving again")
    wait_until(lambda: not leaked(cluster), 20, what="nothing pinned or reserved at the end")
