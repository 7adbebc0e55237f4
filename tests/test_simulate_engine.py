"""The simulator: exact TTFTs on a hand-computable trace, real scheduler, hit rates."""
import json

import pytest

import roles.scheduling as core
from mooncaked.simulate import SimConfig, run_simulation
from mooncaked.simulate.engine import Simulation
from mooncaked.simulate.metrics import paper_tbt
from mooncaked.simulate.store import LruShard
from mooncaked.simulate.trace import TraceRequest, load_trace, theoretical_hit_rate
from tests.paths import SYNTHETIC_TRACE, needs_trace

TRACE = SYNTHETIC_TRACE


@pytest.fixture
def tiny_profile(tmp_path):
    """Round numbers: 1 ms per computed token, 0.1 ms per transferred token.

    kv bytes/token = layers * 2 * d / gqa * s = 1 * 2 * 1024 / 1 * 2 = 4096;
    transfer at min(NIC, h2d) = 40.96 MB/s -> 0.1 ms per token.
    Decode step = weights 2 MB / 1 GB/s + 4096 B per context token / 1 GB/s.
    """
    p = tmp_path / "tiny.json"
    p.write_text(json.dumps({
        "name": "tiny", "layers": 1, "d_model": 1024, "gqa": 1, "bytes_per_elem": 2,
        "params": 1e6, "coeffs": {"n": 1e-3}, "h2d_bytes_per_s": 40.96e6, "nic_gbps": 1000.0,
        "hbm_bytes_per_s": 1e9, "hbm_bytes": 1e9, "decode_efficiency": 1.0,
        "decode_per_seq_s": 0.0}))
    return str(p)


def T(i, at, ids, tokens, out=1):
    return TraceRequest(i, at, tokens, out, tuple(ids))


def test_hand_computed_ttfts_transfer_and_replication(tiny_profile):
    trace = [T(0, 0.0, [1, 2, 3, 4], 2048), T(1, 0.1, [5, 6], 1024),
             T(2, 3.0, [1, 2, 3, 4, 7], 2560), T(3, 3.1, [1, 2, 3, 4, 8], 2560),
             T(4, 10.0, [20], 100, out=3)]
    cfg = SimConfig(prefill=2, decode=1, policy="mooncake", model_profile=tiny_profile,
                    cache_tokens_per_node=-1, kvcache_balancing_threshold=1.5)
    sim = Simulation(cfg, trace)
    res = sim.run()
    rows = {r["id"]: r for r in res.requests}
    # A: both idle, no prefix: 2048 * 1 ms on p0 (first of equal nodes)
    assert rows[0]["prefill"] == "p0" and rows[0]["ttft_s"] == pytest.approx(2.048)
    # B: p0 has 1.948 s left, p1 idle: p1, 1.024 s
    assert rows[1]["prefill"] == "p1" and rows[1]["ttft_s"] == pytest.approx(1.024)
    # C: p0 holds the 4-block prefix: compute 512 tokens locally
    assert rows[2]["prefill"] == "p0" and rows[2]["ttft_s"] == pytest.approx(0.512)
    assert rows[2]["transferred_tokens"] == 0
    # D: p0 busy 0.412 + 0.512 = 0.924 > p1 pulls 2048 tokens (0.2048) + 0.512
    assert rows[3]["prefill"] == "p1" and rows[3]["transferred_tokens"] == 2048
    assert rows[3]["ttft_s"] == pytest.approx(0.7168)
    assert rows[3]["predicted_ttft_s"] == pytest.approx(0.7168)
    # cache load balancing: p1 kept the prefix it pulled -> two replicas
    assert sorted(sim.scheduler.index.holders(1)) == ["p0", "p1"]
    assert all(k in sim.prefills["p1"].store for k in (1, 2, 3, 4, 8))
    # E: 100 tokens -> 0.1 s; decode joins after the last layer's KV (the
    # whole KV here, 1 layer): 100 * 4096 B / 40.96 MB/s = 0.01 s
    assert rows[4]["ttft_s"] == pytest.approx(0.1)
    step1 = 2e6 / 1e9 + 101 * 4096 / 1e9
    assert rows[4]["tbt_s"] == pytest.approx(0.01 + step1)  # longest 10% of 2 = max
    assert res.summary["estimator_error"]["mean_abs_s"] == pytest.approx(0.0, abs=1e-9)


def test_simulator_drives_the_real_scheduler(tiny_profile):
    trace = [T(i, i * 0.5, [100 + i % 3, 200 + i], 1024) for i in range(12)]
    cfg = SimConfig(prefill=3, decode=2, policy="local_cache_aware",
                    model_profile=tiny_profile)
    sim = Simulation(cfg, trace)
    assert type(sim.scheduler) is core.Scheduler
    assert type(sim.scheduler.policy) is core.policies.LocalCacheAwarePolicy
    assert sim.scheduler.policy is sim.policy
    assert isinstance(sim.scheduler.index, core.GlobalCacheIndex)
    calls = []
    real = sim.policy.choose
    sim.policy.choose = lambda ctx: calls.append(ctx.req.request_id) or real(ctx)
    res = sim.run()
    assert len(calls) == 12 and res.summary["served"] == 12


def test_colocated_prefill_stalls_decode(tiny_profile):
    trace = [T(0, 0.0, [1], 10, out=50), T(1, 0.02, [2, 3, 4, 5], 2000)]
    cfg = SimConfig(prefill=1, decode=0, policy="colocated", model_profile=tiny_profile,
                    colocated_chunk_tokens=0)
    res = run_simulation(cfg, trace)
    a = next(r for r in res.requests if r["id"] == 0)
    # one of A's 49 intervals waited for B's whole 2 s prefill; the paper's
    # TBT averages the longest 10% (5 intervals): >= 2.0 / 5
    assert a["tbt_s"] >= 0.4
    chunked = run_simulation(SimConfig(prefill=1, decode=0, policy="colocated",
                                       model_profile=tiny_profile,
                                       colocated_chunk_tokens=256), trace)
    a2 = next(r for r in chunked.requests if r["id"] == 0)
    assert a2["tbt_s"] < 0.3  # chunking bounds each stall to one 0.256 s chunk


def test_paper_tbt_definition():
    assert paper_tbt([]) == 0.0
    assert paper_tbt([1.0] * 18 + [5.0, 3.0]) == pytest.approx(4.0)  # top 2 of 20


def test_lru_shard_pins_and_evicts():
    s = LruShard(3)
    assert s.put([1, 2, 3]) == ([1, 2, 3], [])
    s.pin([1])
    assert s.put([4]) == ([4], [2])  # 1 is pinned: the next LRU key goes
    s.pin([3, 4])
    assert s.put([5]) == ([], [])  # everything pinned: not admitted
    s.unpin([1, 3, 4, 1])
    s.touch([1])
    assert s.put([6]) == ([6], [3])
    assert s.prefix_blocks([1, 4, 9]) == 2


@pytest.mark.slow  # the whole synthetic trace
@needs_trace
def test_unbounded_hit_rate_equals_theoretical_max():
    reqs = load_trace(str(TRACE), limit=500)
    # space arrivals so every prefill finishes before the next request
    reqs = [TraceRequest(i, i * 1000.0, r.input_length, min(r.output_length, 2), r.hash_ids)
            for i, r in enumerate(reqs)]
    # independent computation: a set of whole prefixes (tuples), not of ids
    seen, hit, total = set(), 0, 0
    for r in reqs:
        k = 0
        while k < len(r.hash_ids) and tuple(r.hash_ids[:k + 1]) in seen:
            k += 1
        hit += min(k * 512, r.input_length - 1)
        total += r.input_length
        seen.update(tuple(r.hash_ids[:j + 1]) for j in range(len(r.hash_ids)))
    expected = hit / total
    assert expected == pytest.approx(theoretical_hit_rate(reqs))
    res = run_simulation(SimConfig(prefill=4, decode=2, policy="mooncake",
                                   cache_tokens_per_node=-1, kvcache_balancing_threshold=1.0),
                         reqs)
    assert res.summary["hit_rate"] == pytest.approx(expected, rel=1e-12)
    local = run_simulation(SimConfig(prefill=4, decode=2, policy="local_cache_aware",
                                     cache_tokens_per_node=-1), reqs)
    assert local.summary["hit_rate"] <= expected


def test_bad_config():
    with pytest.raises(ValueError, match="policy"):
        SimConfig(policy="nope")
    with pytest.raises(ValueError, match="cache_tokens_per_node"):
        SimConfig(cache_tokens_per_node=-5)
    with pytest.raises(ValueError, match="model_profile"):
        Simulation(SimConfig(model_profile="no-such-profile"), [])
    with pytest.raises(ValueError, match="trace"):
        Simulation(SimConfig(trace="/no/such/file"))


def test_shared_prompt_replicates_to_every_serving_node_and_decode_stats(tiny_profile):
    """A key every request uses ends up on every prefill node that served one
    (Fig. 11's mechanism: a node keeps what it prefilled or pulled); the
    replica count of a key is bounded by the nodes that served its requests."""
    from mooncaked.simulate.experiments import replica_bound as _replica_bound
    from mooncaked.simulate.trace import with_system_prompt as _with_system_prompt

    # Eight requests with distinct bodies, arriving together: the cost model
    # spreads them over the 4 prefill nodes.
    base = [T(i, 0.0, [100 + 10 * i, 101 + 10 * i], 1024, out=3) for i in range(8)]
    trace = _with_system_prompt(base, 2)
    assert all(r.hash_ids[:2] == trace[0].hash_ids[:2] for r in trace)
    assert trace[0].input_length == 1024 + 2 * 512
    sim = Simulation(SimConfig(prefill=4, decode=1, policy="mooncake",
                               model_profile=tiny_profile, hot_keys=2), trace)
    res = sim.run()
    served = {row["prefill"] for row in res.requests}
    assert len(served) > 1
    for key in trace[0].hash_ids[:2]:
        assert set(sim.scheduler.index.holders(key)) == served
    bound = _replica_bound(res, trace, lambda k: len(sim.scheduler.index.holders(k)))
    assert bound["by_uses"]["8"]["serving_nodes"] == len(served)
    assert bound["by_uses"]["8"]["holders_at_end"] == len(served)
    assert res.summary["decode_max_batch"] >= 1
    assert 0 < res.summary["decode_busy_share"] <= 1


def test_the_simulator_schedules_with_the_conductors_configuration():
    """Every scheduling knob but the experiment's own (its SLOs, rejection on
    or off, the simulated model's KV size) is what a default conductor runs."""
    from mooncaked.node.sections import ConductorSection
    sim = Simulation(SimConfig(prefill=1, decode=1), [])
    mine = sim.scheduler.config
    experiment = dict(ttft_slo_s=mine.ttft_slo_s, tbt_slo_s=mine.tbt_slo_s, reject=mine.reject,
                      kv_bytes_per_token=mine.kv_bytes_per_token,
                      reject_on_current_load=mine.reject_on_current_load)
    assert mine == core.scheduler_config(ConductorSection(), **experiment)
