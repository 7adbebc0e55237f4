"""Workload building and the trace generator (no cluster)."""

from __future__ import annotations

import json

import pytest

from mooncaked.benchserve.replay import RequestResult
from mooncaked.benchserve.report import Slo, summarize
from mooncaked.benchserve.tracegen import TraceGenConfig, describe, generate, write_trace
from mooncaked.benchserve.workload import (WorkloadConfig, build_workload, scaled_prompt,
                                           shared_prefix_tokens, warmup_slice)
from mooncaked.simulate.trace import load_trace


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_scaled_prompts_keep_exactly_the_shared_prefix(tmp_path):
    trace = _write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 1500, "output_length": 20, "hash_ids": [1, 2, 9]},
        {"timestamp": 2000, "input_length": 100, "output_length": 1, "hash_ids": [7]},
    ])
    reqs = build_workload(WorkloadConfig(trace=trace, length_scale=1 / 64, time_scale=0.5))
    assert [r.block_tokens for r in reqs] == [8] * 3
    assert [len(r.prompt) for r in reqs] == [18, 24, 2]  # ceil(n * 8 / 512)
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 1.0]
    assert [r.max_tokens for r in reqs] == [1, 1, 1]
    a, b, c = reqs
    assert a.prompt[:16] == b.prompt[:16]          # hash ids 1, 2 shared
    assert a.prompt[16:18] != b.prompt[16:18]      # 3 vs 9
    assert c.prompt != a.prompt[:2]
    assert shared_prefix_tokens(reqs) == [0, 16, 0]
    assert all(0 <= t < 256 for r in reqs for t in r.prompt)
    # Equal ids give equal tokens whatever the length cut.
    assert list(scaled_prompt((1, 2), 600, 8, 256)) == list(a.prompt[:10])


def test_warmup_slice_has_the_next_requests_shapes_and_none_of_their_blocks(tmp_path):
    trace = _write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 600, "output_length": 30, "hash_ids": [1, 5]},
        {"timestamp": 3000, "input_length": 1500, "output_length": 20, "hash_ids": [1, 2, 9]},
        {"timestamp": 3500, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
    ])
    cfg = WorkloadConfig(trace=trace, max_requests=2, length_scale=1 / 64)
    measured = build_workload(cfg)
    warm = warmup_slice(cfg, 5)
    # Requests 2 and 3 of the trace (all there are), same lengths and gaps.
    assert [len(r.prompt) for r in warm] == [24, 18]
    assert [r.max_tokens for r in warm] == [1, 1]
    assert [r.arrival_s for r in warm] == [0.0, 0.5]
    # Request 3 repeats request 0's ids: its warm-up twin must not give it a hit.
    assert not {t for r in warm for t in r.hash_ids} & {t for r in measured for t in r.hash_ids}
    assert warm[1].prompt[:16] != measured[0].prompt[:16]
    # The warm-up slice keeps its own sharing (ids 1, 2 in both).
    assert warm[0].prompt[:16] == warm[1].prompt[:16]
    assert warmup_slice(cfg, 0) == []
    with pytest.raises(ValueError, match="bounded"):
        warmup_slice(WorkloadConfig(trace=trace), 2)


def test_arrival_modes_and_validation(tmp_path):
    trace = _write(tmp_path / "t.jsonl", [{"timestamp": i * 1000, "input_length": 10,
                                           "output_length": 300, "hash_ids": [i]}
                                          for i in range(20)])
    even = build_workload(WorkloadConfig(trace=trace, arrival="rate", rate=4.0, offset=5,
                                         max_requests=4, max_output_tokens=3))
    assert [r.arrival_s for r in even] == [0.0, 0.25, 0.5, 0.75]
    assert [r.trace_index for r in even] == [5, 6, 7, 8] and even[0].max_tokens == 3
    scaled = build_workload(WorkloadConfig(trace=trace, length_scale=0.5, output_scale=0.1,
                                           max_requests=1))
    assert scaled[0].max_tokens == 30 and len(scaled[0].prompt) == 5
    p1 = build_workload(WorkloadConfig(trace=trace, arrival="poisson", rate=2.0, seed=3))
    p2 = build_workload(WorkloadConfig(trace=trace, arrival="poisson", rate=2.0, seed=3))
    assert [r.arrival_s for r in p1] == [r.arrival_s for r in p2]
    assert 3 < p1[-1].arrival_s < 30
    for bad, field in ((dict(arrival="poisson"), "rate"), (dict(length_scale=2.0), "length_scale"),
                       (dict(time_scale=0), "time_scale"), (dict(arrival="x"), "arrival"),
                       (dict(vocab_size=4, reserved_tokens=4), "vocab_size")):
        with pytest.raises(ValueError, match=field):
            WorkloadConfig(trace=trace, **bad)
    with pytest.raises(ValueError, match="no requests"):
        build_workload(WorkloadConfig(trace=trace, offset=20))


def test_tracegen_output_is_valid_and_shares_what_it_claims(tmp_path):
    cfg = TraceGenConfig(requests=400, rate=2.0, seed=5, system_prompts=3,
                         system_prompt_tokens=1000, documents=4, document_tokens=3000)
    records = generate(cfg, annotate=True)
    path = tmp_path / "gen.jsonl"
    write_trace(path, records)
    loaded = load_trace(str(path))  # validates len(hash_ids) == ceil(input / 512)
    assert len(loaded) == 400
    assert [r["timestamp"] for r in records] == sorted(r["timestamp"] for r in records)
    assert {r["kind"] for r in records} == {"chat", "doc", "single"}
    sys_blocks = 2  # 1000 tokens rounded up to whole blocks
    systems: dict[int, list[int]] = {}
    for r in records:
        if "system" in r:
            head = r["hash_ids"][:sys_blocks]
            assert systems.setdefault(r["system"], head) == head
            assert r["input_length"] > sys_blocks * 512
    assert len(systems) == 3 and len({tuple(v) for v in systems.values()}) == 3
    docs: dict[int, list[int]] = {}
    for r in records:
        if r["kind"] == "doc":
            head = r["hash_ids"][:6]
            assert docs.setdefault(r["doc"], head) == head
    sessions: dict[int, list[dict]] = {}
    for r in records:
        if r["kind"] == "chat":
            sessions.setdefault(r["session"], []).append(r)
    multi = [turns for turns in sessions.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt["turn"] == prev["turn"] + 1 and nxt["timestamp"] >= prev["timestamp"]
            full = prev["input_length"] // 512
            assert nxt["hash_ids"][:full] == prev["hash_ids"][:full]
            assert nxt["input_length"] > prev["input_length"]
            # Beyond the shared full blocks, ids are fresh.
            assert not set(nxt["hash_ids"][full:]) & set(prev["hash_ids"])
    info = describe(records)
    assert 0.5 < info["theoretical_hit_ratio"] < 1.0
    # Deterministic for a seed; unannotated output has exactly the published keys.
    plain = generate(cfg)
    assert set(plain[0]) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert [r["hash_ids"] for r in plain] == [r["hash_ids"] for r in records]
    with pytest.raises(ValueError, match="chat_share"):
        TraceGenConfig(chat_share=0.8, doc_share=0.5)


def test_summary_counts_rejections_and_failures_as_not_effective():
    def res(i, status, ttft=None, times=(), cached=0, prompt=100):
        r = RequestResult(i, i, 0.1 * i, prompt, len(times))
        r.status, r.sent_s, r.ttft_s = status, 0.1 * i, ttft
        r.token_times_s = list(times)
        r.completion_tokens, r.cached_tokens = len(times), cached
        r.e2e_s = times[-1] if times else 0.01
        return r

    results = [res(0, "ok", 0.5, (0.5, 0.6, 0.7)), res(1, "ok", 2.0, (2.0, 2.5), cached=40),
               res(2, "rejected"), res(3, "error"), res(4, "not_sent")]
    s = summarize(results, Slo(ttft_s=1.0, tbt_ms=200.0))
    assert (s["sent"], s["ok"], s["rejected"], s["error"], s["not_sent"]) == (4, 2, 1, 1, 1)
    assert s["effective_requests"] == 1 and s["effective_request_capacity"] == 0.25
    assert s["rejection_ratio"] == 0.25
    assert s["cache_hit_ratio"] == pytest.approx(40 / 200)
    assert s["effective_request_capacity_at_tbt_ms"]["100"] == 0.25
    assert s["duration_s"] == pytest.approx(0.1 + 2.5)
    assert s["prefill_compute_s"] is None
