"""Algorithm 1 and the policies on constructed cluster states."""
import math

import pytest

from roles.scheduling import (DecodeEstimator, Decision, NodeReport, PolynomialPrefillEstimator,
                              Rejection, ScheduleRequest, Scheduler, SchedulerConfig,
                              TransferEstimator, make_policy)

BS = 256
KVB = 1000  # bytes per token: makes transfer times easy to compute by hand


def make_sched(policy="mooncake", n_prefill=3, ttft_slo=30.0, tbt_slo=0.1, bw=1e6,
               threshold=1.5, **params):
    # prefill: 1 ms per new token, linear: T_prefill = 0.001 * (N - p)
    est = PolynomialPrefillEstimator({"n": 1e-3})
    if policy == "mooncake":
        params.setdefault("kvcache_balancing_threshold", threshold)
    cfg = SchedulerConfig(policy=policy, policy_params=params, ttft_slo_s=ttft_slo,
                          tbt_slo_s=tbt_slo, kv_bytes_per_token=KVB,
                          # Algorithm 1's own mechanics: the queue as nodes report it, one fit.
                          queue_from_bookings=False, per_node_prefill_fit=False)
    s = Scheduler(cfg, est, TransferEstimator(bw), DecodeEstimator(0.02, 0.001, 0.0))
    for i in range(n_prefill):
        s.add_prefill_node(f"p{i}")
    s.add_decode_node("d0", page_budget=10_000, page_tokens=BS)
    s.add_decode_node("d1", page_budget=10_000, page_tokens=BS)
    return s


def req(rid, n_blocks, tokens=None, out=10, base=100):
    """Blocks base, base + 1, ...: requests of one base share their prefix."""
    tokens = tokens if tokens is not None else n_blocks * BS
    return ScheduleRequest(rid, tuple(range(base, base + n_blocks)), tokens, BS, out)


def load(s, node, seconds, now=0.0):
    s.on_node_report(node, NodeReport(at=now, queued_prefill_s=seconds), now)


def test_picks_min_ttft_not_longest_prefix():
    s = make_sched(threshold=100.0)  # high threshold: no transfers
    s.on_events("p0", 0, range(100, 108), [])  # p0 holds 8 of 10 blocks
    s.on_events("p1", 0, range(100, 102), [])  # p1 holds 2
    load(s, "p0", 5.0)
    load(s, "p2", 5.0)
    d = s.schedule(req("r", 10), now=0.0)
    assert isinstance(d, Decision)
    # p0: 5 + 0.001*512 = 5.512 ; p1: 0 + 0.001*2048 = 2.048 ; p2: 5 + 2.56
    assert d.prefill_node == "p1"
    assert d.local_prefix_tokens == 2 * BS and d.transfer is None
    assert d.predicted_ttft_s == pytest.approx(2.048)
    assert (d.t_queue, d.t_transfer) == (0.0, 0.0)


def test_longest_prefix_wins_when_idle():
    s = make_sched(threshold=100.0)
    s.on_events("p0", 0, range(100, 108), [])
    d = s.schedule(req("r", 10), now=0.0)
    assert d.prefill_node == "p0" and d.predicted_ttft_s == pytest.approx(0.512)


def test_plans_transfer_above_threshold():
    s = make_sched(threshold=1.5)
    s.on_events("p0", 0, range(100, 108), [])  # best holder, but loaded
    s.on_events("p1", 0, range(100, 102), [])  # 8/2 = 4 > 1.5: pull
    load(s, "p0", 10.0)
    d = s.schedule(req("r", 10), now=0.0)
    assert d.prefill_node in ("p1", "p2")
    # p1 pulls 6 blocks = 1536 tokens * 1000 B / 1e6 B/s = 1.536 s, computes 512
    # p2 pulls 8 blocks = 2.048 s, computes 512: p1 wins
    assert d.prefill_node == "p1"
    assert d.transfer.source == "p0"
    assert (d.transfer.from_block, d.transfer.to_block) == (2, 8)
    assert d.t_transfer == pytest.approx(1.536)
    assert d.predicted_ttft_s == pytest.approx(1.536 + 0.512)
    assert d.prefix_tokens == 8 * BS and d.local_prefix_tokens == 2 * BS


def test_recomputes_below_threshold():
    s = make_sched(threshold=1.5)
    s.on_events("p0", 0, range(100, 106), [])  # 6 blocks
    s.on_events("p1", 0, range(100, 105), [])  # 5 blocks: 6/5 = 1.2 <= 1.5
    load(s, "p0", 10.0)
    load(s, "p2", 10.0)
    d = s.schedule(req("r", 10), now=0.0)
    assert d.prefill_node == "p1" and d.transfer is None
    assert d.predicted_ttft_s == pytest.approx(0.001 * 5 * BS)


def test_hot_holder_nic_queue_raises_transfer_estimate():
    s = make_sched(threshold=1.5, n_prefill=3)
    s.on_events("p0", 0, range(100, 110), [])
    load(s, "p0", 100.0)
    d1 = s.schedule(req("a", 10), now=0.0)
    assert d1.transfer is not None
    # "b" would queue behind "a", which computes its prefix there: that
    # node drains, so "b" pulls too.
    s.prefill[d1.prefill_node].accepting = False
    d2 = s.schedule(req("b", 10), now=0.0)
    # the second pull waits for the first on p0's NIC
    assert d2.transfer is not None and d2.t_transfer > d1.t_transfer


def test_a_request_queues_behind_the_one_computing_its_prefix():
    # "a" computes 10 blocks on p0 (2.56 s).  "b" shares its first 8 blocks:
    # elsewhere it would compute all 10 (2.56 s); behind "a" on p0 it waits
    # 2.56 s and computes 2 blocks (0.512 s) - dearer, so an idle p1 takes
    # it.  Once p1 and p2 are loaded (5 s), p0's 3.072 s wins, priced with
    # the 8 pending blocks as its local prefix.
    s = make_sched(threshold=100.0)
    a = s.schedule(req("a", 10), now=0.0)
    assert a.prefill_node == "p0" and a.predicted_ttft_s == pytest.approx(2.56)
    b = ScheduleRequest("b", tuple(range(100, 108)) + (900, 901), 10 * BS, BS, 10)
    first = s.schedule(b, now=0.0)
    assert first.prefill_node != "p0"
    s.on_prefill_finished(first.prefill_node, "b", now=0.0, actual_seconds=0.0)
    s.on_decode_finished(first.decode_node, "b", now=0.0)
    load(s, "p1", 5.0)
    load(s, "p2", 5.0)
    d = s.schedule(b, now=0.0)
    assert d.prefill_node == "p0" and d.transfer is None
    assert d.local_prefix_tokens == 8 * BS
    assert d.predicted_ttft_s == pytest.approx(2.56 + 0.512)


def test_at_threshold_one_a_node_pulls_whatever_longer_prefix_another_holds():
    # p1 holds 5 of p0's 6 blocks (6/5 = 1.2 <= threshold 1.5: recompute);
    # at 1.0 (the default) it pulls the sixth at 10 MB/s (0.0256 s) instead
    # of computing it (0.256 s).
    s = make_sched(threshold=1.0, bw=1e7)
    s.on_events("p0", 0, range(100, 106), [])
    s.on_events("p1", 0, range(100, 105), [])
    load(s, "p0", 10.0)
    load(s, "p2", 10.0)
    d = s.schedule(req("r", 10), now=0.0)
    assert d.prefill_node == "p1" and d.transfer is not None
    assert d.predicted_ttft_s == pytest.approx(0.0256 + 0.001 * 4 * BS)


def test_rejects_when_no_node_meets_ttft_slo():
    s = make_sched(ttft_slo=3.0)
    for n in ("p0", "p1", "p2"):
        load(s, n, 10.0)
    r = s.schedule(req("r", 10), now=0.0)
    assert isinstance(r, Rejection) and r.reason == "ttft_slo"
    assert r.predicted_ttft_s == pytest.approx(12.56)
    assert r.retry_after_s == pytest.approx(9.56)
    assert s.rejections == {"ttft_slo": 1}
    assert not s.inflight


def test_rejects_on_tbt_slo():
    s = make_sched(tbt_slo=0.01)  # decode step is >= 20 ms
    r = s.schedule(req("r", 4), now=0.0)
    assert isinstance(r, Rejection) and r.reason == "tbt_slo"


def test_decode_selection_by_load_and_pages():
    s = make_sched()
    a = s.schedule(req("a", 4), now=0.0)
    b = s.schedule(req("b", 4), now=0.0)
    assert {a.decode_node, b.decode_node} == {"d0", "d1"}  # spreads batch
    assert a.predicted_tbt_s == pytest.approx(0.021)
    s.decode["d0"].free_pages = 0
    s.decode["d1"].free_pages = 0
    r = s.schedule(req("c", 4), now=0.0)
    assert isinstance(r, Rejection) and r.reason == "no_decode_capacity"


def test_queue_accounting_and_feedback():
    s = make_sched(policy="load_balance")
    d = s.schedule(req("a", 4), now=0.0)
    node = d.prefill_node
    assert s.prefill[node].queue_time(0.0) == pytest.approx(1.024)
    s.on_prefill_started(node, "a", 0.5)
    assert s.prefill[node].queue_time(1.0) == pytest.approx(0.524)
    s.on_prefill_finished(node, "a", now=2.0, actual_seconds=1.5)
    assert s.prefill[node].queue_time(2.0) == 0.0
    assert s.estimator_error()["mean_s"] == pytest.approx(1.024 - 2.0)
    s.on_decode_finished(d.decode_node, "a", 3.0)
    assert s.decode[d.decode_node].free_pages == 10_000
    # reports replace our own accounting for work sent before them
    s.schedule(req("b", 4), now=3.0)
    s.on_node_report(node, NodeReport(at=4.0, queued_prefill_s=7.0), 4.0)
    assert s.prefill[node].queue_time(5.0) == pytest.approx(6.0)


def test_dead_node_is_skipped_and_unindexed():
    s = make_sched(threshold=100.0)
    s.on_events("p0", 0, range(100, 110), [])
    s.mark_dead("p0")
    d = s.schedule(req("r", 10), now=0.0)
    assert d.prefill_node != "p0" and d.prefix_tokens == 0
    assert s.index.holders(100) == []


@pytest.mark.parametrize("name", ["random", "round_robin", "load_balance", "local_cache_aware",
                                  "mooncake", "sglang_cache_aware", "dynamo_kv",
                                  "llmd_weighted"])
def test_every_policy_decides(name):
    s = make_sched(policy=name)
    s.on_events("p2", 0, range(100, 108), [])
    d = s.schedule(req("r", 10), now=0.0)
    assert isinstance(d, Decision) and d.policy == name
    assert d.predicted_ttft_s == pytest.approx(d.t_queue + d.t_transfer + d.t_prefill)


def test_round_robin_cycles():
    s = make_sched(policy="round_robin")
    nodes = [s.schedule(req(f"r{i}", 2), 0.0).prefill_node for i in range(6)]
    assert nodes == ["p0", "p1", "p2"] * 2


def test_sglang_rules():
    s = make_sched(policy="sglang_cache_aware")
    s.on_events("p1", 0, range(100, 104), [])  # 4/10 = 0.4 > 0.3: cache wins
    assert s.schedule(req("a", 10), 0.0).prefill_node == "p1"
    # below the 0.3 match threshold: least-cached worker (p0 or p2, not p1)
    s2 = make_sched(policy="sglang_cache_aware")
    s2.on_events("p1", 0, range(100, 102), [])
    s2.on_events("p0", 0, range(500, 510), [])
    assert s2.schedule(req("b", 10), 0.0).prefill_node == "p2"
    # imbalance: p1 has > 64 outstanding more than others -> shortest queue
    s3 = make_sched(policy="sglang_cache_aware")
    s3.on_events("p1", 0, range(100, 110), [])
    s3._outstanding.update({"p0": 70, "p1": 100, "p2": 5})
    assert s3.schedule(req("c", 10), 0.0).prefill_node == "p2"


def test_bad_inputs():
    with pytest.raises(ValueError, match="policy"):
        make_policy("nope")
    with pytest.raises(ValueError, match="block_keys"):
        ScheduleRequest("x", (1, 2), 1000, 256)
    with pytest.raises(ValueError, match="ttft_slo_s"):
        SchedulerConfig(ttft_slo_s=0)
    with pytest.raises(ValueError, match="kvcache_balancing_threshold"):
        make_policy("mooncake", kvcache_balancing_threshold=0.5)
    s = make_sched()
    s.schedule(req("dup", 2), 0.0)
    with pytest.raises(ValueError, match="already scheduled"):
        s.schedule(req("dup", 2), 0.0)


def test_no_prefill_nodes():
    s = make_sched(n_prefill=0)
    r = s.schedule(req("r", 2), 0.0)
    assert isinstance(r, Rejection) and r.reason == "no_prefill_node"
    assert math.isinf(r.predicted_ttft_s)


def test_draining_node_gets_no_prefill_but_still_serves_its_cache():
    s = make_sched(threshold=1.5)
    s.on_events("p0", 0, range(100, 110), [])
    s.prefill["p0"].accepting = False
    d = s.schedule(req("r", 10), now=0.0)
    assert d.prefill_node != "p0"
    assert d.transfer is not None and d.transfer.source == "p0"


def test_cancelled_prefill_releases_booking_without_learning():
    s = make_sched(policy="load_balance")
    est = s.prefill_est
    est.refit_every = 1
    d = s.schedule(req("a", 4), now=0.0)
    s.on_prefill_finished(d.prefill_node, "a", now=1.0, actual_seconds=0.0)
    assert s.prefill[d.prefill_node].queue_time(1.0) == 0.0
    assert not est.samples and s.estimator_error()["count"] == 0


def test_prediction_errors_stay_bounded_while_totals_cover_every_request():
    """A long-running conductor must not grow with traffic: the recent-error
    window is bounded, the mean over every request stays exact."""
    from roles.scheduling.scheduler import RECENT_TTFT_ERRORS

    s = make_sched(policy="load_balance")
    n = RECENT_TTFT_ERRORS + 50
    seen = []
    for i in range(n):
        d = s.schedule(req(f"r{i}", 4), now=float(i))
        s.on_prefill_finished(d.prefill_node, f"r{i}", now=float(i) + 2.0, actual_seconds=1.5)
        seen.append(s.ttft_errors[-1])
        s.on_decode_finished(d.decode_node, f"r{i}", now=float(i) + 3.0)
    assert len(s.ttft_errors) == RECENT_TTFT_ERRORS
    assert list(s.ttft_errors) == seen[-RECENT_TTFT_ERRORS:]
    err = s.estimator_error()
    assert err["count"] == n
    assert err["mean_s"] == pytest.approx(sum(seen) / n)
    assert err["mean_abs_s"] == pytest.approx(sum(abs(e) for e in seen) / n)


def test_the_estimator_is_fitted_on_the_prefix_actually_reused():
    """The plan said 8 cached blocks; the node reused only 2 (a failed fetch,
    an eviction): the sample is (N - 2 blocks, 2 blocks, seconds)."""
    s = make_sched(threshold=100.0)
    s.on_events("p0", 0, range(100, 108), [])
    d = s.schedule(req("r", 10), now=0.0)
    assert d.prefill_node == "p0" and d.prefix_tokens == 8 * BS
    s.on_prefill_finished("p0", "r", now=3.0, actual_seconds=2.0,
                          actual_prefix_tokens=2 * BS)
    assert list(s.prefill_est.samples) == [(8 * BS, 2 * BS, 2.0)]
    # Without the figure (the simulator's exact runs) the plan is the sample.
    d = s.schedule(req("q", 10), now=4.0)
    s.on_prefill_finished(d.prefill_node, "q", now=5.0, actual_seconds=0.5)
    assert s.prefill_est.samples[-1] == (10 * BS - d.prefix_tokens, d.prefix_tokens, 0.5)


def test_bookings_stay_counted_until_the_node_reports_holding_them():
    """A request booked at t=0 may reach the node only after its decode
    reservation: a report at t=1 that does not list it must not drop it."""
    s = make_sched(policy="load_balance", n_prefill=1)
    a = s.schedule(req("a", 4), now=0.0)          # 1.024 s of work each
    s.schedule(req("b", 4, base=200), now=0.0)
    assert a.prefill_node == "p0" and s.prefill["p0"].queue_time(0.0) == pytest.approx(2.048)
    # The node holds only "a" (0.9 s of work left by its own figure).
    s.on_node_report("p0", NodeReport(at=1.0, queued_prefill_s=0.9,
                                      prefill_requests=frozenset({"a"})), 1.0)
    assert set(s.prefill["p0"].pending) == {"b"}
    assert s.prefill["p0"].queue_time(1.0) == pytest.approx(0.9 + 1.024)
    # Once it reports "b" too, the node's figure is the whole queue.
    s.on_node_report("p0", NodeReport(at=2.0, queued_prefill_s=1.5,
                                      prefill_requests=frozenset({"a", "b"})), 2.0)
    assert s.prefill["p0"].pending == {} and s.prefill["p0"].queue_time(2.0) == pytest.approx(1.5)
    # The old rule (no ids): anything booked before the report counts as in it.
    s.schedule(req("c", 4), now=2.5)
    s.on_node_report("p0", NodeReport(at=3.0, queued_prefill_s=1.0), 3.0)
    assert s.prefill["p0"].pending == {}


def test_a_rejection_tells_the_prediction_and_the_limit_it_exceeded():
    from roles.scheduling.state import Rejection
    assert Rejection("r", "ttft_slo", 1.25, 0.02, 2.0, 0.8).message() == \
        "rejected (ttft_slo): predicted TTFT 1.25s over the admit limit 0.8s, TBT 20ms; retry later"
    assert Rejection("r", "tbt_slo", 0.1, 0.2, 1.0, 0.15).message() == \
        "rejected (tbt_slo): predicted TTFT 0.1s, TBT 200ms over the admit limit 150ms; retry later"
    assert Rejection("r", "no_prefill_node", math.inf, math.inf, 1.0).message() == \
        "rejected (no_prefill_node): no prefill node; retry later"
