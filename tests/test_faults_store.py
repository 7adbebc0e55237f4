"""Fault matrix, capacity rows, on real node processes (tiny model, loopback):

- the SSD tier's disk full (a small tmpfs as its directory): demotions past
  the disk's size fail cleanly, every request is served, and blocks read
  back from the tier give the quiet reference's tokens (no corruption);
- the store full with every page pinned (prefill: every page under a lease;
  decode: every page reserved): a clear 503 at once, then, once the pins go,
  the same request succeeds;
- a cancellation storm against a decode pool small enough that freed pages
  are reused at once: every completed output equals its quiet reference;
- 4x overload: 429 with Retry-After, and every accepted request completes.

Each ends with nothing pinned, private, reserved or fenced on any worker.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore.config import DEFAULT_HASH_SEED
from kvstore.keys import block_keys
from model.config import DUMMY_CONFIGS, RuntimeConfig, page_layout
from tests.cluster_helpers import complete, stream_lines, tokens, trace_of
from tests.fault_rig import (reference, report, small_tmpfs, start_nodes, tmpfs_unusable,
                             wait_nothing_left, worker_urls)
from tests.nodes import get_json, post_json

pytestmark = pytest.mark.slow  # real node processes

MODEL = "tiny"
BS = 16
# tiny: 2 layers x K,V x 16 tokens x 2 kv heads x 16 dims x the bytes of the dtype nodes run
PAGE_BYTES = page_layout(DUMMY_CONFIGS["tiny"], BS, RuntimeConfig(model="tiny").dtype).page_bytes
COMMON = ["model.model=tiny", "store.block_size=16", "model.prefill_chunk=64", "node.heartbeat_interval_s=0.2",
          "node.heartbeat_timeout_s=1.5", "decode.reservation_timeout_s=5"]
BIG_STORE = f"store.capacity_bytes={2048 * PAGE_BYTES}"


def store_of(url: str) -> dict:
    return get_json(url + "/admin/status")[1]["store"]


def served_as_reference(url: str, prompt: list[int], out: int) -> None:
    status, body = complete(url, prompt, max_tokens=out, model=MODEL)
    assert status == 200, body
    assert trace_of(url, body)["output_token_ids"] == reference(MODEL, prompt, out)


def test_ssd_tier_disk_full(tmp_path):
    why = tmpfs_unusable(tmp_path / "probe")
    if why:
        pytest.skip(f"SSD-full row skipped: {why}")
    # 32 DRAM pages, a tier of 128 slots on a disk that holds only 8 of them.
    with small_tmpfs(tmp_path / "ssd", f"{8 * PAGE_BYTES}") as disk:
        cluster = start_nodes(tmp_path, [], [
            ("prefill-0", "prefill", [f"store.capacity_bytes={32 * PAGE_BYTES}", "store.ssd_tier=true",
                                      f"store.ssd_path={disk / 'pool'}",
                                      f"store.ssd_capacity_bytes={128 * PAGE_BYTES}"]),
            ("decode-0", "decode", [BIG_STORE])], COMMON)
        try:
            prefill = cluster.children[1].url
            prompts = [tokens(8 * BS, seed=300 + i) for i in range(12)]  # 96 blocks: 64 demoted
            t0 = time.monotonic()
            for prompt in prompts:
                served_as_reference(cluster.url, prompt, 4)
            for prompt in prompts:  # again: some come back from the tier, the rest recomputed
                served_as_reference(cluster.url, prompt, 4)
            served_s = time.monotonic() - t0
            store = store_of(prefill)
            assert store["ssd_drops"] > 0, store  # demotions past the disk's size were dropped
            assert store["ssd_blocks"] <= 8, store
            assert store["promotions"] > 0, store  # blocks read back from the tier, tokens intact
            clean_s = wait_nothing_left(worker_urls(cluster), 15)
            report("SSD tier disk full", requests=2 * len(prompts), all_reference=True,
                   served_s=served_s, ssd_blocks=store["ssd_blocks"], demotions=store["demotions"],
                   ssd_drops=store["ssd_drops"], promotions=store["promotions"],
                   nothing_left_after_s=clean_s)
        finally:
            cluster.stop()


def test_store_full_with_every_page_pinned(tmp_path):
    prefill_pages = 32
    cluster = start_nodes(tmp_path, [], [
        ("prefill-0", "prefill", [f"store.capacity_bytes={prefill_pages * PAGE_BYTES}"]),
        ("decode-0", "decode", [f"store.capacity_bytes={64 * PAGE_BYTES}"])], COMMON)
    try:
        prefill, decode = cluster.children[1].url, cluster.children[2].url
        # Fill every prefill page with cached blocks, then pin them all under leases.
        prompts = [tokens(8 * BS, seed=400 + i) for i in range(prefill_pages // 8)]
        for prompt in prompts:
            served_as_reference(cluster.url, prompt, 2)
        leases = []
        for prompt in prompts:
            status, grant = post_json(prefill + "/internal/store/lease",
                                      {"keys": block_keys(prompt, BS, DEFAULT_HASH_SEED), "ttl_s": 60})
            assert status == 200 and len(grant["pages"]) == 8, grant
            leases.append(grant["lease_id"])
        store = store_of(prefill)
        assert store["free_pages"] == 0 and store["pinned_blocks"] == prefill_pages, store
        fresh = tokens(3 * BS, seed=450)
        t0 = time.monotonic()
        status, body = complete(cluster.url, fresh, max_tokens=4, model=MODEL)
        prefill_full_s = time.monotonic() - t0
        assert status == 503, body
        assert "no KV pages free on this prefill node" in body["error"]["message"], body
        for lease_id in leases:
            assert post_json(prefill + "/internal/store/release", {"lease_id": lease_id})[0] == 200
        served_as_reference(cluster.url, fresh, 4)
        # The decode pool full: every page under one reservation nobody uses.
        status, grant = post_json(decode + "/internal/decode/reserve",
                                  {"request_id": "hog", "total_tokens": 64 * BS})
        assert status == 200, grant
        t0 = time.monotonic()
        status, body = complete(cluster.url, fresh, max_tokens=4, model=MODEL)
        decode_full_s = time.monotonic() - t0
        assert status == 503, body
        assert "decode node out of KV pages" in body["error"]["message"], body
        assert post_json(decode + "/internal/decode/cancel", {"request_id": "hog"})[0] == 200
        served_as_reference(cluster.url, fresh, 4)
        clean_s = wait_nothing_left(worker_urls(cluster), 15)
        report("store full, every page pinned", prefill_full_answer_s=prefill_full_s,
               decode_full_answer_s=decode_full_s, nothing_left_after_s=clean_s)
    finally:
        cluster.stop()


def storm_client(url: str, prompt: list[int], max_tokens: int, cut_after: int | None) -> dict:
    """Stream one request; hang up after ``cut_after`` events (None: read to
    the end).  A 503 (the pool is full) is retried, a bounded number of times."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    outcome: dict = {"cut_after": cut_after, "events": 0, "refused": 0}
    for _ in range(200):
        try:
            resp = stream_lines(url, body, timeout=60)
            break
        except urllib.error.HTTPError as exc:  # the pool full: a clear 503, never a traceback
            error = exc.read().decode()
            assert exc.code == 503, error
            assert "no_decode_capacity" in error or "out of KV pages" in error, error
            outcome["refused"] += 1
            time.sleep(0.05)
    else:
        return outcome
    with resp:
        if cut_after == 0:
            return outcome  # gone before the first token (while it prefills)
        for raw in resp:
            if not raw.startswith(b"data: {"):
                continue
            event = json.loads(raw[6:])
            if "error" in event:
                outcome["error"] = event["error"]["message"]
                return outcome
            outcome["id"] = event["id"]
            outcome["events"] += 1
            if event["choices"][0].get("finish_reason"):
                outcome["finished"] = True
                return outcome
            if cut_after is not None and outcome["events"] >= cut_after:
                return outcome  # closing the response hangs up mid-stream
    return outcome


def test_cancellation_storm_on_a_small_decode_pool(tmp_path):
    # 4 requests of 6 pages fill the decode pool: freed pages are reused at once.
    prompt_len, max_tokens = 3 * BS, 40
    cluster = start_nodes(tmp_path, [], [
        ("prefill-0", "prefill", [BIG_STORE]),
        ("decode-0", "decode", [f"store.capacity_bytes={24 * PAGE_BYTES}"])], COMMON)
    try:
        rng = random.Random(15)
        plan = [(tokens(prompt_len, seed=500 + i % 10),
                 rng.choice([None, None, 0, 1, 2, 5, 10, 20, 35])) for i in range(40)]
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=5) as pool:
            outcomes = list(pool.map(lambda p: storm_client(cluster.url, p[0], max_tokens, p[1]),
                                     plan))
        storm_s = time.monotonic() - t0
        completed = 0
        for (prompt, _), out in zip(plan, outcomes):
            assert "error" not in out, out  # no stream ends in an error
            if out.get("finished"):
                completed += 1
                trace = trace_of(cluster.url, {"id": out["id"].removesuffix("-0")})
                assert trace["output_token_ids"] == reference(MODEL, prompt, max_tokens), out
            else:
                assert out["cut_after"] is not None, out  # only those told to hang up did not finish
        assert completed >= 5, outcomes
        clean_s = wait_nothing_left(worker_urls(cluster), 20)
        served_as_reference(cluster.url, tokens(prompt_len, seed=599), max_tokens)
        report("cancellation storm", requests=len(plan), completed=completed,
               hung_up=len(plan) - completed, refused_503_then_retried=sum(o["refused"] for o in outcomes),
               storm_s=storm_s,
               nothing_left_after_s=clean_s)
    finally:
        cluster.stop()


def overload_burst(conductor_url: str, slo_s: float, factor: float = 4.0,
                   most: int = 256) -> tuple[int, int]:
    """(prompt tokens, requests) of a burst holding ``factor`` x the prefill
    work the TTFT SLO admits, by the conductor's own prefill prior (the
    nodes' start-up measurement): a fixed burst would overload a slow
    machine and not a fast one.  The prompt is the longest whose predicted
    prefill is within an eighth of the SLO, so the first requests fit."""
    status = get_json(conductor_url + "/admin/status")[1]["scheduler"]
    c = status["prefill_coeffs"]

    def seconds(n: int) -> float:
        return c["c0"] + c["n"] * n + c["n2"] * n * n

    length = next((n for n in (4000, 2048, 1024, 512) if seconds(n) <= slo_s / 8), 256)
    return length, max(8, min(most, math.ceil(factor * slo_s / seconds(length))))


OVERLOAD_MOST = 256   # requests in the burst at most


def test_overload_4x_gets_429_and_loses_nothing(tmp_path):
    # Decode pages for every request of the largest burst at once: the
    # overload this test makes is the prefill's (429 on the TTFT SLO), never
    # the decode pool's (a 503).
    decode_store = f"store.capacity_bytes={OVERLOAD_MOST * (4000 // BS + 2) * PAGE_BYTES}"
    cluster = start_nodes(tmp_path, ["conductor.ttft_slo_s=1.0"], [
        ("prefill-0", "prefill", [BIG_STORE]), ("decode-0", "decode", [decode_store])],
        COMMON)
    try:
        length, count = overload_burst(cluster.url, 1.0, most=OVERLOAD_MOST)
        prompts = [tokens(length, seed=600 + i) for i in range(count)]
        results: list = [None] * len(prompts)
        headers: list = [None] * len(prompts)

        def send(i: int) -> None:
            import urllib.error
            import urllib.request
            body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True}
            req = urllib.request.Request(cluster.url + "/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    results[i] = (resp.status, json.loads(resp.read()))
            except urllib.error.HTTPError as exc:
                results[i] = (exc.code, json.loads(exc.read()))
                headers[i] = exc.headers.get("Retry-After")

        t0 = time.monotonic()
        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        burst_s = time.monotonic() - t0
        statuses = [r[0] for r in results]
        assert set(statuses) <= {200, 429}, [r for r in results if r[0] not in (200, 429)][:3]
        assert 429 in statuses and 200 in statuses, statuses
        for i, (status, body) in enumerate(results):
            if status == 429:
                assert headers[i] and int(headers[i]) >= 1, headers[i]
                assert "ttft_slo" in body["error"]["message"], body
            else:  # accepted: it completed, with the reference's tokens
                assert trace_of(cluster.url, body)["output_token_ids"] == \
                    reference(MODEL, prompts[i], 4)
        clean_s = wait_nothing_left(worker_urls(cluster), 15)
        report("4x overload", prompt_tokens=length, sent=len(prompts),
               accepted=statuses.count(200),
               rejected_429=statuses.count(429), burst_s=burst_s, nothing_left_after_s=clean_s)
    finally:
        cluster.stop()
